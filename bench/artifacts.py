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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, ListConfig, OmegaConf

from bench.errors import BenchError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def jsonable(x):
    """Plain JSON-able data from OmegaConf nodes (resolved), leaving everything else as it is."""
    return OmegaConf.to_container(x, resolve=True) if isinstance(x, (DictConfig, ListConfig)) else x


def content_key(*parts) -> str:
    """A short stable hash (12 hex digits) of JSON-able parts: an artifact is keyed by what produced it."""
    blob = json.dumps([jsonable(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def model_fingerprint(module) -> dict:
    """What identifies a model's weights for caching: class, shape and a checksum of every parameter.

    The checksum sums each parameter after rounding to bf16, so the fp32 CPU copy and the bf16 GPU copy of
    the same weights share their artifacts, while any retraining changes it.
    """
    import torch

    config = getattr(module, "config", None)
    with torch.no_grad():
        checksum = sum(float(p.detach().to(torch.bfloat16).double().sum()) for p in module.parameters())
    return {
        "class": type(module).__name__,
        "name": Path(str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", ""))).name,
        "model_type": getattr(config, "model_type", None),
        "layers": getattr(config, "num_hidden_layers", None),
        "hidden": getattr(config, "hidden_size", None),
        "vocab": getattr(config, "vocab_size", None),
        "params": sum(p.numel() for p in module.parameters()),
        "checksum": round(checksum, 3),
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
    ``hint`` tells a user how to build it on purpose (shown when building is not allowed).
    """

    kind: str
    name: str
    key: dict
    build: Callable[[Path], Any]
    load: Callable[[Path], Any]
    version: int = 1
    hint: str = "run with train_if_missing=true"
    description: str = field(default="")

    def folder(self, cache: Path) -> Path:
        return Path(cache) / self.kind / f"{self.name}-{content_key(self.kind, self.version, self.key)}"

    @property
    def what(self) -> str:
        return self.description or f"{self.kind} artifact '{self.name}'"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> dict[str, dict]:
    return {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _digest(p)}
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
        if _digest(path) != meta.get("sha256"):
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
        manifest = {"kind": art.kind, "name": art.name, "version": art.version, "key": jsonable(art.key),
                    "report": jsonable(report), "build_seconds": round(time.perf_counter() - start, 1),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": _files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))


def load_or_build(art: Artifact, cache: Path, build_if_missing: bool = True):
    """The artifact ``art`` from ``cache``, built first when missing (or broken) and ``build_if_missing``.

    Raises :class:`BenchError` (one sentence) when it is missing or broken and may not be built, or when a
    fresh build cannot be loaded.
    """
    folder = art.folder(cache)
    for attempt in (0, 1):
        with locked(folder, art.what):
            why = problem(folder)
            if why is not None:
                if why != "missing":
                    log.warning("the cached %s at %s is broken (%s)", art.what, folder, why)
                if not build_if_missing:
                    state = "missing" if why == "missing" else f"broken ({why})"
                    raise BenchError(f"the {art.what} is {state} at {folder}; {art.hint}.")
                _build(art, folder)
        try:
            return art.load(folder)
        except BenchError:
            raise
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same problem for the user
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
            if attempt == 1 or not build_if_missing:
                raise BenchError(f"the cached {art.what} at {folder} cannot be loaded ({reason}); delete that "
                                 "folder to rebuild it.") from None
            log.warning("the cached %s at %s cannot be loaded (%s); rebuilding it", art.what, folder, reason)
            with locked(folder, art.what):
                shutil.rmtree(folder, ignore_errors=True)
    raise AssertionError("unreachable")


def report_of(art: Artifact, cache: Path) -> dict:
    """The build report kept in an artifact's manifest ({} when it is not built)."""
    manifest = read_manifest(art.folder(cache))
    return (manifest or {}).get("report") or {}
