"""``table``, ``plot`` and ``report``: tables, figures and one HTML page from saved results.

RESULTS are run directories, sweep directories or ``records.jsonl`` files; directories are searched
recursively for ``records.jsonl``. Outputs go to ``--out`` (default: ``<first RESULTS directory>/report``).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import html
import json
from pathlib import Path

import pandas as pd

from bench import saved, summary
from core.errors import BenchError, Parser


def _args(cmd: str, argv: list[str], extra=()) -> argparse.Namespace:
    p = Parser(prog=f"python -m bench {cmd}", description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="run dirs, sweep dirs or records.jsonl files")
    p.add_argument("--out", help="output directory (default: <first RESULTS dir>/report)")
    p.add_argument("--baseline", default=None,
                   help="method the speedups are paired against (default: each run's own, from its run.json; else ar)")
    for flag, kw in extra:
        p.add_argument(flag, **kw)
    args = p.parse_args(argv)
    first = Path(args.results[0])
    args.out = Path(args.out) if args.out else (first if first.is_dir() else first.parent) / "report"
    return args


_TABLE_FLAGS = [
    ("--by-category", {"action": "store_true", "help": "one row per category as well"}),
    ("--ci", {"type": float, "default": 0.95, "help": "bootstrap confidence level of the median speedup"}),
]


def write_table(table: pd.DataFrame, out_dir: Path, stem: str) -> dict:
    """``<stem>.csv`` (all columns, full precision), ``.md`` and ``.tex`` (the display form)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shown = summary.display_table(table)
    paths = {"csv": out_dir / f"{stem}.csv", "md": out_dir / f"{stem}.md", "tex": out_dir / f"{stem}.tex"}
    summary.for_csv(table).to_csv(paths["csv"], index=False)
    paths["md"].write_text(summary.markdown(table) + "\n")
    paths["tex"].write_text(shown.to_latex(index=False, float_format=lambda x: f"{x:.3g}", na_rep="--", escape=True))
    return paths


def table_main(argv: list[str]) -> int:
    """``python -m bench table RESULTS... [--by-category] [--ci 0.95] [--out DIR]``."""
    args = _args("table", argv, _TABLE_FLAGS)
    if not 0 < args.ci < 1:
        raise BenchError(f"--ci must be in (0, 1), got {args.ci}.")
    df, _ = saved.load(args.results, args.baseline)
    tables = {"summary": summary.summary_table(df, level=args.ci)}
    if args.by_category:
        tables["by_category"] = summary.summary_table(df, by_category=True, level=args.ci)
    for stem, table in tables.items():
        print(f"\n{stem} ({len(df)} records; {summary.legend(args.ci)})\n")
        print(summary.markdown(table))
        write_table(table, args.out, stem)
    print(f"\ntables: {args.out}/{{{','.join(tables)}}}.{{csv,md,tex}}")
    return 0


def plot_main(argv: list[str]) -> int:
    """``python -m bench plot RESULTS... [--out DIR]``: every figure whose data is present, PDF and PNG."""
    from bench.plots import make_figures

    args = _args("plot", argv)
    df, runs = saved.load(args.results, args.baseline)
    res = make_figures(df, runs, args.out / "figures")
    for name in res["drawn"]:
        print(f"figure: {args.out / 'figures' / name}.{{pdf,png}}")
    for name, why in res["skipped"].items():
        print(f"skipped {name}: {why}")
    return 0


# ------------------------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222;line-height:1.4}
table{border-collapse:collapse;font-size:13px;margin:0.5em 0 1.5em}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f3f3f3} td:first-child,th:first-child{text-align:left}
figure{display:inline-block;margin:0.5em 1em 1.5em 0;vertical-align:top}
figure img{max-width:100%} figcaption{font-size:13px;color:#555;max-width:640px}
pre{background:#f7f7f7;padding:0.6em;font-size:12px;overflow-x:auto} .muted{color:#777}
"""


def _provenance_rows(runs: list[dict]) -> pd.DataFrame:
    rows = []
    for run in runs:
        cfg = run.get("config") or {}
        git = run.get("git") or {}
        rows.append({
            "run": run["run_dir"],
            "status": run.get("status"),
            "method": (cfg.get("method") or {}).get("name"),
            "pair": (cfg.get("pair") or {}).get("name"),
            "dataset": (cfg.get("dataset") or {}).get("name"),
            "commit": (git.get("commit") or "")[:10] + (" (dirty)" if git.get("dirty") else ""),
            "device": run.get("gpu") or run.get("cpu") or run.get("device"),
            "threads": run.get("threads"),
            "torch": (run.get("versions") or {}).get("torch"),
            "transformers": (run.get("versions") or {}).get("transformers"),
            "c": run.get("cost_ratio_c"),
            "started": run.get("started"),
        })
    return pd.DataFrame(rows)


def _html_table(df: pd.DataFrame) -> str:
    return df.to_html(index=False, na_rep="–", float_format=lambda x: f"{x:.3g}", border=0, escape=True)


def render_report(df: pd.DataFrame, runs: list[dict], out_dir: Path, level: float = 0.95,
                  curves: list[Path] = ()) -> Path:
    """Write ``out_dir/report.html``: tables, figures (PNG inlined as base64) and every run's provenance;
    ``curves``: ``learning_curve.json`` files (``scripts/learning_curve.py``), each drawn as a figure too."""
    from bench.plots import FIGURES, learning_curve, make_figures, save_learning_curve

    figs = make_figures(df, runs, out_dir / "figures")
    captions = {name: fn.__doc__ for name, fn in FIGURES.items()}
    for i, path in enumerate(curves):
        name = "learning_curve" + (f"_{i + 1}" if len(curves) > 1 else "")
        figs["drawn"][name] = save_learning_curve(_read_curve(path), out_dir / "figures" / name)
        captions[name] = learning_curve.__doc__
    table = summary.summary_table(df, level=level)
    by_cat = summary.summary_table(df, by_category=True, level=level)
    write_table(table, out_dir, "summary")
    write_table(by_cat, out_dir, "by_category")
    baselines = ", ".join(sorted(df.loc[df["is_baseline"], "method"].unique())) or "none"
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Speculative decoding benchmark report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>Speculative decoding benchmark report</h1>",
        f"<p class='muted'>{len(df)} records from {df['run_dir'].nunique()} run directories; generated "
        f"{dt.datetime.now().isoformat(timespec='seconds')}. Per-prompt speedup: the baseline's "
        f"({html.escape(baselines)}) seconds per token over the method's, both decoded on the same prompt in the "
        f"same run. {html.escape(summary.legend(level))}.</p>",
        "<h2>Summary</h2>", _html_table(summary.display_table(table)),
        "<h2>By category</h2>", _html_table(summary.display_table(by_cat)),
        "<h2>Figures</h2>",
    ]
    for name, png in figs["drawn"].items():
        data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
        caption = html.escape((captions.get(name) or name).strip().splitlines()[0])
        parts.append(f"<figure id='fig-{name}'><img alt='{name}' src='data:image/png;base64,{data}'>"
                     f"<figcaption><b>{name}</b>: {caption}</figcaption></figure>")
    if figs["skipped"]:
        items = "".join(f"<li>{html.escape(n)}: {html.escape(w)}</li>" for n, w in figs["skipped"].items())
        parts.append(f"<p class='muted'>Not drawn (no data):</p><ul class='muted'>{items}</ul>")
    parts += ["<h2>Runs and provenance</h2>", _html_table(_provenance_rows(runs)) if runs else "<p>No run.json found.</p>"]
    for run in runs:
        blob = json.dumps({k: v for k, v in run.items() if k != "summary"}, indent=1, default=str)
        parts.append(f"<details><summary>{html.escape(run['run_dir'])}</summary><pre>{html.escape(blob)}</pre></details>")
    # Marks on <body> how many images the browser decoded (tests read it from a headless browser's DOM).
    parts.append("<script>addEventListener('load',()=>{document.body.dataset.imagesLoaded="
                 "[...document.images].filter(i=>i.complete&&i.naturalWidth>0).length;});</script>")
    parts.append("</body></html>")
    out = out_dir / "report.html"
    out.write_text("\n".join(parts), encoding="utf-8")
    return out


def _read_curve(path: Path) -> dict:
    """A ``learning_curve.json`` as written by ``scripts/learning_curve.py``; one sentence when it is not one."""
    try:
        curve = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(curve, dict) or not isinstance(curve.get("rows"), list) or not curve["rows"]:
            raise ValueError("no rows")
        return curve
    except (OSError, ValueError) as err:
        raise BenchError(f"'{path}' is not a learning curve written by scripts/learning_curve.py ({err}).") from None


def report_main(argv: list[str]) -> int:
    """``python -m bench report RESULTS... [--out DIR]``: one self-contained HTML page."""
    args = _args("report", argv, _TABLE_FLAGS[1:])
    # Learning curves (scripts/learning_curve.py) under the paths are figures of the report; a path holding
    # curves and no records is not a run.
    curves, runs_paths = [], []
    for p in map(Path, args.results):
        found = [p] if p.name == "learning_curve.json" else sorted(p.rglob("learning_curve.json")) if p.is_dir() else []
        curves += found
        if not found or (p.is_dir() and any(p.rglob("records.jsonl"))):
            runs_paths.append(str(p))
    df, runs = saved.load(runs_paths, args.baseline)
    path = render_report(df, runs, args.out, args.ci, curves)
    print(f"report: {path}")
    return 0

