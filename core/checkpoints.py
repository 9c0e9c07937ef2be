"""The authors' published drafter checkpoints (Medusa, Hydra, EAGLE), read completely and checked.

The authors' own loaders call ``load_state_dict(strict=False)`` (Medusa, Hydra) and so drop whatever does not fit
without a word. Here a method's mapping *takes* every tensor of the file by name with the shape it expects
(:meth:`Checkpoint.take`), and :meth:`Checkpoint.finish` refuses a file that holds anything the mapping did not
take. A missing or unexpected key, another hidden size or vocabulary, a config naming another base model, a
file that is not a checkpoint: one sentence naming the file and the key, before any decoding.

Pickled files (``.pt``, ``.bin``) are read with ``weights_only``: one that would run code is refused, never
executed. A hub id is fetched with ``huggingface_hub`` (only the config and weight files); no hub model runs
remote code.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import torch

from core.artifacts import Artifact, file_sha256, load_or_build, model_fingerprint, report_of
from core.errors import BenchError


def locate(weights: str, files: tuple[str, ...]) -> Path:
    """The folder holding a published checkpoint: ``weights`` itself when it is a local folder, else the hub
    repository ``owner/name`` downloaded into the Hugging Face cache (``config.json`` and ``files`` only)."""
    path = Path(weights).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise BenchError(f"method.weights={weights} is a file; give the folder that holds it ({' or '.join(files)}).")
    if weights.startswith(("/", ".", "~")) or weights.count("/") != 1:
        raise BenchError(f"method.weights={weights}: no such folder (a hub id is written owner/name).")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(weights, allow_patterns=["config.json", *files]))
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, no access: the same for the user
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise BenchError(f"method.weights={weights}: no such folder, and the hub did not give it ({why}).") from None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors``, ``.pt`` or ``.bin`` file, by name (on the CPU, as stored)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            blob = load_file(str(path))
        else:
            blob = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "unsupported global" not in str(err).lower():  # torch's words for a class or function reference
            raise BenchError(f"{path} is not a readable checkpoint (not a pickle of tensors).") from None
        raise BenchError(f"{path} holds Python objects besides tensors (loading it could run code); refused.") from None
    except Exception as err:  # noqa: BLE001 - truncated, not a zip, not safetensors: one problem for the user
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise BenchError(f"{path} is not a readable checkpoint ({why}).") from None
    if not isinstance(blob, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in blob.items()):
        raise BenchError(f"{path} is not a state dict (a mapping of names to tensors).")
    return blob


def same_model(a: str, b: str) -> bool:
    """Whether two model names (hub ids or local folders) name the same model: their last path parts agree
    (``lmsys/vicuna-7b-v1.3`` and ``/models/vicuna-7b-v1.3`` do)."""
    def tail(name: str) -> str:
        return str(name).rstrip("/").rpartition("/")[2].lower()

    return tail(a) == tail(b)


class Checkpoint:
    """One published checkpoint folder: its ``config.json`` (``{}`` when it has none) and the tensors of the first
    of ``files`` it holds. A mapping takes each tensor once; :meth:`finish` refuses leftovers.

    ``what`` names the layout in messages (``"Medusa heads"``: "not a Medusa heads checkpoint").
    """

    def __init__(self, folder: Path, files: tuple[str, ...], what: str):
        self.folder, self.what = Path(folder), what
        found = [self.folder / f for f in files if (self.folder / f).is_file()]
        if not found:
            raise BenchError(f"{self.folder} holds none of {', '.join(files)}: not a published {what} checkpoint.")
        self.file = found[0]
        self.config = self._read_config()
        self.taken: set[str] = set()

    def _read_config(self) -> dict:
        path = self.folder / "config.json"
        if not path.is_file():
            return {}
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise BenchError(f"{path} is not readable JSON ({err}).") from None
        if not isinstance(config, dict):
            raise BenchError(f"{path} is not a JSON object.")
        return config

    @cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        return read_tensors(self.file)

    @cached_property
    def sha256(self) -> str:
        return file_sha256(self.file)

    def keys(self, prefix: str = "") -> list[str]:
        """The file's keys that start with ``prefix``, sorted."""
        return sorted(k for k in self.tensors if k.startswith(prefix))

    def has(self, key: str) -> bool:
        return key in self.tensors

    def take(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``key``, which must have ``shape``; marked as used."""
        if key not in self.tensors:
            raise BenchError(f"{self.file} has no tensor '{key}', which {self.what} checkpoints hold: another layout, "
                             "or another kind of checkpoint.")
        value = self.tensors[key]
        if tuple(value.shape) != tuple(shape):
            raise BenchError(f"{self.file}: '{key}' has shape {tuple(value.shape)}, not {tuple(shape)}: this "
                             f"{self.what} checkpoint was made for a model of other sizes than this target.")
        self.taken.add(key)
        return value

    def field(self, name: str, default=None, kind: type | tuple = int):
        """``config.json``'s ``name`` (``default`` when absent; a value of another type is one sentence)."""
        value = self.config.get(name, default)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:  # True is an int to Python
            names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
            what = " or ".join(names.get(k, k.__name__) for k in kinds)
            raise BenchError(f"{self.folder / 'config.json'}: '{name}' is {value!r}, not {what}.")
        return value

    def check_base(self, target_name: str | None) -> None:
        """The config's ``base_model_name_or_path`` (when it has one) names the pair's target (when it has a name)."""
        base = self.config.get("base_model_name_or_path")
        if base and target_name and not same_model(base, target_name):
            raise BenchError(f"{self.folder / 'config.json'} says this {self.what} checkpoint was trained for "
                             f"'{base}', but the pair's target is '{target_name}'.")

    def finish(self) -> None:
        """Every tensor of the file was taken: anything left is a layout this mapping does not know."""
        left = sorted(set(self.tensors) - self.taken)
        if left:
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise BenchError(f"{self.file} holds '{left[0]}'{more}, which {self.what} checkpoints do not: another "
                             "layout or another method's checkpoint.")

    def report(self) -> dict:
        """What a run records about the weights it used."""
        return {"weights": str(self.folder), "file": self.file.name, "sha256": self.sha256,
                "tensors": len(self.tensors), "config": self.config}


def load_converted(ck: Checkpoint, method: str, target, cache, convert: Callable[[], object],
                   save: Callable[[object], dict], load: Callable[[dict], object],
                   reader: int = 1) -> tuple[object, dict]:
    """The checkpoint ``ck`` converted for ``method`` once and cached (``cache_dir/published/<method>-<folder>/``),
    keyed by the file's SHA-256, the target's weights and ``reader`` (the version of the method's reading of the
    layout, raised when it changes what a file converts to), so another file, the same file for another target, or
    one converted by an earlier reading is converted and checked anew. ``convert()`` reads ``ck`` into the method's
    modules, ``save(made)`` is what the cached file holds (read back with ``weights_only``), ``load(blob)`` rebuilds
    the modules from it. Returns them and the build report (the folder, file, checksum and config read)."""
    key = {"file": ck.file.name, "sha256": ck.sha256, "method": method, "target": model_fingerprint(target),
           "reader": reader}

    def build(folder: Path) -> dict:
        torch.save(save(convert()), folder / "converted.pt")
        return ck.report()

    def read(folder: Path):
        return load(torch.load(folder / "converted.pt", map_location="cpu", weights_only=True))

    art = Artifact("published", f"{method}-{ck.folder.name}", key, build, read,
                   description=f"{ck.what} converted from {ck.file}")
    return load_or_build(art, cache, True), report_of(art, cache)
