"""The command line as users meet it: a tiny end-to-end run, the output contract, and bad input."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def bench(*args, cache_dir, timeout=600):
    env = {**os.environ, "BENCH_CACHE": str(cache_dir), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("run")
    res = bench("run", "method=sd", "pair=tiny", "max_new_tokens=12", "dataset.n_prompts=3",
                f"hydra.run.dir={out}", cache_dir=cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


def test_run_writes_records_and_provenance(tiny_run):
    out, res = tiny_run
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert not (out / "records.partial.jsonl").exists()
    assert {r["method"] for r in records} == {"ar", "sd"} and len(records) == 6
    required = {"method", "pair", "dataset", "prompt_id", "category", "prompt_ids", "output_ids", "output_text",
                "new_tokens", "wall_s", "ttft_s", "tokens_per_s", "accept_lengths", "target_calls", "draft_calls",
                "flops", "peak_mem_bytes", "speedup"}
    for r in records:
        assert required <= r.keys()
        assert r["new_tokens"] == len(r["output_ids"]) <= 12
        assert 0 < r["ttft_s"] <= r["wall_s"]
        assert r["flops"]["total"] == pytest.approx(sum(v for k, v in r["flops"].items() if k != "total"))
    sd = [r for r in records if r["method"] == "sd"]
    assert all(r["matches_baseline"] for r in sd)  # greedy sd == ar inside the run itself
    assert all(r["draft_calls"] > 0 for r in sd)
    prov = json.loads((out / "run.json").read_text())
    assert prov["status"] == "complete"
    assert {"config", "git", "versions", "device", "cpu", "threads", "seed", "summary"} <= prov.keys()
    assert "speedup" in res.stdout and "sd" in res.stdout  # the summary table is printed


@pytest.mark.newest_only
@pytest.mark.parametrize("args,needle", [
    (["method=nope"], "unknown method 'nope'; choose one of:"),
    (["pair=nope"], "unknown pair 'nope'"),
    (["dataset=nope"], "unknown dataset 'nope'"),
    (["method.gamma=0"], "method.gamma=0 is not allowed; it takes an integer >= 1"),
    (["temperature=nan"], "temperature=nan is not allowed; it takes a number >= 0"),
    (["max_new_tokens=abc"], "max_new_tokens='abc' is not allowed; it takes an integer >= 1"),
    (["method=medusa", "method.num_heads=3"], "unknown key method.num_heads; method=medusa has: name, tree,"),
    (["pair=gpt2", "pair.target.id=/does/not/exist"], "pair.target.id: model path '/does/not/exist' does not exist."),
    (["compile=true", "compile_buckets=[0,4]"], "compile_buckets"),
    (["batch_size=0"], "batch_size=0 is not allowed; it takes an integer >= 1"),
])
def test_bad_input_one_sentence_exit_2_nothing_written(tmp_path, cache_dir, monkeypatch, capsys, args, needle):
    """The command line's entry point, in-process (a subprocess costs seconds of imports; the tests below run the real
    one): one sentence on stderr, exit status 2, and not even the run directory."""
    from bench.__main__ import main

    monkeypatch.setenv("BENCH_CACHE", str(cache_dir))
    out = tmp_path / "run"
    code = main(["run", "pair=tiny", *args, f"hydra.run.dir={out}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.newest_only
def test_a_sweep_is_checked_job_by_job_before_any_starts(tmp_path, cache_dir):
    """One bad job in a -m sweep stops the whole sweep before Hydra creates its directory."""
    out = tmp_path / "sweep"
    res = bench("run", "-m", "pair=tiny", "method=sd,pld", "method.draft_len=0,2", f"hydra.sweep.dir={out}",
                cache_dir=cache_dir, timeout=300)
    assert res.returncode == 2
    # Jobs are method x draft_len: sd has no draft_len (its node's keys are listed), checked before pld's 0.
    assert "unknown key method.draft_len; method=sd has:" in res.stderr
    assert not out.exists()


@pytest.mark.newest_only
def test_unknown_command(cache_dir):
    res = bench("fly", cache_dir=cache_dir)
    assert res.returncode == 2 and "unknown command 'fly'" in res.stderr


def test_train_all_methods_trains_only_those(cache_dir, capsys):
    """``train all methods=a,b`` sets up the named methods only (and the drafts they use); an unknown name is one
    sentence and exit 2."""
    from bench.__main__ import main

    assert main(["train", "all", "methods=pld,medusa", "pair=tiny", f"cache_dir={cache_dir}", "recipe=smoke"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert set(reports) == {"pair (stores and drafts)", "pld", "medusa"}
    assert len(reports["medusa"]["agreement_after"]) == 4  # the heads trained (or were read back) and reported
    assert main(["train", "all", "methods=medusa,nope", "pair=tiny", f"cache_dir={cache_dir}"]) == 2
    err = capsys.readouterr().err
    assert "unknown: nope; known:" in err and len(err.strip().splitlines()) == 1


def test_a_users_own_models_replace_the_pairs_from_the_command_line(tmp_path, cache_dir):
    """On the default pair (a packaged target, a distilled draft): switching a model's source drops the pair file's
    keys of the old source (package, file; recipe) and the run decodes the user's folders; a key the user types
    that the new source does not take is still refused."""
    from tests.helpers import local_folder

    sizes = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    target = local_folder(tmp_path / "target", "llama", num_hidden_layers=2, **sizes)
    draft = local_folder(tmp_path / "draft", "llama", num_hidden_layers=1, **sizes)
    out = tmp_path / "run"
    res = bench("run", "method=sd", "pair.name=mine", "pair.target.source=hub", f"pair.target.id={target}",
                "pair.drafts.0.source=hub", f"pair.drafts.0.id={draft}", "max_new_tokens=8", "dataset.n_prompts=2",
                f"hydra.run.dir={out}", cache_dir=cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["pair"] for r in records} == {"mine"} and all(r["matches_baseline"] for r in records if r["method"] == "sd")
    config = json.loads((out / "run.json").read_text())["config"]["pair"]
    assert config["target"] == {"source": "hub", "id": target} and config["drafts"] == [{"source": "hub", "id": draft}]

    res = bench("run", "pair.target.source=hub", f"pair.target.id={target}", "pair.target.package=x",
                f"hydra.run.dir={tmp_path / 'bad'}", cache_dir=cache_dir)
    assert res.returncode == 2 and "unknown key pair.target.package; pair.target has: source, id." in res.stderr
    assert not (tmp_path / "bad").exists()
