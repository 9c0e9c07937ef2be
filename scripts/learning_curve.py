"""How much teacher data a trained drafter needs: held-out acceptance against teacher tokens.

  python scripts/learning_curve.py [--tokens 16384,65536,196608] [--methods medusa,hydra] [--out DIR] [overrides]

For each budget N, the run's recipe (default ``recipe=full``: its epochs, its store) with ``recipe.tokens=N``
trains the pair's distilled draft and the heads of ``--methods`` (cached like any run's: a budget already
trained is read back, and every budget reads the first N tokens of one shared teacher store), then reads their
held-out figures:

- the draft's greedy agreement with the target on held-out text and on the target's own held-out answers (the
  positions greedy SD drafts for: the α a chain of accepted tokens sees);
- each head's top-1 agreement with the target's token k + 1 steps after its next one.

Prints a table, writes <--out, default results/learning_curve>/<time>/learning_curve.{json,pdf,png} with
provenance. ``python -m bench report`` includes the figure of any ``learning_curve.json`` under the paths it is
given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cli import compose  # noqa: E402
from bench.models import load_pair, resolve_device, use_threads  # noqa: E402
from bench.plots import save_learning_curve  # noqa: E402
from bench.results import provenance, write_json_atomic  # noqa: E402
from bench.validate import validate_run  # noqa: E402
from core.errors import BenchError  # noqa: E402
from methods.registry import get_method  # noqa: E402
from training.distill import draft_report  # noqa: E402


def point(overrides: list[str], tokens: int, methods: list[str]) -> tuple[dict, object]:
    """Train (or read back) the draft and the heads under ``recipe.tokens=tokens``; their held-out figures and
    the config they were trained under."""
    cfg, checked = validate_run(compose([*overrides, f"recipe.tokens={tokens}"]))
    use_threads(cfg)
    pair = load_pair(cfg, 1, checked)  # distils the draft first when it is missing
    specs = [s for s in cfg.pair.get("drafts") or [] if s.source == "distilled"]
    row = {"tokens": tokens, "recipe": cfg.recipe.name}
    if specs:
        d = draft_report(pair.target.module, pair.tokenizer, specs[0].recipe, pair.teacher)
        row.update(draft_text=d["agreement_after"], draft_answers=d.get("answer_agreement"),
                   draft_answer_tokens=d.get("answer_token_agreement"),  # what alpha follows (None: trained before)
                   train_tokens=d["train_tokens"])
    for name in methods:
        method = get_method(name)(get_method(name).settings({}), pair)
        method.setup()
        row[name] = method.report["agreement_after"]
    return row, cfg


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="16384,65536,196608", help="teacher-token budgets, comma-separated")
    ap.add_argument("--methods", default="medusa,hydra", help="heads methods to train at each budget")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "learning_curve")
    args, overrides = ap.parse_known_args(argv)
    if not any(o.startswith("recipe=") for o in overrides):
        overrides = ["recipe=full", *overrides]
    methods = [m for m in args.methods.split(",") if m]
    try:
        budgets = sorted({int(t) for t in args.tokens.split(",")})
        if not budgets or budgets[0] < 1:
            raise ValueError
    except ValueError:
        print(f"error: --tokens takes positive integers separated by commas, not '{args.tokens}'.", file=sys.stderr)
        return 2
    rows = []
    try:
        for tokens in budgets:
            row, cfg = point(overrides, tokens, methods)
            rows.append(row)
            print(json.dumps(row), flush=True)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n" + tabulate(rows, headers="keys", floatfmt=".3f"))
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    curve = {"pair": cfg.pair.name, "recipe": cfg.recipe.name, "methods": methods, "rows": rows,
             "provenance": provenance(cfg, resolve_device(cfg.device))}
    write_json_atomic(out / "learning_curve.json", curve)
    save_learning_curve(curve, out)
    print(json.dumps({"written": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
