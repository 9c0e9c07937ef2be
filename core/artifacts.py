"""The one load-or-build path for everything the harness builds or trains and keeps on disk.

Converted models, distilled drafts, draft heads, SPRINTER verifiers, n-gram tables and hierarchy's model
database all go through :func:`load_or_build`. An artifact lives in ``<cache>/<kind>/<name>-<key>/`` where
``key`` hashes everything its content depends on: the recipe, fingerprints of its inputs (models, tokenizer)
and the format version of its files. Alongside its files sits ``manifest.json`` with each file's size and
SHA-256, written last.

- Atomic: files are written into a temporary folder that is renamed into place only when the build succeeds;
  a killed build leaves nothing that looks finished.
- Locked: building takes an exclusive ``flock`` on ``<kind>/.<name>-<key>.lock``; a second process that wants
  the same artifact waits, then finds it built (it never builds it twice, never reads a half-written one).
- Checked: files that do not match their manifest (truncated, edited, foreign) or that fail to load are
  rebuilt when building is allowed, otherwise answered with one sentence naming the folder.

The pattern is that of ``datasets``' fingerprinted cache files (a ``map`` keyed by its function and input).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import BaseModel

from core.errors import BenchError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def jsonable(x):
    """Plain JSON-able data: OmegaConf nodes resolved into dicts and lists at any depth (a recipe nested in
    a key must hash by its values, not by its repr), everything else left as it is."""
    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    if isinstance(x, BaseModel):  # a typed settings object: its values as the command line would write them
        return x.model_dump(mode="json")
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def recipe_key(recipe, **added) -> dict:
    """A trainer's recipe as part of an artifact key, leaving out the settings named in ``added`` while they
    hold the given value (the one that trains as before they existed), so parts cached before a setting was
    added keep their key; set to anything else, the setting is keyed."""
    key = jsonable(recipe)
    return {k: v for k, v in key.items() if not (k in added and v == added[k])}


def content_key(*parts) -> str:
    """A short stable hash (12 hex digits) of JSON-able parts: an artifact is keyed by what produced it."""
    blob = json.dumps([jsonable(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def weights_sha256(module) -> str:
    """A SHA-256 of every parameter's name and bytes after rounding to bf16 (16 hex digits).

    Rounding first makes the fp32 CPU copy and the bf16 GPU copy of the same weights hash alike (both round
    to nearest even), while any retraining changes it. Hashing bytes is exact, and several times faster than
    summing the values in float64 (~1 s for a 135M-parameter fp32 model on 2 busy cores).

    A parameter whose name and shape its source's safetensors files hold (:func:`source_tensors`) is hashed
    from the file, not from memory: the key does not depend on the dtype the run loaded the model in (fp16
    rounds some bf16 values that fp32 and bf16 keep) nor on its device (no copy of a GPU model to the host).
    """
    import torch

    h = hashlib.sha256()
    with torch.no_grad(), source_tensors(module) as stored:
        for name, p in module.named_parameters():
            value = stored(name, tuple(p.shape))
            h.update(name.encode())
            h.update((p.detach() if value is None else value).to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy())
    return h.hexdigest()[:16]


def source_folder(module) -> Path | None:
    """The local folder a transformers model was loaded from (``config._name_or_path``: a path, or a hub id
    found in the local hub cache), or ``None`` (a model built in code, or a hub id not cached here)."""
    name = str(getattr(getattr(module, "config", None), "_name_or_path", "") or "")
    if not name:
        return None
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    try:
        from transformers.utils import cached_file

        found = cached_file(name, "config.json", local_files_only=True, _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):
        return None
    return Path(found).parent if found else None


@contextlib.contextmanager
def source_tensors(module):
    """Yields ``stored(name, shape)``: that tensor as the model's source safetensors files hold it (on the CPU,
    in the file's dtype), or ``None`` when no file holds it at that shape (a model built in code, a ``.bin``
    checkpoint, a weight renamed or reshaped on load)."""
    from safetensors import safe_open

    folder = source_folder(module)
    where = {}
    with contextlib.ExitStack() as stack:
        for path in sorted(folder.glob("*.safetensors")) if folder is not None else []:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            for key in handle.keys():
                where.setdefault(key, handle)

        def stored(name: str, shape: tuple):
            handle = where.get(name)
            if handle is None or tuple(handle.get_slice(name).get_shape()) != shape:
                return None
            return handle.get_tensor(name)

        yield stored


def model_fingerprint(module) -> dict:
    """What identifies a model's weights for caching: its class, shape and :func:`weights_sha256`."""
    config = getattr(module, "config", None)
    return {
        "class": type(module).__name__,
        "name": Path(str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", ""))).name,
        "model_type": getattr(config, "model_type", None),
        "layers": getattr(config, "num_hidden_layers", None),
        "hidden": getattr(config, "hidden_size", None),
        "vocab": getattr(config, "vocab_size", None),
        "params": sum(p.numel() for p in module.parameters()),
        "weights": weights_sha256(module),
    }


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of a tokenizer's vocabulary and special tokens: token-id tables are valid for the same ids only."""
    blob = json.dumps([type(tokenizer).__name__, len(tokenizer), sorted(tokenizer.get_vocab().items()),
                       tokenizer.all_special_ids], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Artifact:
    """One buildable, cacheable thing.

    ``build(folder)`` writes the artifact's files into ``folder`` (a temporary one) and may return a
    JSON-able report kept in the manifest; ``load(folder)`` reads them back. ``key`` holds everything the
    content depends on; ``version`` is the format of the files (bump it when ``build`` writes something new).
    ``trained_by``: what builds it on purpose when building is not allowed (:func:`how_to_build` says the
    command): ``store``, ``draft``, a method's name, ``method`` (whichever method reads it), or ``None`` (only a run
    with ``train_if_missing=true``); ``same``: settings beyond ``pair=`` and ``recipe=`` the command must repeat;
    ``otherwise``: another way out, said after the command.
    """

    kind: str
    name: str
    key: dict
    build: Callable[[Path], Any]
    load: Callable[[Path], Any]
    version: int = 1
    trained_by: str | None = None
    same: tuple[str, ...] = ()
    otherwise: str = ""
    description: str = ""

    def folder(self, cache: Path) -> Path:
        return Path(cache) / self.kind / f"{self.name}-{content_key(self.kind, self.version, self.key)}"

    @property
    def what(self) -> str:
        return self.description or f"{self.kind} artifact '{self.name}'"


def how_to_build(art: Artifact) -> str:
    """How a user builds ``art`` on purpose: the one place where a missing artifact becomes the command that
    builds it (methods and trainers name only what trains it, :attr:`Artifact.trained_by`)."""
    if art.trained_by is None:
        steps = "run with train_if_missing=true"
    else:
        what = {"store": "store", "draft": "draft", "method": "method"}.get(art.trained_by,
                                                                          f"method method={art.trained_by}")
        settings = ["pair=", "recipe=", *(f"{name}=" for name in art.same)]
        same = ", ".join(settings[:-1]) + " and " + settings[-1]
        reader = " for the method that reads it," if art.trained_by == "method" else ""
        steps = f"run 'python -m bench train {what}'{reader} with the same {same} (or train_if_missing=true)"
    return f"{steps}, or {art.otherwise}" if art.otherwise else steps


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 4 MiB blocks (model files do not fit in memory twice)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> dict[str, dict]:
    return {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a built artifact folder, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def problem(folder: Path) -> str | None:
    """Why ``folder`` is not a complete artifact (``None`` when it is): missing, no manifest, or a file that
    does not match its size or checksum."""
    if not folder.is_dir():
        return "missing"
    manifest = read_manifest(folder)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return "no readable manifest"
    for rel, meta in manifest["files"].items():
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != meta.get("bytes"):
            return f"{rel} has {path.stat().st_size} bytes, not {meta.get('bytes')} (truncated?)"
        if file_sha256(path) != meta.get("sha256"):
            return f"{rel} does not match its checksum"
    return None


@contextlib.contextmanager
def locked(folder: Path, what: str):
    """An exclusive lock for building ``folder``; a second process waits for the first (and says so)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process that is building the %s at %s", what, folder)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_dir(final: Path):
    """A temporary folder beside ``final`` that replaces it only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _build(art: Artifact, folder: Path) -> None:
    log.info("building the %s at %s (once)", art.what, folder)
    start = time.perf_counter()
    with atomic_dir(folder) as tmp:
        report = art.build(tmp)
        seconds = round(time.perf_counter() - start, 1)
        manifest = {"kind": art.kind, "name": art.name, "version": art.version, "key": jsonable(art.key),
                    "report": jsonable(report), "build_seconds": seconds,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": _files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    log.info("built the %s in %.1f s%s", art.what, seconds, f": {jsonable(report)}" if report else "")


def foreign_key(art: Artifact, folder: Path) -> str | None:
    """Which parts of ``art``'s key the manifest in ``folder`` disagrees with (``None``: it was built for this
    key). The folder's name already hashes the key, so a disagreement means files were copied or moved in by
    hand (another target's store, another tokenizer's table): they are refused, never used or overwritten."""
    manifest = read_manifest(folder) or {}
    if "key" not in manifest:
        return None
    want = json.loads(json.dumps(jsonable(art.key), default=str))
    have = manifest["key"]
    if want == have:
        return None

    def diff(a, b, at: str) -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [d for k in sorted(set(a) | set(b)) for d in diff(a.get(k), b.get(k), f"{at}.{k}" if at else k)]
        return [] if a == b else [at or "key"]

    return ", ".join(diff(want, have, "")[:4]) or "key"


def _first_line(err: Exception) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def load_or_build(art: Artifact, cache: Path, build_if_missing: bool = True):
    """The artifact ``art`` from ``cache``, built first when missing (or broken) and ``build_if_missing``.

    Raises :class:`BenchError` (one sentence naming the folder) when it is missing or broken and may not be
    built, or when even a fresh build cannot be loaded. A ``BenchError`` raised by ``art.load`` passes
    through as it is: it says something a rebuild would not change.
    """
    folder = art.folder(cache)
    for attempt in (0, 1):
        with locked(folder, art.what):
            why = problem(folder)
            if why == "missing" and not build_if_missing:
                raise BenchError(f"no cached {art.what} at {folder}; {how_to_build(art)}.")
            if why is not None:
                if why != "missing":
                    log.warning("the cached %s at %s is broken (%s)", art.what, folder, why)
                if not build_if_missing:
                    raise BenchError(f"the cached {art.what} at {folder} cannot be used ({why}); {how_to_build(art)}.")
                _build(art, folder)
            elif (foreign := foreign_key(art, folder)) is not None:
                raise BenchError(f"the {art.what} at {folder} was built for something else (its {foreign} differ"
                                 f"{'s' if ',' not in foreign else ''}); delete that folder to rebuild it.")
        try:
            return art.load(folder)
        except BenchError:
            raise
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same problem for the user
            if not build_if_missing:
                raise BenchError(f"the cached {art.what} at {folder} cannot be loaded ({_first_line(err)}); "
                                 f"{how_to_build(art)}.") from None
            if attempt == 1:  # built just now and still unreadable: build and load disagree (a bug)
                raise BenchError(f"the {art.what} built at {folder} cannot be loaded ({_first_line(err)}).") from err
            log.warning("the cached %s at %s cannot be loaded (%s); rebuilding it", art.what, folder,
                        _first_line(err))
            with locked(folder, art.what):
                shutil.rmtree(folder, ignore_errors=True)
    raise AssertionError("unreachable")


def report_of(art: Artifact, cache: Path) -> dict:
    """The build report kept in an artifact's manifest ({} when it is not built)."""
    manifest = read_manifest(art.folder(cache))
    return (manifest or {}).get("report") or {}
