"""Writing and reading results: append-only JSONL records, atomic JSON files, provenance.

Records are appended to ``records.partial.jsonl`` one complete line at a time while a run goes on; the
file becomes ``records.jsonl`` only when the run has finished, so a ``records.jsonl`` is always whole.
Readers skip a torn last line of a partial file instead of failing.

Resuming: every record carries a ``run_key`` (method settings, pair, dataset, prompt, sampling settings,
token budget, seed). A run started with ``resume=DIR`` reads the complete records already in its directory
(``records.jsonl`` and a leftover ``records.partial.jsonl``), carries them over and decodes only the rest.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from core.files import PARTIAL, RECORDS


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` through a temp file and a rename: the file is either the old one or the new one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON atomically (:func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(clean_nan(obj), indent=2, default=str))


class RecordWriter:
    """Appends one JSON line per decoded prompt; ``close()`` publishes the file as ``records.jsonl``.

    The partial file starts afresh, holding only ``carried`` records (those a resumed run keeps), written
    through a temp file and a rename: appending to a leftover file could glue a new line onto a torn one.
    """

    def __init__(self, run_dir: Path, carried: list[dict] = ()):
        self.run_dir = run_dir
        self.partial = run_dir / PARTIAL
        tmp = run_dir / (PARTIAL + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for rec in carried:
                fh.write(json.dumps(clean_nan(rec), default=_jsonable) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.partial)  # until here the old partial (if any) still holds everything
        self.fh = open(self.partial, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        # One write call per complete line, flushed and synced: a kill leaves at most a torn last line.
        self.fh.write(json.dumps(clean_nan(record), default=_jsonable) + "\n")
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self, publish: bool) -> None:
        self.fh.close()
        if publish:
            os.replace(self.partial, self.run_dir / RECORDS)


def _jsonable(x):
    return x.tolist() if isinstance(x, torch.Tensor) else str(x)


def clean_nan(obj):
    """NaN (an undefined metric) becomes JSON null, so every file is strict JSON."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: clean_nan(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_nan(v) for v in obj]
    return obj


def read_records(path: Path) -> list[dict]:
    """Records of a JSONL file; a line that is not valid JSON (a torn write) is skipped."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


# The trained parts whose passes a run recipe held as its own fields (``draft_epochs``, ...) until each part declared
# its own (issue 29); run keys made then hashed them, so they still do, under those names.
LEGACY_PARTS = ("draft", "heads", "verifier", "eagle", "glide", "space")


@functools.cache  # the runner keys every prompt of every method: discover the methods once, not per key
def legacy_epochs(recipe_name: str) -> dict[str, int]:
    """The passes of each part of :data:`LEGACY_PARTS` under the run recipe ``recipe_name``, as run keys name them
    (each part's own count: ``TrainRecipe.epochs_for`` with ``epochs`` unset)."""
    from methods.registry import known_methods
    from training.kit import PARTS

    known_methods()  # every method imported: every part has declared its epochs
    return {f"{name}_epochs": PARTS[name].epochs_for({}, recipe_name) for name in LEGACY_PARTS}


# Settings added after run keys were first made, with the default that means "as before": dropped from keys at
# that default, so keys made before stay valid (epochs: issue 29; weights, the authors' published drafters, and
# EAGLE-1's static tree, read only with draft=static: issue 30; settings by batch size: issue 41).
ADDED_DEFAULTS = {"epochs": None, "weights": None, "static_tree": "eagle1", "by_batch": None}


def _without_unset_epochs(node):
    """``node`` without the settings of :data:`ADDED_DEFAULTS` at their default (a part trains as before)."""
    if isinstance(node, dict):
        return {k: _without_unset_epochs(v) for k, v in node.items()
                if not (k in ADDED_DEFAULTS and v == ADDED_DEFAULTS[k])}
    if isinstance(node, list):
        return [_without_unset_epochs(v) for v in node]
    return node


def run_key(method_cfg: dict, cfg: DictConfig, prompt_id: str, trained: bool = False) -> str:
    """A stable id of one decode's settings: same key, same measurement to make (a resumed run keeps it).

    Covers the method's settings, the pair's config, the dataset's config (but not ``n_prompts`` or
    ``categories``, which only choose prompts), the prompt, temperature, top_p, max_new_tokens and seed, the
    compiled buckets with ``compile``, and, for a method with trained parts (``trained``), the training recipe.
    """
    dataset = OmegaConf.to_container(cfg.dataset, resolve=True)
    for key in ("n_prompts", "categories"):
        dataset.pop(key, None)
    parts = {
        "method": _without_unset_epochs(method_cfg),
        "pair": _without_unset_epochs(OmegaConf.to_container(cfg.pair, resolve=True)),
        "dataset": dataset,
        "prompt_id": prompt_id,
        "temperature": float(cfg.temperature),
        "top_p": float(cfg.top_p),
        "max_new_tokens": int(cfg.max_new_tokens),
        "seed": int(cfg.seed),
    }
    if int(cfg.get("batch_size") or 1) > 1:  # absent at 1: older run keys stay valid
        parts["batch_size"] = int(cfg.batch_size)
    if cfg.get("compile"):  # absent when eager: older run keys stay valid
        parts["compile"] = sorted(int(b) for b in cfg.compile_buckets)
        if int(cfg.get("batch_size") or 1) > 1:  # the graphs a batch's running rows choose from (issue 41)
            sizes = cfg.get("compile_batch_sizes")
            parts["compile_batch_sizes"] = None if sizes is None else sorted(int(r) for r in sizes)
    if trained and cfg.get("recipe") is not None:  # absent otherwise: older run keys stay valid
        from training.recipes import store_key

        recipe = OmegaConf.to_container(cfg.recipe, resolve=True)
        if recipe.get("store") is not None:  # as the store's own keys see it
            recipe["store"] = store_key(recipe["store"])
        parts["recipe"] = {**recipe, **legacy_epochs(recipe.get("name", "quick"))}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def previous_records(run_dir: Path) -> dict[str, dict]:
    """Complete records already in ``run_dir`` by ``run_key``: ``records.jsonl``, then a leftover
    ``records.partial.jsonl`` (a killed or resumed run), torn lines skipped; records without a key are ignored."""
    found: dict[str, dict] = {}
    for name in (RECORDS, PARTIAL):
        path = run_dir / name
        if path.exists():
            for rec in read_records(path):
                if isinstance(rec, dict) and rec.get("run_key"):
                    found[rec["run_key"]] = rec
    return found


def git_state() -> dict:
    """Commit and dirty flag of the harness checkout (None outside a git checkout)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD") or None
    return {"commit": commit, "dirty": bool(git("status", "--porcelain")) if commit else None}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(cfg: DictConfig, device: torch.device) -> dict:
    """Everything needed to trust or reproduce a run: config, code, libraries, machine."""
    import hydra
    import transformers

    return {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "git": git_state(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "hydra": hydra.__version__,
        },
        "device": str(device),
        "cpu": cpu_name(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cuda": torch.version.cuda if device.type == "cuda" else None,  # the CUDA torch was built with
        "threads": torch.get_num_threads(),
        "seed": cfg.seed,
        "host": platform.node(),
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
