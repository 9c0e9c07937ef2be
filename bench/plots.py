"""Paper-style figures of saved results (``python -m bench plot``), each as PDF and PNG.

Each figure function takes the loaded records (``bench.saved.load``), the run.json provenances and the
summary of those records (``bench.summary.summary_table``: every aggregate a figure shows comes from it), and
returns a matplotlib figure, or a string saying why its data is absent (the figure is then skipped, not drawn
empty).
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

from bench import saved, summary  # noqa: E402

log = logging.getLogger(__name__)

STYLE = {
    "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "legend.fontsize": 7, "xtick.labelsize": 7,
    "ytick.labelsize": 7, "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
    "grid.alpha": 0.3, "grid.linewidth": 0.5, "savefig.bbox": "tight", "savefig.dpi": 200,
    "pdf.fonttype": 42,  # TrueType in PDFs, as camera-ready checks want
}
SINGLE, DOUBLE = 3.3, 6.8  # column widths in inches (two-column paper)


def baseline_name(df: pd.DataFrame) -> str:
    """The method(s) the loaded records are paired against, for axis labels."""
    return ", ".join(sorted(df.loc[df["is_baseline"], "method"].unique())) or "the baseline"


def colors(labels) -> dict:
    cmap = plt.get_cmap("tab10")
    return {lab: cmap(i % 10) for i, lab in enumerate(sorted(set(labels)))}


def speedup_by_category(df: pd.DataFrame, runs: list[dict], table: pd.DataFrame):
    """Spec-Bench-style grouped bars: median speedup per category and overall, one bar per method, with
    the bootstrap interval (one panel per pair × dataset)."""
    methods = df[~df["is_baseline"] & df["speedup"].notna()]
    if methods.empty:
        return "no method with a paired baseline measurement"
    combos = list(methods.groupby(["pair", "dataset"]).groups)
    fig, axes = plt.subplots(len(combos), 1, figsize=(DOUBLE, 2.2 * len(combos)), squeeze=False)
    col = colors(methods["label"])
    for ax, (pair, dataset) in zip(axes[:, 0], combos):
        sub = methods[(methods["pair"] == pair) & (methods["dataset"] == dataset)]
        cats = list(dict.fromkeys(sub["category"])) + ["overall"]
        labs = sorted(sub["label"].unique())
        width = 0.8 / len(labs)
        for j, lab in enumerate(labs):
            rows = sub[sub["label"] == lab]
            vals = [rows[rows["category"] == c]["speedup"] if c != "overall" else rows["speedup"] for c in cats]
            med = [np.nanmedian(v) if len(v) else np.nan for v in vals]
            ci = [summary.bootstrap_ci(list(v), groups=summary.batch_groups(rows.loc[v.index])) for v in vals]
            err = np.array([[m - lo for m, (lo, _) in zip(med, ci)], [hi - m for m, (_, hi) in zip(med, ci)]])
            x = np.arange(len(cats)) + (j - (len(labs) - 1) / 2) * width
            ax.bar(x, med, width, yerr=np.nan_to_num(err), capsize=1.5, label=lab, color=col[lab], error_kw={"lw": 0.6})
        ax.axhline(1.0, color="black", lw=0.6, ls="--")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # head room for the legend
        ax.set_xticks(np.arange(len(cats)), cats, rotation=20, ha="right")
        ax.set_ylabel(f"speedup over {baseline_name(df)}")
        ax.set_title(f"{pair} · {dataset}")
        ax.legend(ncol=min(len(labs), 4), frameon=False)
    return fig


def speedup_overview(df: pd.DataFrame, runs: list[dict], table: pd.DataFrame):
    """Every method side by side: its median paired speedup over the baseline with the bootstrap interval, one
    bar per method setting, fastest on top; lossy methods hatched (one panel per pair × dataset)."""
    baselines = set(df.loc[df["is_baseline"], "label"])
    rows = table[table["speedup_median"].notna() & ~table["label"].isin(baselines)]
    if rows.empty:
        return "no method with a paired baseline measurement"
    lossy = set(df.loc[~df["lossless"].astype(bool), "label"]) if "lossless" in df else set()
    combos = list(rows.groupby(["pair", "dataset"]).groups)
    height = max(len(rows[(rows["pair"] == p) & (rows["dataset"] == d)]) for p, d in combos)
    fig, axes = plt.subplots(len(combos), 1, figsize=(SINGLE, 0.6 + 0.22 * height * len(combos)), squeeze=False)
    for ax, (pair, dataset) in zip(axes[:, 0], combos):
        sub = rows[(rows["pair"] == pair) & (rows["dataset"] == dataset)].sort_values("speedup_median")
        y = np.arange(len(sub))
        med = sub["speedup_median"].to_numpy(float)
        err = np.nan_to_num(np.array([med - sub["speedup_lo"].to_numpy(float), sub["speedup_hi"].to_numpy(float) - med]))
        bars = ax.barh(y, med, xerr=err, capsize=1.5, color="tab:blue", error_kw={"lw": 0.6})
        for bar, label in zip(bars, sub["label"]):
            if label in lossy:
                bar.set_hatch("///")
                bar.set_facecolor("white")
                bar.set_edgecolor("tab:blue")
        ax.axvline(1.0, color="black", lw=0.6, ls="--")
        ax.set_yticks(y, [str(label) + (" (lossy)" if label in lossy else "") for label in sub["label"]])
        ax.set_xlabel(f"speedup over {baseline_name(df)} (median over prompts, 95% interval)")
        ax.set_title(f"{pair} · {dataset}")
    return fig


def latency_vs_quality(df: pd.DataFrame, runs: list[dict], table: pd.DataFrame):
    """Per quality metric: milliseconds per token (x) against the summary's quality (y), one point per method setting."""
    # q_<metric>_baseline is the baseline's own score of q_<metric>: it does not belong at the method's latency.
    baseline_score = {f"{c}_baseline" for c in table.columns}
    qcols = [c for c in table.columns if c.startswith("q_") and c not in baseline_score and table[c].notna().any()]
    if not qcols:
        return "no record has a quality score"
    fig, axes = plt.subplots(1, len(qcols), figsize=(SINGLE * len(qcols), 2.4), squeeze=False)
    col = colors(table["label"])
    for ax, q in zip(axes[0], qcols):
        t = table[table[q].notna()]
        for _, r in t.iterrows():
            ax.scatter(r["ms_per_token"], r[q], color=col[r["label"]], s=18, zorder=3)
            ax.annotate(r["label"], (r["ms_per_token"], r[q]), fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.set_xlabel("latency (ms per token, median)")
        ax.set_ylabel(q[2:])
    return fig


def swept_setting(cfgs) -> str | None:
    """The one numeric setting that varies across a method's configs (``method_cfg`` dicts), if exactly one does."""
    keys = {k for c in cfgs for k, v in c.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    varying = [k for k in sorted(keys) if len({c.get(k) for c in cfgs}) > 1]
    return varying[0] if len(varying) == 1 else None


def setting_tradeoff(df: pd.DataFrame, runs: list[dict], table: pd.DataFrame):
    """Per method swept over one numeric setting (e.g. SPRINTER's threshold, SD's gamma): median speedup,
    and the first quality score when there is one, against that setting."""
    sub = df[~df["is_baseline"] & df["method_cfg"].map(lambda c: isinstance(c, dict))]
    swept = {m: k for m, g in sub.groupby("method") if (k := swept_setting(list(g["method_cfg"]))) is not None}
    if not swept:
        return "no method swept over a single numeric setting"
    fig, axes = plt.subplots(1, len(swept), figsize=(SINGLE * len(swept), 2.4), squeeze=False)
    for ax, (method, key) in zip(axes[0], swept.items()):
        g = sub[sub["method"] == method].assign(setting=lambda d: d["method_cfg"].map(lambda c: float(c[key])))
        qcols = [c for c in g.columns if c.startswith("q_") and g[c].notna().any()]
        pts = g.groupby("setting").agg(speedup=("speedup", "median"), **({"quality": (qcols[0], "mean")} if qcols else {}))
        ax.plot(pts.index, pts["speedup"], "o-", ms=3, label="speedup")
        handles = ax.get_legend_handles_labels()[0]
        if qcols:  # quality on its own axis, right
            ax2 = ax.twinx()
            ax2.plot(pts.index, pts["quality"], "s--", ms=3, color="tab:red", label=f"{qcols[0][2:]} (right)")
            ax2.set_ylabel(qcols[0][2:], color="tab:red")
            ax2.spines["right"].set_visible(True)
            ax2.grid(False)
            handles += ax2.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], frameon=False, loc="best")
        ax.set_title(method)
        ax.set_xlabel(f"method.{key}")
        ax.set_ylabel(f"speedup over {baseline_name(df)} (median)")
    return fig


def accepted_histogram(df: pd.DataFrame, runs: list[dict], table: pd.DataFrame):
    """Distribution of tokens committed per target call (after prefill), per drafting method."""
    drafting = df[df["drafted"].map(lambda d: isinstance(d, list) and any(d))] if "drafted" in df else df.iloc[:0]
    if drafting.empty:
        return "no method drafted tokens"
    fig, ax = plt.subplots(figsize=(SINGLE, 2.2))
    col = colors(drafting["label"])
    labs = sorted(drafting["label"].unique())
    top = max(a for lst in drafting["accept_lengths"] for a in lst)
    width = 0.8 / len(labs)
    for j, lab in enumerate(labs):
        acc = np.array([a for lst in drafting[drafting["label"] == lab]["accept_lengths"] for a in lst])
        share = np.bincount(acc, minlength=top + 1)[1:] / max(len(acc), 1)
        ax.bar(np.arange(1, top + 1) + (j - (len(labs) - 1) / 2) * width, share, width, label=lab, color=col[lab])
    ax.set_xlabel("tokens committed per target call")
    ax.set_ylabel("share of target calls")
    ax.legend(frameon=False)
    return fig


def measured_vs_analytic(df: pd.DataFrame, runs: list[dict], table: pd.DataFrame):
    """Measured median speedup against the method's own analytic one (sd: Leviathan et al., Thm 3.8)."""
    t = table[table["speedup_median"].map(_finite) & table["analytic_speedup"].map(_finite)]
    if t.empty:
        return "no method setting has both a measured and an analytic speedup"
    fig, ax = plt.subplots(figsize=(SINGLE, SINGLE))
    col = colors(t["label"])
    for _, r in t.iterrows():
        ax.scatter(r["analytic_speedup"], r["speedup_median"], color=col[r["label"]], s=14, zorder=3, label=r["label"])
    lim = [0, max(t["speedup_median"].max(), t["analytic_speedup"].max()) * 1.1]
    ax.plot(lim, lim, color="black", lw=0.6, ls="--")
    ax.set_xlim(lim)
    ax.set_ylim(lim)
    ax.set_xlabel("analytic speedup (the method's model; sd: Leviathan et al., Thm 3.8)")
    ax.set_ylabel("measured speedup (median)")
    handles, labs = ax.get_legend_handles_labels()
    uniq = dict(zip(labs, handles))
    ax.legend(uniq.values(), uniq.keys(), frameon=False)
    return fig


def acceptance_by_position(df: pd.DataFrame, runs: list[dict], table: pd.DataFrame):
    """P(draft token i accepted | the tokens before it accepted and i proposed), pooled over prompts: one line
    per method setting (and pair · dataset, where several are loaded)."""
    t = table[table["accept_by_position"].map(lambda v: isinstance(v, list) and any(_finite(x) for x in v))]
    if t.empty:
        return "no method drafted tokens"
    several = t[["pair", "dataset"]].drop_duplicates().shape[0] > 1
    fig, ax = plt.subplots(figsize=(SINGLE, 2.2))
    col = colors(t["label"])
    for _, r in t.iterrows():
        y = [v if _finite(v) else np.nan for v in r["accept_by_position"]]
        name = f"{r['label']} · {r['pair']} · {r['dataset']}" if several else r["label"]
        ax.plot(np.arange(1, len(y) + 1), y, "o-", ms=3, color=col[r["label"]], label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.legend(frameon=False)
    return fig


def flops_vs_latency(df: pd.DataFrame, runs: list[dict], table: pd.DataFrame):
    """Analytic forward FLOPs per token against measured milliseconds per token, per method setting."""
    t = table[table["gflops_per_token"].notna() & table["ms_per_token"].notna()]
    if t.empty:
        return "no records with FLOPs and timings"
    fig, ax = plt.subplots(figsize=(SINGLE, 2.4))
    col = colors(t["label"])
    for _, r in t.iterrows():
        ax.scatter(r["gflops_per_token"], r["ms_per_token"], color=col[r["label"]], s=18, zorder=3)
        ax.annotate(f"{r['label']} · {r['dataset']}", (r["gflops_per_token"], r["ms_per_token"]), fontsize=6,
                    xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("GFLOPs per token (all models)")
    ax.set_ylabel("ms per token (median)")
    return fig


def _batch_points(df: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame | str:
    """The summary's rows with ``line`` (their label without the batch size: one line per method setting) and ``B``
    (their batch size), when the records hold more than one batch size; else why not."""
    if "batch_size" not in df or df["batch_size"].fillna(1).nunique() < 2:
        return "the records hold one batch size"
    line = dict(zip(df["label"], saved.labels(df, axis="batch_size")))
    size = dict(zip(df["label"], df["batch_size"].fillna(1).astype(int)))
    return table.assign(line=table["label"].map(line), B=table["label"].map(size))


def panels(points: pd.DataFrame) -> list[tuple[str, str]]:
    """The (pair, dataset) pairs of ``points``, numbers in their names in numeric order (``long_input-512`` before
    ``long_input-2048``): one panel each, left to right."""
    def natural(name: str) -> list:
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(name))]

    return sorted(points.groupby(["pair", "dataset"]).groups, key=lambda combo: [natural(c) for c in combo])


def speedup_by_batch(df: pd.DataFrame, runs: list[dict], table: pd.DataFrame):
    """Issue 41: each method's median paired speedup over the baseline at the same batch size (with the bootstrap
    interval) against the batch size, one line per method setting (one panel per pair × dataset: the input length)."""
    points = _batch_points(df, table)
    if isinstance(points, str):
        return points
    baselines = set(df.loc[df["is_baseline"], "label"])
    points = points[points["speedup_median"].notna() & ~points["label"].isin(baselines)]
    if points.empty:
        return "no method with a paired baseline measurement"
    combos = panels(points)
    fig, axes = plt.subplots(1, len(combos), figsize=(SINGLE * len(combos), 2.4), squeeze=False, sharey=True)
    col = colors(points["line"])
    for ax, (pair, dataset) in zip(axes[0], combos):
        sub = points[(points["pair"] == pair) & (points["dataset"] == dataset)]
        lines = list(sub.groupby("line"))
        for j, (line, g) in enumerate(lines):
            g = g.sort_values("B")
            med = g["speedup_median"].to_numpy(float)
            err = np.nan_to_num(np.array([med - g["speedup_lo"].to_numpy(float), g["speedup_hi"].to_numpy(float) - med]))
            dodge = 2.0 ** (0.04 * (j - (len(lines) - 1) / 2))  # the intervals side by side, not on top of each other
            ax.errorbar(g["B"] * dodge, med, yerr=err, fmt="o-", ms=3, lw=1, capsize=2, color=col[line], label=line)
        ax.axhline(1.0, color="black", lw=0.6, ls="--")
        sizes = sorted(sub["B"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("batch size")
        ax.set_title(f"{pair} · {dataset}")
        ax.legend(frameon=False)
    axes[0, 0].set_ylabel(f"speedup over {baseline_name(df)} at the same B\n(median over prompts, 95% interval)")
    return fig


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both (lower x, higher y), in order of x: ``(latency, throughput)``."""
    front, best = [], -math.inf
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return front


def throughput_vs_latency(df: pd.DataFrame, runs: list[dict], table: pd.DataFrame):
    """Issue 41: each method setting's throughput (new tokens per second over the batch) against its per-token
    latency (median time per output token across requests), one point per batch size joined in order of B, and the
    Pareto front over every point (one panel per pair × dataset)."""
    points = _batch_points(df, table)
    if isinstance(points, str):
        return points
    points = points[points["throughput"].notna() & points["tpot_ms"].notna()]
    if points.empty:
        return "no record with a time to its first token"
    combos = panels(points)
    fig, axes = plt.subplots(1, len(combos), figsize=(SINGLE * len(combos), 2.6), squeeze=False)
    col = colors(points["line"])
    for ax, (pair, dataset) in zip(axes[0], combos):
        sub = points[(points["pair"] == pair) & (points["dataset"] == dataset)]
        for line, g in sub.groupby("line"):
            g = g.sort_values("B")
            ax.plot(g["tpot_ms"], g["throughput"], "o-", ms=3, lw=1, color=col[line], label=line)
            for _, r in g.iterrows():
                ax.annotate(f"B={r['B']}", (r["tpot_ms"], r["throughput"]), fontsize=5, xytext=(2, 2),
                            textcoords="offset points")
        front = pareto_front(list(zip(sub["tpot_ms"], sub["throughput"])))
        ax.step([x for x, _ in front], [y for _, y in front], where="post", color="grey", lw=2, alpha=0.35,
                zorder=0, label="Pareto front")
        ax.set_xlabel("time per output token (ms, median over requests)")
        ax.set_ylabel("throughput (new tokens/s over the batch)")
        ax.set_title(f"{pair} · {dataset}")
        ax.legend(frameon=False)
    return fig


FIGURES = {
    "speedup_overview": speedup_overview,
    "speedup_by_category": speedup_by_category,
    "latency_vs_quality": latency_vs_quality,
    "setting_tradeoff": setting_tradeoff,
    "accepted_histogram": accepted_histogram,
    "measured_vs_analytic": measured_vs_analytic,
    "flops_vs_latency": flops_vs_latency,
    "acceptance_by_position": acceptance_by_position,
    "speedup_by_batch": speedup_by_batch,
    "throughput_vs_latency": throughput_vs_latency,
}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def make_figures(df: pd.DataFrame, runs: list[dict], out_dir: Path) -> dict:
    """Draw every figure whose data is present into ``out_dir`` as ``<name>.pdf`` and ``<name>.png``.
    Returns ``{name: png path}`` for those drawn and ``{name: reason}`` in ``skipped``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = summary.summary_table(df)
    drawn, skipped = {}, {}
    with plt.rc_context(STYLE):
        for name, fn in FIGURES.items():
            fig = fn(df, runs, table)
            if isinstance(fig, str):
                skipped[name] = fig
                log.info("figure %s skipped: %s", name, fig)
                continue
            for ext in ("pdf", "png"):
                fig.savefig(out_dir / f"{name}.{ext}")
            plt.close(fig)
            drawn[name] = out_dir / f"{name}.png"
    return {"drawn": drawn, "skipped": skipped}


def learning_curve(curve: dict):
    """Held-out acceptance against teacher tokens: the distilled draft's greedy agreement (text, target answer rows,
    the answers' tokens alone) and each head's top-1 agreement (one line per head, Medusa solid, Hydra dashed), log-scaled tokens."""
    rows = curve["rows"]
    x = [r["tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(DOUBLE, 2.4))
    for key, name, style in (("draft_answer_tokens", "on answer tokens (what α follows)", "^-"),
                             ("draft_answers", "on target answer rows", "o-"), ("draft_text", "on text", "s--")):
        y = [r.get(key) for r in rows]
        if any(v is not None for v in y):
            left.plot(x, [math.nan if v is None else v for v in y], style, ms=3, label=name)
    left.set_title(f"distilled draft ({curve['pair']})")
    styles = {"medusa": "-", "hydra": "--", "hydra_pp": ":"}
    cmap = plt.get_cmap("tab10")
    for method in curve["methods"]:
        heads = len(rows[0].get(method) or [])
        for k in range(heads):
            right.plot(x, [r[method][k] for r in rows], styles.get(method, "-."), marker="o", ms=3, color=cmap(k),
                       label=f"{method} head {k}")
    right.set_title("draft heads")
    for ax in (left, right):
        ax.axhline(0.35, color="0.5", lw=0.6, ls=":", label="target 0.35")  # issue 12's: draft alpha, head 0
        ax.set_xscale("log")
        # The budgets themselves as ticks: a log axis's own minor labels overlap at this width.
        ax.set_xticks(x, [f"{t:,}" for t in x])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(f"teacher tokens (recipe={curve['recipe']} epochs)")
        ax.set_ylabel("held-out top-1 agreement")
        ax.legend(fontsize=6)
    return fig


def save_learning_curve(curve: dict, out_dir: Path) -> Path:
    """Draw :func:`learning_curve` into ``out_dir/learning_curve.{pdf,png}``; returns the PNG's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with plt.rc_context(STYLE):
        fig = learning_curve(curve)
        for ext in ("pdf", "png"):
            fig.savefig(out_dir / f"learning_curve.{ext}")
        plt.close(fig)
    return out_dir / "learning_curve.png"
