"""Writing and reading results: append-only JSONL records, atomic JSON files, provenance.

Records are appended to ``records.partial.jsonl`` one complete line at a time while a run goes on; the
file becomes ``records.jsonl`` only when the run has finished, so a ``records.jsonl`` is always whole.
Readers skip a torn last line of a partial file instead of failing.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

RECORDS = "records.jsonl"
PARTIAL = "records.partial.jsonl"


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON through a temp file and a rename: the file is either the old one or the new one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(clean_nan(obj), indent=2, default=str))
    os.replace(tmp, path)


class RecordWriter:
    """Appends one JSON line per decoded prompt; ``close()`` publishes the file as ``records.jsonl``."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.partial = run_dir / PARTIAL
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
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


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
        "threads": torch.get_num_threads(),
        "seed": cfg.seed,
        "host": platform.node(),
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
