"""The one load-or-build cache (core.artifacts) on tiny text artifacts: atomic builds, manifest checks,
rebuilds of broken artifacts, keys, and two processes asking for the same artifact at once."""

import copy
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from core.artifacts import Artifact, load_or_build, model_fingerprint, report_of
from core.errors import BenchError
from tests.helpers import ROOT


def text_artifact(builds: list, contents=lambda n: "42", **key) -> Artifact:
    """An artifact holding ``number.txt``; each build appends to ``builds`` and writes ``contents(n)``
    (n = builds so far); loading parses the number."""

    def build(folder: Path) -> dict:
        builds.append(folder)
        (folder / "number.txt").write_text(contents(len(builds)))
        return {"builds": len(builds)}

    return Artifact("demo", "number", key or {"recipe": 1}, build, lambda folder: int((folder / "number.txt").read_text()),
                    trained_by="demo", description="demo number")


def test_how_to_build_is_said_in_one_place():
    """Trainers name only what trains a part; the command a user runs is worded here, once."""
    from core.artifacts import how_to_build

    def art(**kw):
        return Artifact("k", "n", {}, lambda f: None, lambda f: None, **kw)

    assert how_to_build(art()) == "run with train_if_missing=true"
    assert how_to_build(art(otherwise="method.search=online")) == "run with train_if_missing=true, or method.search=online"
    assert how_to_build(art(trained_by="store")) == ("run 'python -m bench train store' with the same pair= and recipe= "
                                                     "(or train_if_missing=true)")
    assert how_to_build(art(trained_by="space", same=("method.masks",))) == (
        "run 'python -m bench train method method=space' with the same pair=, recipe= and method.masks= "
        "(or train_if_missing=true)")
    assert "'python -m bench train method' for the method that reads it," in how_to_build(art(trained_by="method"))


def test_built_once_then_loaded_with_its_report(tmp_path):
    builds = []
    art = text_artifact(builds)
    assert load_or_build(art, tmp_path) == 42 and load_or_build(art, tmp_path, build_if_missing=False) == 42
    assert len(builds) == 1
    assert report_of(art, tmp_path) == {"builds": 1}
    assert sorted(p.name for p in art.folder(tmp_path).iterdir()) == ["manifest.json", "number.txt"]


def test_missing_and_not_allowed_is_one_sentence_with_the_hint(tmp_path):
    art = text_artifact([])
    with pytest.raises(BenchError, match=rf"no cached demo number at {re.escape(str(art.folder(tmp_path)))}; run 'python -m bench train method method=demo' with the same pair= and recipe= \(or train_if_missing=true\)\.$"):
        load_or_build(art, tmp_path, build_if_missing=False)
    assert not art.folder(tmp_path).exists()


def test_a_build_that_raises_leaves_no_folder(tmp_path):
    def build(folder: Path):
        (folder / "half.txt").write_text("half written")
        raise RuntimeError("killed mid-build")

    art = Artifact("demo", "broken", {}, build, lambda folder: folder)
    with pytest.raises(RuntimeError, match="killed mid-build"):
        load_or_build(art, tmp_path)
    assert not art.folder(tmp_path).exists()
    assert [p.name for p in (tmp_path / "demo").iterdir() if not p.name.endswith(".lock")] == []  # no temp folder


def test_a_truncated_file_is_rebuilt_when_allowed_else_one_sentence(tmp_path):
    builds = []
    art = text_artifact(builds, contents=lambda n: "1234567890")
    load_or_build(art, tmp_path)
    path = art.folder(tmp_path) / "number.txt"
    path.write_text("12345")  # fewer bytes than the manifest says
    with pytest.raises(BenchError, match=rf"cached demo number at {re.escape(str(art.folder(tmp_path)))} cannot be used "
                                         r"\(number.txt has 5 bytes, not 10 \(truncated\?\)\); run 'python -m bench train method method=demo' with the same pair= and recipe= \(or train_if_missing=true\)\.$"):
        load_or_build(art, tmp_path, build_if_missing=False)
    assert load_or_build(art, tmp_path) == 1234567890 and len(builds) == 2
    path.write_text("1234567899")  # same size, other bytes: the checksum tells
    with pytest.raises(BenchError, match="does not match its checksum"):
        load_or_build(art, tmp_path, build_if_missing=False)


def test_a_file_whose_load_raises_is_rebuilt_once_when_allowed(tmp_path):
    builds = []
    art = text_artifact(builds, contents=lambda n: "not a number" if n == 1 else "7")
    assert load_or_build(art, tmp_path) == 7 and len(builds) == 2  # the first build loaded badly: rebuilt once

    builds = []
    art = text_artifact(builds, contents=lambda n: "not a number", recipe=2)
    with pytest.raises(BenchError, match=r"built at .* cannot be loaded \(ValueError: invalid literal"):
        load_or_build(art, tmp_path)
    assert len(builds) == 2  # never a loop
    with pytest.raises(BenchError, match=rf"cached demo number at {re.escape(str(art.folder(tmp_path)))} cannot be loaded "
                                         r"\(ValueError: .*\); run 'python -m bench train method method=demo' with the same pair= and recipe= \(or train_if_missing=true\)\.$"):
        load_or_build(art, tmp_path, build_if_missing=False)
    assert len(builds) == 2


def test_the_key_changes_with_version_and_recipe_only(tmp_path):
    art = text_artifact([], recipe={"lr": 0.1, "layers": [0, 1]})
    folder = art.folder(tmp_path)
    assert dataclasses.replace(art, version=2).folder(tmp_path) != folder
    assert text_artifact([], recipe={"lr": 0.2, "layers": [0, 1]}).folder(tmp_path) != folder
    # An OmegaConf recipe nested in the key hashes by its values, like the plain dict.
    nested = OmegaConf.create({"layers": [0, 1], "lr": 0.1})
    assert text_artifact([], recipe=nested).folder(tmp_path) == folder
    assert folder.parent == tmp_path / "demo" and folder.name.startswith("number-")


def test_model_fingerprint_follows_the_weights_not_the_dtype(tiny_pair):
    model = tiny_pair.draft.module
    assert model_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == model_fingerprint(model)
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    assert model_fingerprint(other) != model_fingerprint(model)


# Each process waits for the other to be ready, then asks for the same artifact, whose build takes 1 s and
# appends a line to a counter file outside the cache.
TWO_PROCESSES = """
import sys, time
from pathlib import Path
from core.artifacts import Artifact, load_or_build
cache, counter, ready, me = (Path(a) for a in sys.argv[1:])
(ready / me).touch()
while len(list(ready.iterdir())) < 2:
    time.sleep(0.01)

def build(folder):
    time.sleep(1)
    with open(counter, "a") as fh:
        fh.write("built\\n")
    (folder / "x.txt").write_text("shared")

print(load_or_build(Artifact("demo", "shared", {"n": 1}, build, lambda f: (f / "x.txt").read_text()), cache))
"""


def test_two_processes_build_the_same_artifact_once(tmp_path):
    counter, ready = tmp_path / "builds.txt", tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, str(tmp_path / "cache"), str(counter), str(ready),
                               name], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.strip() for out, _ in outs] == ["shared", "shared"]
    assert counter.read_text() == "built\n"
    assert any("waiting for another process" in err for _, err in outs)  # the second one waited on the lock
