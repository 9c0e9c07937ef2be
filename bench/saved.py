"""Reading saved results back into one pandas DataFrame, one row per record (``bench.summary`` aggregates it).

Speedups are re-paired here rather than trusted from the files: a method's record is divided against the
baseline's record for the same prompt and settings *in the same run directory* (both decoded back to back
by one process), never against a baseline measured elsewhere; and, where the run timed the optimised plain-decoding
reference (``bench.reference``), against the reference's record of that prompt the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pandas as pd

from core import files
from core.errors import BenchError

# Run settings that, when they vary across the loaded records, become part of a row's label.
LABEL_KEYS = ("temperature", "top_p", "max_new_tokens", "compile", "batch_size", "compile_buckets",
              "compile_batch_sizes")
SET_ONLY = {"compile_buckets", "compile_batch_sizes"}  # named where set (None: not compiled), when set values differ
# What makes two records of one run directory a pair: the same prompt decoded under the same settings.
PAIR_KEYS = ["run_dir", "pair", "dataset", "prompt_id", "temperature", "top_p", "max_new_tokens", "seed"]
# The optimised plain-decoding reference's names in records (bench.reference.NAMES, without importing transformers).
REFERENCES = ("ar_compiled", "ar_static")


def find_record_files(paths: list[str]) -> list[Path]:
    """``records.jsonl`` files named directly or found anywhere under the given run or sweep directories
    (:func:`core.files.record_files`: an unfinished run's partial file is an error that says how to finish it)."""
    if not paths:
        raise BenchError("name at least one results directory or records file (e.g. results/sweeps/<date>/<time>).")
    found = [f for p in paths for f in files.record_files(Path(p))]
    return list(dict.fromkeys(f.resolve() for f in found))


def load(paths: list[str], baseline: str | None = None) -> tuple[pd.DataFrame, list[dict]]:
    """One row per record (with ``run_dir``, ``baseline``, flattened ``flops_total``, ``q_<metric>`` quality
    columns, the paired ``speedup``, ``base_wall_s``, ``base_new_tokens``, ``base_specbench_tokens``, and
    ``speedup_vs_ref`` against the run's reference where it has one), and the provenance
    (``run.json``) of every run directory that has one. Files are checked as they are read
    (:mod:`core.files`): an empty, foreign or damaged records file, or a run.json that is not JSON, is an error.

    ``baseline``: the method every record is paired against; ``None``: each run directory's own (its
    run.json's ``config.baseline``, ``ar`` when there is no run.json; a run without one pairs nothing).
    """
    rows, runs = [], []
    for f in find_record_files(paths):
        prov = files.read_run_json(f.parent)
        run_baseline = baseline or ((prov.get("config") or {}).get("baseline", "ar") if prov else "ar")
        for rec in files.read_results_file(f):
            row = {k: v for k, v in rec.items() if k not in ("prompt_ids", "output_ids", "output_text", "extra", "flops")}
            row["run_dir"] = str(f.parent)
            row["baseline"] = run_baseline
            row["flops_total"] = (rec.get("flops") or {}).get("total")
            row["method_cfg"] = rec.get("method_cfg") or {"name": rec.get("method")}
            row["batch_size"] = rec.get("batch_size") or 1  # records older than batch_size decoded one at a time
            # The tokens, as one comparable value: a row of a batch against ar's decode of its prompt alone.
            row["output_sha"] = output_sha(rec.get("output_ids"))
            for name, value in (rec.get("quality") or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    row[f"q_{name}"] = value
            rows.append(row)
        if prov is not None:
            runs.append({"run_dir": str(f.parent), **prov})
    df = pd.DataFrame(rows)
    df["label"] = labels(df)
    df["is_baseline"] = df["method"] == df["baseline"]
    df["is_reference"] = df["method"].isin(REFERENCES)
    df = df.join(baseline_measurements(df))
    df = df.join(paired_measurements(df, df["is_reference"], "ref", ["wall_s", "new_tokens"]))
    spt = df["wall_s"] / df["new_tokens"].where(df["new_tokens"] > 0)
    df["speedup"] = df["base_wall_s"] / df["base_new_tokens"].where(df["base_new_tokens"] > 0) / spt
    # against the optimised plain decoding of the same prompt, same run (NaN where the run did not time it)
    df["speedup_vs_ref"] = df["ref_wall_s"] / df["ref_new_tokens"].where(df["ref_new_tokens"] > 0) / spt
    df["ms_per_token"] = 1e3 * spt
    # The decode phase alone: the baseline's seconds per token after the first over the method's, same prompt (at long
    # inputs and short budgets the prefill is most of `speedup`'s seconds, and the same on both sides).
    df["speedup_decode"] = decode_seconds_per_token(df, "base_") / decode_seconds_per_token(df)
    df["matches_ar1"] = matches_alone(df)
    return df, runs


def output_sha(ids) -> str | None:
    """A short digest of a record's ``output_ids`` (None without them: imported answers)."""
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16] if ids is not None else None


def matches_alone(df: pd.DataFrame) -> pd.Series:
    """Per greedy record decoded in a batch (``batch_size`` > 1): whether its tokens are those of ``ar`` decoding the
    same prompt one at a time (B = 1, same pair, dataset, budget, greedy) in any of the loaded runs: issue 41's
    losslessness per row, against ``ar`` alone rather than the baseline at the same B (which is batched itself). NaN
    where no such ``ar`` record is loaded, for sampled records, and at B = 1."""
    keys = ["pair", "dataset", "prompt_id", "max_new_tokens"]
    # Imported answers say less.
    if df.empty or any(k not in df for k in [*keys, "temperature", "batch_size", "output_sha"]):
        return pd.Series(math.nan, index=df.index, dtype=float)
    key = df[keys].astype(str).agg("\x1f".join, axis=1)
    greedy = (df["temperature"] == 0) & df["output_sha"].notna()
    alone = (df["method"] == "ar") & (df["batch_size"] == 1) & greedy
    ref = key.map(dict(zip(key[alone], df.loc[alone, "output_sha"])))
    batched = (df["batch_size"] > 1) & greedy & ref.notna()
    return (df["output_sha"] == ref).astype(float).where(batched)


def labels(df: pd.DataFrame, axis: str | None = None) -> pd.Series:
    """A row label per record: the method's name, the training recipe behind a trained method, the settings the
    method always names (koala's base), then whichever of its settings (and of temperature, top_p,
    max_new_tokens, compile, batch_size, compile_buckets, compile_batch_sizes) vary across the loaded records, e.g. ``sd (recipe=quick, gamma=2, temperature=0.7)``.
    ``axis``: one of those run settings left out (a plot's x axis: the label then names one line over its values)."""
    cfg_json = df["method_cfg"].map(lambda c: json.dumps(c, sort_keys=True))
    varying_global = [k for k in LABEL_KEYS if k in df and k != axis and df[k].nunique(dropna=k not in SET_ONLY) > 1]
    varying_cfg: dict[str, list[str]] = {}
    for method, group in df.groupby("method"):
        cfgs = [json.loads(s) for s in cfg_json[group.index].unique()]
        keys = sorted({k for c in cfgs for k in c if k != "name"})
        shown = named_settings(method)  # what the method's rows always say (koala: its base)
        varying_cfg[method] = shown + [k for k in keys if k not in shown
                                       and len({json.dumps(c.get(k), sort_keys=True) for c in cfgs}) > 1]

    def label(i) -> str:
        r = df.loc[i]
        recipe = r.get("recipe") if "recipe" in r else None
        parts = [f"recipe={recipe}"] if isinstance(recipe, str) else []
        parts += [f"{k}={r['method_cfg'].get(k)}" for k in varying_cfg[r["method"]]]
        parts += [f"{k}={r[k]}" for k in varying_global if not (k in SET_ONLY and not isinstance(r[k], str))]
        return f"{r['method']} ({', '.join(parts)})" if parts else str(r["method"])

    return pd.Series([label(i) for i in df.index], index=df.index)


def named_settings(method: str) -> list[str]:
    """The settings a registered method's labels always show (``Method.label_settings``); none for a name
    this harness does not register (records read from elsewhere)."""
    from methods.registry import get_method

    try:
        return list(get_method(method).label_settings)
    except BenchError:
        return []


def decode_seconds_per_token(df: pd.DataFrame, prefix: str = "") -> pd.Series:
    """Per record, seconds per new token after the first (its own, or with ``prefix`` ``base_`` its baseline's): NaN
    without two new tokens or a time to the first (imported answers)."""
    if f"{prefix}ttft_s" not in df:
        return pd.Series(math.nan, index=df.index, dtype=float)
    new = df[f"{prefix}new_tokens"].astype(float)
    ttft = pd.to_numeric(df[f"{prefix}ttft_s"], errors="coerce")
    return (df[f"{prefix}wall_s"].astype(float) - ttft) / (new - 1).where(new > 1)


def baseline_measurements(df: pd.DataFrame) -> pd.DataFrame:
    """Per record: ``base_wall_s``, ``base_new_tokens``, ``base_specbench_tokens`` and ``base_ttft_s`` of its run's
    baseline record for the same prompt, pair, dataset, sampling settings, budget and seed in the same run directory
    (NaN when there is none, or when the baseline's records predate the field)."""
    return paired_measurements(df, df["is_baseline"], "base", ["wall_s", "new_tokens", "specbench_tokens", "ttft_s"])


def paired_measurements(df: pd.DataFrame, mask: pd.Series, prefix: str, measured: list[str]) -> pd.DataFrame:
    """Per record: ``<prefix>_<m>`` for each of ``measured``, read from the record ``mask`` selects for the same
    prompt, pair, dataset, sampling settings, budget and seed in the same run directory (NaN when there is none, or
    when those records predate the field)."""
    keys = [k for k in PAIR_KEYS if k in df]
    chosen = df[mask].drop_duplicates(keys).reindex(columns=keys + measured)
    merged = df[keys].astype(str).merge(chosen.astype({k: str for k in keys}), on=keys, how="left")
    return pd.DataFrame({f"{prefix}_{m}": merged[m].to_numpy(dtype=float) for m in measured}, index=df.index)
