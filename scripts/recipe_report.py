"""What a training recipe buys on a pair: the trained parts' held-out figures and, from a sweep, their decoding.

  python -m bench train all recipe=full                       # train everything first (this script never trains)
  python -m bench run -m method=sd,medusa,hydra,hydra_pp,amphista,sprinter,eagle recipe=full
  python -m bench run -m method=koala method.base=medusa,eagle recipe=full
  python scripts/recipe_report.py recipe=full [--sweep DIR [--sweep DIR2]] [--out DIR] [overrides]

Reads the cached training reports of every trained part under the recipe (``train_if_missing`` is off: a part
that is not trained is one sentence saying how to train it) and prints them against issue 12's targets:

- the distilled draft: greedy agreement with the target on held-out text and on the target's own held-out answers
  (rows of the prompt's end, then the answer: ``scripts/answer_agreement.py`` counts answer tokens alone, the
  positions greedy SD drafts for); with ``--sweep``, its acceptance α while decoding (the target: >= 0.35);
- Medusa / Hydra / Hydra++ / Amphista heads: held-out top-1 agreement per head (targets: Medusa head 0 >= 0.35,
  Hydra >= Medusa at every head); with ``--sweep``, whether amphista accepts more per target call than medusa
  (issue 13);
- the SPRINTER verifier: held-out ROC-AUC, precision and recall on on-policy labels;
- EAGLE's draft layer: held-out agreement of its first draft token, on all text and on the target's answers
  (issue 13); with ``--sweep``, whether eagle beats ar (the target: >= 1.0x);
- KOALA over each base (issue 13): the K-layer head's held-out agreement beside its base's and how well its
  discriminator told them apart; with ``--sweep``, whether koala accepts more per target call than its base;
- with ``--sweep DIR``: the sweep's summary (speedup against ar, mean accepted tokens per target call, α) per method.

Each target is printed as met or not met, with the figure: a report, not an assertion. Writes
<--out, default results/recipe_report>/<time>.json with provenance.
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

from bench import summary  # noqa: E402
from bench.cli import compose  # noqa: E402
from bench.models import load_pair, resolve_device, use_threads  # noqa: E402
from bench.results import provenance, write_json_atomic  # noqa: E402
from bench.validate import validate  # noqa: E402
from core import files  # noqa: E402
from core.errors import BenchError  # noqa: E402
from methods.registry import get_method  # noqa: E402
from training.distill import draft_report  # noqa: E402

HEADS = ("medusa", "hydra", "hydra_pp", "amphista")


def trained_reports(cfg) -> dict:
    """The training report of the pair's first distilled draft, of each heads method, of the verifier, of
    EAGLE's draft layer and of KOALA's heads over each base (``koala (base=medusa)``, as ``train all`` names it)."""
    pair = load_pair(cfg, n_drafts=1)  # reads only: main composes train_if_missing=false
    specs = [s for s in cfg.pair.get("drafts") or [] if s.source == "distilled"]
    out = {"draft": draft_report(pair.target.module, pair.tokenizer, specs[0].recipe, pair.teacher) if specs else {}}
    for name in (*HEADS, "sprinter", "eagle", "koala"):
        for label, settings in get_method(name).variants():  # as train all trains them: koala over each base
            method = get_method(name)(settings, pair)
            method.setup(train_if_missing=False)
            out[label] = method.report
    return out


def targets(reports: dict, decoding: dict) -> list[dict]:
    """Issue 12's targets, each with its measured figure and whether it is met."""
    medusa, hydra = reports["medusa"].get("agreement_after", []), reports["hydra"].get("agreement_after", [])
    alpha = decoding.get("sd", {}).get("alpha")
    rows = [
        {"target": "draft alpha while decoding >= 0.35", "measured": alpha,
         "met": None if alpha is None else alpha >= 0.35},
        {"target": "draft held-out agreement on target answer rows (context)", "measured":
         reports["draft"].get("answer_agreement"), "met": None},
        {"target": "draft held-out agreement on answer tokens alone (context; what alpha follows)", "measured":
         reports["draft"].get("answer_token_agreement"), "met": None},
        {"target": "Medusa head-0 agreement >= 0.35", "measured": medusa[0] if medusa else None,
         "met": bool(medusa) and medusa[0] >= 0.35},
        {"target": "Hydra >= Medusa at every head", "measured": f"{hydra} vs {medusa}",
         "met": bool(hydra) and all(h >= m for h, m in zip(hydra, medusa))},
    ]
    v = reports["sprinter"]
    rows.append({"target": "SPRINTER verifier ROC-AUC / precision / recall (reported)",
                 "measured": f"{v.get('roc_auc', float('nan')):.3f} / {v.get('precision', float('nan')):.3f} / "
                             f"{v.get('recall', float('nan')):.3f}", "met": None})
    eagle = decoding.get("eagle", {}).get("speedup_median") if decoding.get("eagle", {}).get("against") == "ar" else None
    rows.append({"target": "eagle >= 1.0x ar while decoding (issue 13)", "measured": eagle,
                 "met": None if eagle is None else eagle >= 1.0})
    for method, base in (("amphista", "medusa"), ("koala (base=medusa)", "medusa"), ("koala (base=eagle)", "eagle")):
        mine, theirs = (decoding.get(k, {}).get("mean_accepted") for k in (method, base))
        rows.append({"target": f"{method} accepts more per target call than {base} (issue 13)",
                     "measured": f"{mine} vs {theirs}", "met": None if mine is None or theirs is None else mine > theirs})
    return rows


def sweep_summary(sweeps: list[Path]) -> dict:
    """Per method of the sweeps (koala per base: ``koala (base=medusa)``): paired speedup against the run's baseline
    (``against``: ar, or e.g. eagle for ``baseline=eagle``), mean accepted tokens per call and α (bench.summary)."""
    keep = ["label", "speedup_median", "speedup_lo", "speedup_hi", "mean_accepted", "alpha", "matches_baseline"]
    out = {}
    for sweep in sweeps:
        prov = files.read_run_json(sweep)  # whom the run timed against (baseline=eagle, say), as bench table reads it
        against = ((prov or {}).get("config") or {}).get("baseline", "ar")
        for row in summary.as_rows(summary.run_summary(sweep)):
            if row["method"] == "ar":
                continue
            entry = {**{k: row.get(k) for k in keep}, "against": against}
            if row["method"] == against:  # the baseline itself: its acceptance counts, a speedup over itself not
                entry.update(speedup_median=None, speedup_lo=None, speedup_hi=None, against=None)
            # koala's label names its base: "koala (recipe=full, base=medusa)"
            name = f"koala (base={'medusa' if 'base=medusa' in row['label'] else 'eagle'})" if row["method"] == "koala" else row["method"]
            out[name] = entry
    return out


def koala_vs_base(reports: dict, base: str) -> list:
    """KOALA's held-out agreement over ``base`` and the base's own: per head for medusa, the first draft token's
    for eagle."""
    return [reports[f"koala (base={base})"].get("agreement_after"), reports[base].get("agreement_after")]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", type=Path, action="append", help="a sweep (or run) directory of the trained methods "
                    "under this recipe (repeat for several)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "recipe_report")
    args, overrides = ap.parse_known_args(argv)
    try:
        cfg = validate(compose([*overrides, "train_if_missing=false"]))
        use_threads(cfg)
        reports = trained_reports(cfg)
        decoding = sweep_summary(args.sweep) if args.sweep else {}
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"\nrecipe={cfg.recipe.name} (tokens {cfg.recipe.tokens:,}), pair={cfg.pair.name}\n")
    d = reports["draft"]
    print(f"draft: held-out agreement {d.get('agreement_before')} -> {d.get('agreement_after')}, on target answers "
          f"{d.get('answer_agreement')} (answer tokens alone {d.get('answer_token_agreement')}), vocab coverage {d.get('vocab_coverage')}, {d.get('train_tokens')} tokens")
    heads = [[n, reports[n].get("layers"), reports[n].get("prefix_layer"), *reports[n].get("agreement_after", [])]
             for n in HEADS]
    print("\n" + tabulate(heads, headers=["heads", "layers", "prefix", "head 0", "head 1", "head 2", "head 3"],
                          floatfmt=".3f"))
    v = reports["sprinter"]
    print(f"\nSPRINTER verifier (width {v.get('width')}): ROC-AUC {v.get('roc_auc'):.3f}, precision "
          f"{v.get('precision'):.3f}, recall {v.get('recall'):.3f}, accept rate {v.get('accept_rate'):.3f}")
    e = reports["eagle"]
    print(f"\nEAGLE draft layer: held-out depth-1 agreement {e.get('agreement_before')} -> {e.get('agreement_after')}, "
          f"on target answers {e.get('answer_agreement')} (answer tokens alone {e.get('answer_token_agreement')}), "
          f"{e.get('train_tokens')} tokens")
    koala = [[f"koala (base={b})", reports[f"koala (base={b})"].get("layers"),
              reports[f"koala (base={b})"].get("discriminator_auc_mean"), *koala_vs_base(reports, b)] for b in ("medusa", "eagle")]
    print("\n" + tabulate(koala, headers=["KOALA", "K", "discriminator AUC", "held-out agreement", "its base's"]))
    if decoding:
        print("\n" + tabulate([{"method": m, **r} for m, r in decoding.items()], headers="keys", floatfmt=".3f"))
    rows = targets(reports, decoding)
    print("\n" + tabulate(rows, headers="keys"))
    out = args.out / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, {"recipe": cfg.recipe.name, "reports": reports, "decoding": decoding, "targets": rows,
                            "sweep": [str(s) for s in args.sweep or []], "provenance": provenance(cfg, resolve_device(cfg.device))})
    print(json.dumps({"written": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
