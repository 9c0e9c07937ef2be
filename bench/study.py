"""Reading saved results back and aggregating them into tables (``python -m bench table``).

Every number here is computed from the per-prompt records a run wrote; the definitions match the
README's metric table. Speedups are re-paired here rather than trusted from the files: a method's record
is divided against the baseline's record for the same prompt and settings *in the same run directory*
(both decoded back to back by one process), never against a baseline measured elsewhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from bench import metrics
from bench.errors import BenchError
from bench.results import RECORDS, read_records

# Settings that, when they vary across the loaded records, become part of a row's label.
SAMPLING_KEYS = ("temperature", "top_p", "max_new_tokens")
# Columns of the summary table, in order (quality columns q_<name> are appended when present).
COLUMNS = ["label", "method", "pair", "dataset", "category", "prompts", "speedup", "speedup_lo", "speedup_hi",
           "tokens_per_s", "ms_per_token", "mean_accepted", "alpha", "target_calls_per_token", "gflops_per_token",
           "matches_baseline"]


def find_record_files(paths: list[str]) -> list[Path]:
    """``records.jsonl`` files named directly or found anywhere under the given run or sweep directories."""
    if not paths:
        raise BenchError("name at least one results directory or records file (e.g. results/sweeps/<date>/<time>).")
    files: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise BenchError(f"results path '{p}' does not exist.")
        files += [p] if p.is_file() else sorted(p.rglob(RECORDS))
    if not files:
        raise BenchError(f"no {RECORDS} found under {', '.join(paths)} (an unfinished run has only records.partial.jsonl).")
    return list(dict.fromkeys(f.resolve() for f in files))


def load(paths: list[str]) -> tuple[pd.DataFrame, list[dict]]:
    """One row per record (with ``run_dir``, flattened ``flops_total`` and ``q_<metric>`` quality columns),
    and the provenance (``run.json``) of every run directory that has one."""
    rows, runs = [], []
    for f in find_record_files(paths):
        for rec in read_records(f):
            row = {k: v for k, v in rec.items() if k not in ("prompt_ids", "output_ids", "output_text", "extra", "quality", "flops")}
            row["run_dir"] = str(f.parent)
            row["flops_total"] = (rec.get("flops") or {}).get("total")
            row["method_cfg"] = rec.get("method_cfg") or {"name": rec.get("method")}
            for name, value in (rec.get("quality") or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    row[f"q_{name}"] = value
            rows.append(row)
        prov_path = f.parent / "run.json"
        if prov_path.exists():
            try:
                runs.append({"run_dir": str(f.parent), **json.loads(prov_path.read_text())})
            except ValueError:
                pass
    if not rows:
        raise BenchError("the records files hold no records.")
    df = pd.DataFrame(rows)
    df["label"] = labels(df)
    df["speedup"] = paired_speedups(df)
    df["ms_per_token"] = 1e3 * df["wall_s"] / df["new_tokens"].where(df["new_tokens"] > 0)
    return df, runs


def labels(df: pd.DataFrame) -> pd.Series:
    """A row label per record: the method's name plus whichever of its settings (and of temperature, top_p,
    max_new_tokens) vary across the loaded records, e.g. ``sd (gamma=2, temperature=0.7)``."""
    cfg_json = df["method_cfg"].map(lambda c: json.dumps(c, sort_keys=True))
    varying_global = [k for k in SAMPLING_KEYS if k in df and df[k].nunique(dropna=False) > 1]
    varying_cfg: dict[str, list[str]] = {}
    for method, group in df.groupby("method"):
        cfgs = [json.loads(s) for s in cfg_json[group.index].unique()]
        keys = sorted({k for c in cfgs for k in c if k != "name"})
        varying_cfg[method] = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in cfgs}) > 1]

    def label(i) -> str:
        r = df.loc[i]
        parts = [f"{k}={r['method_cfg'].get(k)}" for k in varying_cfg[r["method"]]]
        parts += [f"{k}={r[k]}" for k in varying_global]
        return f"{r['method']} ({', '.join(parts)})" if parts else str(r["method"])

    return pd.Series([label(i) for i in df.index], index=df.index)


def paired_speedups(df: pd.DataFrame, baseline: str = "ar") -> pd.Series:
    """Per record: the baseline's seconds per token over the record's, for the same prompt, pair, dataset,
    sampling settings, budget and seed in the same run directory (NaN when the run has no such baseline)."""
    keys = ["run_dir", "pair", "dataset", "prompt_id", "temperature", "top_p", "max_new_tokens", "seed"]
    keys = [k for k in keys if k in df]
    spt = df["wall_s"] / df["new_tokens"].where(df["new_tokens"] > 0)
    base = df[df["method"] == baseline].assign(_base_spt=spt).drop_duplicates(keys)[keys + ["_base_spt"]]
    merged = df[keys].astype(str).merge(base.astype({k: str for k in keys}), on=keys, how="left")
    return pd.Series(merged["_base_spt"].to_numpy(dtype=float) / spt.to_numpy(dtype=float), index=df.index)


def bootstrap_ci(values, level: float = 0.95, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the median over prompts (resampling prompts)."""
    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if x.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, x.size, size=(n, x.size))], axis=1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def _list(x) -> list:
    return x if isinstance(x, list) else []  # a record without the field reads back as NaN


def _aggregate(g: pd.DataFrame, level: float) -> dict:
    acc = [a for lst in g["accept_lengths"] for a in _list(lst)]
    dr = [d for lst in g["drafted"] for d in _list(lst)] if "drafted" in g else []
    tokens = g["new_tokens"].sum()
    lo, hi = bootstrap_ci(g["speedup"], level)
    row = {
        "method": g["method"].iloc[0],
        "prompts": len(g),
        "speedup": metrics.median(g["speedup"]),  # median over prompts of the paired per-prompt speedup
        "speedup_lo": lo,
        "speedup_hi": hi,
        "tokens_per_s": metrics.median(g["tokens_per_s"]),  # median over prompts of new tokens / wall time
        "ms_per_token": metrics.median(g["ms_per_token"]),  # median over prompts of wall time / new tokens
        "mean_accepted": metrics.ratio(sum(acc), len(acc)),  # tokens committed per target call after prefill
        "alpha": metrics.alpha_estimate(acc, dr) if len(dr) == len(acc) and any(dr) else math.nan,
        "target_calls_per_token": metrics.ratio(g["target_calls"].sum(), tokens),
        "gflops_per_token": metrics.ratio(g["flops_total"].sum(), tokens) / 1e9,
        # Share of prompts whose tokens equal the baseline's (NaN for the baseline itself / no baseline).
        "matches_baseline": g["matches_baseline"].dropna().astype(float).mean() if "matches_baseline" in g else math.nan,
    }
    for q in [c for c in g.columns if c.startswith("q_")]:
        row[q] = g[q].mean()  # mean of the quality metric over prompts (lossy methods; ar as reference)
    return row


def summary_table(df: pd.DataFrame, by_category: bool = False, level: float = 0.95, baseline: str = "ar") -> pd.DataFrame:
    """One row per label × pair × dataset (× category): the aggregates of :func:`_aggregate`."""
    keys = ["label", "pair", "dataset"] + (["category"] if by_category else [])
    rows = [{**dict(zip(keys, k)), **_aggregate(g, level)} for k, g in df.groupby(keys, sort=False, dropna=False)]
    out = pd.DataFrame(rows)
    out.loc[out["method"] == baseline, "matches_baseline"] = math.nan
    qcols = sorted(c for c in out.columns if c.startswith("q_"))
    out = out[[c for c in COLUMNS if c in out.columns] + qcols]
    # The baseline first, then methods in name order; rows of one method keep their settings' order.
    order = out["method"].map(lambda m: (m != baseline, m))
    return out.iloc[sorted(range(len(out)), key=lambda i: (order.iloc[i], str(out["label"].iloc[i])))].reset_index(drop=True)


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """The table for people: speedup with its interval in one cell, 3 significant digits, no empty columns."""
    t = table.copy()
    t["speedup"] = [
        "" if math.isnan(s) else f"{s:.2f} [{lo:.2f}, {hi:.2f}]"
        for s, lo, hi in zip(t["speedup"], t["speedup_lo"], t["speedup_hi"])
    ]
    t = t.drop(columns=["speedup_lo", "speedup_hi", "method"]).dropna(axis=1, how="all")
    return t.rename(columns={c: c[2:] for c in t.columns if c.startswith("q_")})
