"""The one summary of saved records: ``python -m bench run`` prints it and stores it in run.json's
``summary``, ``python -m bench table`` writes it (csv, md, tex), and the figures and the HTML report read it.

Input: the DataFrame of :func:`bench.saved.load` (one row per record, each paired with its run's baseline
record of the same prompt). Output: one row per label × pair × dataset (× category); every column is
defined on the line that computes it, and the README's metric table says the same.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from bench import quality, saved
from bench.results import clean_nan
from core import metrics
from core.errors import BenchError
from core.files import RECORDS

# Columns of the summary table, in order (quality columns q_<name> follow; csv files hold them all).
COLUMNS = ["label", "method", "pair", "dataset", "category", "prompts", "batch_size", "new_tokens", "wall_s", "ttft_s",
           "tokens_per_s", "ms_per_token", "throughput", "throughput_vs_ar1", "tpot_ms", "tpot_p90_ms", "tpot_p99_ms",
           "ttft_p90_s", "ttft_p99_s", "latency_p50_s",
           "latency_p90_s", "latency_p99_s", "speedup_median", "speedup_lo", "speedup_hi", "speedup_q25",
           "speedup_q75", "speedup_pooled", "speedup_specbench", "speedup_decode", "speedup_vs_ref", "mean_accepted",
           "alpha", "accept_by_position", "mean_drafted", "cost_ratio_c", "analytic_speedup", "target_calls_per_token",
           "gflops_per_token", "peak_mem_bytes", "method_param_bytes", "peak_decode_bytes", "matches_baseline",
           "tie_flips", "mismatches", "matches_ar1"]
# What people read (printed, md, tex, HTML): speedup_median carries its interval, speedup_iqr the spread; memory in MiB.
DISPLAY = ["label", "pair", "dataset", "category", "prompts", "batch_size", "new_tokens", "tokens_per_s", "throughput",
           "throughput_vs_ar1", "speedup_median",
           "speedup_iqr", "speedup_pooled", "speedup_specbench", "speedup_vs_ref", "mean_accepted", "alpha",
           "accept_by_position", "analytic_speedup", "target_calls_per_token", "gflops_per_token", "ttft_s",
           "peak_mem_mib", "method_param_mib", "peak_decode_mib", "matches_baseline", "tie_flips", "mismatches",
           "matches_ar1"]
MEMORY = ["peak_mem_bytes", "method_param_bytes", "peak_decode_bytes"]  # shown as <name>_mib
DISPLAY_QUALITY = ["token_agreement", "rougeL_vs_baseline", "exact_match", "rougeL_vs_reference", "perplexity",
                   "perplexity_baseline", "attribution"]
SHOWN_POSITIONS = 5  # acceptance by position: the first few in the display form, all of them in csv


def bootstrap_ci(values, level: float = 0.95, n: int = 2000, seed: int = 0, groups=None) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the median over prompts: prompts resampled, or, where ``groups``
    gives each value's group (:func:`batch_groups`), whole groups with their prompts, since the rows of a batch share
    one clock and their speedups move together (a cluster bootstrap). NaN with fewer than two groups: one batch of 8
    prompts is one paired measurement, whatever its 8 rows' spread."""
    keys = list(range(len(values))) if groups is None else list(groups)
    kept = [(k, float(v)) for k, v in zip(keys, values) if metrics.present([v])]
    clusters: dict = {}
    for k, v in kept:
        clusters.setdefault(k, []).append(v)
    if not kept or len(clusters) < min(2, len(kept)):
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    tail = (1 - level) / 2 * 100
    if len(clusters) == len(kept):  # one value per group: prompts resampled
        x = np.asarray([v for _, v in kept])
        medians = np.median(x[rng.integers(0, x.size, size=(n, x.size))], axis=1)
    else:
        members = [np.asarray(v) for v in clusters.values()]
        medians = np.array([np.median(np.concatenate([members[i] for i in rng.integers(0, len(members), len(members))]))
                            for _ in range(n)])
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def batch_groups(g: pd.DataFrame) -> list:
    """Per record of ``g``, the group it was decoded in: its batch (the group's size, seconds and new tokens, which its
    rows share and no other group has), or the record itself when decoded alone."""
    batches = g["batch"] if "batch" in g else [None] * len(g)
    return [(b["size"], b["wall_s"], b["new_tokens"]) if isinstance(b, dict) else ("alone", i)
            for i, b in enumerate(batches)]


def _list(x) -> list:
    return x if isinstance(x, list) else []  # a record without the field reads back as NaN


def steps(g: pd.DataFrame) -> tuple[list[int], list[int]]:
    """``(accept_lengths, drafted)`` of every target call after the prefill, pooled over the records of
    ``g`` whose two lists line up (one entry per call)."""
    acc, dr = [], []
    for a, d in zip(g["accept_lengths"], g["drafted"] if "drafted" in g else [None] * len(g)):
        if len(_list(a)) == len(_list(d)):
            acc += _list(a)
            dr += _list(d)
    return acc, dr


def near_tie(divergence) -> bool:
    """Whether a record's ``divergence`` (bench.quality.divergence) says its first difference was a near-tie."""
    return isinstance(divergence, dict) and bool(divergence.get("tie"))


def largest(g: pd.DataFrame, column: str) -> float:
    """The largest value of ``column`` over the records of ``g`` that have it (NaN: none has)."""
    vals = metrics.present(g[column]) if column in g else []
    return float(max(vals)) if vals else math.nan


def analytic_speedup(method: str, alpha: float, gamma: float, c: float) -> float:
    """The method's own analytic speedup model (``Method.analytic_speedup``: Leviathan et al.'s for ``sd``),
    NaN for a method that states none or a name no longer registered."""
    from methods.registry import get_method

    try:
        return float(get_method(method).analytic_speedup(alpha, gamma, c))
    except BenchError:
        return math.nan


def specbench_speedup(paired: pd.DataFrame) -> float:
    """Spec-Bench's speedup (``evaluation/speed.py``), from the paired records: the mean over prompts of the
    method's new tokens / wall time, over the mean over the same prompts of the baseline's; the baseline's tokens
    counted as that script counts them, its answer text tokenized again less one (``specbench_tokens``). NaN when
    the baseline's records predate that field (imported answers carry none)."""
    if paired.empty or "base_specbench_tokens" not in paired or paired["base_specbench_tokens"].isna().any():
        return math.nan
    return metrics.ratio((paired["new_tokens"] / paired["wall_s"]).mean(),
                         (paired["base_specbench_tokens"] / paired["base_wall_s"]).mean())


def throughput(g: pd.DataFrame) -> float:
    """New tokens per second over the decodes of ``g``, a batch's seconds counted once: each record of a group of B
    decoded together (``batch``) owns 1/B of the group's seconds; a record decoded alone, its own."""
    batches = g["batch"] if "batch" in g else [None] * len(g)
    seconds = [b["wall_s"] / b["size"] if isinstance(b, dict) else w for b, w in zip(batches, g["wall_s"])]
    return metrics.ratio(g["new_tokens"].sum(), sum(seconds))


def time_per_output_token(g: pd.DataFrame) -> list[float]:
    """Per request, the seconds per new token after the first (TPOT), in ms; none for a request without two tokens or
    a time to the first one (imported answers have none)."""
    return (1e3 * saved.decode_seconds_per_token(g)).dropna().tolist()


def summary_row(g: pd.DataFrame, level: float) -> dict:
    """The aggregates of one group of records (one method setting on one pair and dataset)."""
    acc, dr = steps(g)
    all_acc = [n for a in g["accept_lengths"] for n in _list(a)] if "accept_lengths" in g else []
    drafting = any(dr)
    tokens = g["new_tokens"].sum()
    paired = g[g["speedup"].notna()]  # records with their run's baseline record of the same prompt
    lo, hi = bootstrap_ci(list(g["speedup"]), level, groups=batch_groups(g))
    alpha = metrics.alpha_estimate(acc, dr) if drafting else math.nan
    gamma = metrics.ratio(sum(dr), len(dr)) if drafting else math.nan
    c = metrics.median(g["cost_ratio_c"]) if "cost_ratio_c" in g else math.nan
    compared = g["matches_baseline"].dropna().astype(float) if "matches_baseline" in g else pd.Series(dtype=float)
    differing = compared.index[compared == 0]  # greedy records whose tokens are not the baseline's
    ties = int(sum(near_tie(d) for d in g["divergence"].loc[differing])) if "divergence" in g else 0
    tpot = time_per_output_token(g)
    alone = metrics.present(g["matches_ar1"]) if "matches_ar1" in g else []  # batch rows against ar alone: 1 or 0
    largest_batch = g["batch_size"].max() if "batch_size" in g else 1  # NaN in records older than batch_size
    batch = int(largest_batch) if largest_batch == largest_batch else 1
    row = {
        "method": g["method"].iloc[0],
        "prompts": len(g),
        "new_tokens": int(tokens),
        "wall_s": metrics.median(g["wall_s"]),  # median over prompts of seconds from prefill to last token
        "ttft_s": metrics.median(g["ttft_s"]),  # median over prompts of the time to the first token
        "tokens_per_s": metrics.median(g["tokens_per_s"]),  # median over prompts of new tokens / wall time
        "ms_per_token": metrics.median(g["ms_per_token"]),  # median over prompts of wall time / new tokens
        # Prompts decoded together (the largest group; NaN when one at a time, so that tables of B = 1 stay as they were).
        "batch_size": batch if batch > 1 else math.nan,
        "throughput": throughput(g),  # tokens per second over all decodes, a batch's seconds once
        # Per-request time per output token and to the first token (in a batch, the row's own), across prompts.
        "tpot_ms": metrics.median(tpot),
        "tpot_p90_ms": metrics.quantile(tpot, 0.9),
        "tpot_p99_ms": metrics.quantile(tpot, 0.99),
        "ttft_p90_s": metrics.quantile(g["ttft_s"], 0.9),
        "ttft_p99_s": metrics.quantile(g["ttft_s"], 0.99),
        # Per-request latency (prefill to last token; in a batch, the row's own) across prompts.
        "latency_p50_s": metrics.quantile(g["wall_s"], 0.5),
        "latency_p90_s": metrics.quantile(g["wall_s"], 0.9),
        "latency_p99_s": metrics.quantile(g["wall_s"], 0.99),
        "speedup_median": metrics.median(g["speedup"]),  # median over prompts of the paired per-prompt speedup
        "speedup_lo": lo,  # percentile bootstrap interval of that median (prompts resampled; a batch's rows together)
        "speedup_hi": hi,
        "speedup_q25": metrics.quantile(g["speedup"], 0.25),  # spread of the per-prompt speedups across prompts
        "speedup_q75": metrics.quantile(g["speedup"], 0.75),
        # tokens per second over all paired prompts pooled, over the baseline's on the same prompts
        "speedup_pooled": metrics.ratio(metrics.ratio(paired["new_tokens"].sum(), paired["wall_s"].sum()),
                                        metrics.ratio(paired["base_new_tokens"].sum(), paired["base_wall_s"].sum())),
        "speedup_specbench": specbench_speedup(paired),  # Spec-Bench's speed.py: a ratio of mean tokens per second
        # median over prompts of the paired speedup of the decode phase alone (tokens after the first: no prefill)
        "speedup_decode": metrics.median(g["speedup_decode"]) if "speedup_decode" in g else math.nan,
        # median over prompts of the paired speedup against the run's optimised plain decoding (bench/reference.py)
        "speedup_vs_ref": metrics.median(g["speedup_vs_ref"]) if "speedup_vs_ref" in g else math.nan,
        # tokens committed per target call after prefill (every record's, imported ones without `drafted` too)
        "mean_accepted": metrics.ratio(sum(all_acc), len(all_acc)),
        "alpha": alpha,  # per-token acceptance, MLE under Leviathan et al.'s i.i.d. model
        "accept_by_position": metrics.acceptance_by_position(acc, dr),  # P(draft token i kept | 0..i-1 kept)
        "mean_drafted": gamma,  # tokens proposed per target call: the γ of the analytic model
        "cost_ratio_c": c,  # the run's measured draft/target one-token forward cost (median over records)
        "analytic_speedup": analytic_speedup(g["method"].iloc[0], alpha, gamma, c),
        "target_calls_per_token": metrics.ratio(g["target_calls"].sum(), tokens),  # target forwards, prefill included
        "gflops_per_token": metrics.ratio(g["flops_total"].sum(), tokens) / 1e9,  # analytic forward FLOPs, all models
        "peak_mem_bytes": largest(g, "peak_mem_bytes"),  # largest over prompts: all resident (bench/memory.py)
        "method_param_bytes": largest(g, "method_param_bytes"),  # the method's own parts and tensors beyond the target
        "peak_decode_bytes": largest(g, "peak_decode_bytes"),  # largest over prompts: CUDA, the decode's own peak
        "matches_baseline": compared.mean() if len(compared) else math.nan,  # share of greedy prompts token-identical
        "tie_flips": ties if len(compared) else math.nan,  # greedy prompts that part from the baseline at a near-tie
        # greedy prompts that part from it where the target's margin was >= ε (or, in older records, not measured)
        "mismatches": int((compared == 0).sum()) - ties if len(compared) else math.nan,
        # share of greedy prompts decoded in a batch whose tokens are ar's alone (B = 1) in the loaded runs
        "matches_ar1": metrics.ratio(sum(alone), len(alone)),
    }
    qs = [q for q in g["quality"] if isinstance(q, dict)] if "quality" in g else []
    row.update({f"q_{k}": v for k, v in quality.summarize_quality([{"quality": q} for q in qs]).items()})
    return row


def over_ar_alone(table: pd.DataFrame, keys: list[str]) -> list[float]:
    """Each row's throughput over that of ``ar`` one prompt at a time (B = 1) on the same ``keys`` (pair, dataset,
    category): what batching and the method together give over plain decoding alone (issue 41). NaN where the table
    has no such ``ar`` row, or has only B = 1 (the column would say 1 for ``ar`` and nothing new)."""
    if table["batch_size"].isna().all():
        return [math.nan] * len(table)
    alone = table[(table["method"] == "ar") & table["batch_size"].isna()]
    out = []
    for _, row in table.iterrows():
        same = alone[(alone[keys] == row[keys]).all(axis=1)]
        out.append(metrics.ratio(row["throughput"], same["throughput"].iloc[0]) if len(same) else math.nan)
    return out


def summary_table(df: pd.DataFrame, by_category: bool = False, level: float = 0.95) -> pd.DataFrame:
    """One row per label × pair × dataset (× category): the aggregates of :func:`summary_row`. Rows of a
    run's baseline come first and carry no comparison with themselves."""
    keys = ["label", "pair", "dataset"] + (["category"] if by_category else [])
    groups = list(df.groupby(keys, sort=False, dropna=False))
    rows = [{**dict(zip(keys, k)), **summary_row(g, level)} for k, g in groups]
    is_base = [bool(g["is_baseline"].all()) for _, g in groups]
    is_ref = [bool(g["is_reference"].all()) if "is_reference" in g else False for _, g in groups]
    out = pd.DataFrame(rows)
    out["throughput_vs_ar1"] = over_ar_alone(out, keys[1:])
    out.loc[is_base, [c for c in ("matches_baseline", "tie_flips", "mismatches") if c in out]] = math.nan
    qcols = sorted(c for c in out.columns if c.startswith("q_"))
    out = out[[c for c in COLUMNS if c in out.columns] + qcols]
    # The baseline first, then the reference, then methods in name order; rows of one method keep their settings' order.
    order = sorted(range(len(out)), key=lambda i: (not is_base[i], not is_ref[i], out["method"].iloc[i],
                                                   str(out["label"].iloc[i])))
    return out.iloc[order].reset_index(drop=True)


def run_summary(run_dir: Path, baseline: str | None = None, level: float = 0.95) -> pd.DataFrame:
    """The summary of one run directory's ``records.jsonl``, read back as ``python -m bench table`` reads it."""
    df, _ = saved.load([str(Path(run_dir) / RECORDS)], baseline)
    return summary_table(df, level=level)


def as_rows(table: pd.DataFrame) -> list[dict]:
    """The table as JSON-able dicts (run.json's ``summary``): NaN as None, numpy scalars as Python's."""
    return clean_nan([{k: (v.item() if isinstance(v, np.generic) else v) for k, v in row.items()}
                      for row in table.to_dict(orient="records")])


def for_csv(table: pd.DataFrame) -> pd.DataFrame:
    """The table with list cells (``accept_by_position``) as JSON text, NaN entries as null."""
    return table.assign(**{c: table[c].map(lambda v: json.dumps(clean_nan(v)) if isinstance(v, list) else v)
                           for c in table.columns if table[c].map(lambda v: isinstance(v, list)).any()})


def _fmt(x: float, spec: str = ".2f") -> str:
    return "–" if x is None or math.isnan(x) else format(x, spec)


def mib(n) -> str | None:
    """Bytes as MiB for people: ``0.25``, ``512``, ``15,317`` (None: not measured)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return None
    x = n / 2**20
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def short_positions(values) -> str | None:
    """``[0.41, 0.22, 0.10, 0.05, 0.02, 0.01]`` → ``"0.41 0.22 0.10 0.05 0.02 …"``; None when nothing was drafted."""
    values = _list(values)
    if not values:
        return None
    return " ".join(_fmt(v) for v in values[:SHOWN_POSITIONS]) + (" …" if len(values) > SHOWN_POSITIONS else "")


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """The table for people: the median speedup with its interval in one cell, the interquartile range of
    per-prompt speedups in another, the first acceptance positions, no all-empty columns."""
    t = table.copy()
    t["speedup_median"] = [None if math.isnan(s) else f"{s:.2f} [{lo:.2f}, {hi:.2f}]" if not math.isnan(lo) else
                           f"{s:.2f} [one batch]"
                           for s, lo, hi in zip(t["speedup_median"], t["speedup_lo"], t["speedup_hi"])]
    t["speedup_iqr"] = [None if math.isnan(a) else f"{a:.2f}–{b:.2f}" for a, b in zip(t["speedup_q25"], t["speedup_q75"])]
    t["accept_by_position"] = t["accept_by_position"].map(short_positions)
    for c in MEMORY:
        if c in t:
            t[c.replace("_bytes", "_mib")] = t[c].map(mib)
    t = t.rename(columns={c: c[2:] for c in t.columns if c.startswith("q_")})
    t = t[[c for c in DISPLAY + DISPLAY_QUALITY if c in t.columns]].dropna(axis=1, how="all")
    return t.astype(object).where(t.notna(), None)  # None: an empty cell (or "–"), not "nan", in every format


def legend(level: float = 0.95) -> str:
    """What the speedup and tie columns mean, in one line (with every printed table and in the report)."""
    eps = ", ".join(f"{v:g} in {k}" for k, v in metrics.TIE_EPS.items())
    return (f"speedup_median: median over prompts of the per-prompt paired speedup [{level:.0%} bootstrap interval, a "
            "batch's rows resampled together; none from one batch]; "
            "speedup_iqr: its 25th-75th percentiles across prompts; speedup_pooled: total tokens / total seconds "
            "over the same prompts, over the baseline's; speedup_specbench: Spec-Bench's speed.py, mean tokens/s over "
            "mean baseline tokens/s (its answers re-tokenized); throughput: new tokens over seconds across all decodes, "
            "a batch's seconds once (throughput_vs_ar1: over ar's at batch size 1 in the same table); speedup_vs_ref: the median paired speedup against the "
            "optimised plain decoding (ar_compiled: static cache + torch.compile), where the run timed it; "
            "peak_mem_mib: all resident at the peak (the other method's parts too), method_param_mib: the method's own "
            "parts beyond the target, peak_decode_mib: CUDA, the decode's own peak above what was resident (largest "
            "over prompts); tie_flips: greedy prompts that part from the baseline where "
            f"the target's top-1 - top-2 logit < ε ({eps}), mismatches: the other greedy prompts that part from it; "
            "matches_ar1: share of greedy prompts decoded in a batch whose tokens are ar's for the prompt alone "
            "(batch size 1) in the tables' runs (near-ties not told apart)")


def markdown(table: pd.DataFrame) -> str:
    """The display form as a markdown table: what ``run`` and ``table`` print."""
    return display_table(table).to_markdown(index=False, floatfmt=".3g")
