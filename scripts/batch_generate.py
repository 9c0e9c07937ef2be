"""Batched `ar` against transformers' own batched greedy `generate()`, on the same prompts, B at a time (issue 41).

  python scripts/batch_generate.py [--batch 8] [--out DIR] [hydra overrides, e.g. dataset.n_prompts=16 compile=true]

Both decode the dataset's prompts in groups of B, in the dataset's order, the order of the two alternating from group
to group, each group once under the harness clock (device synchronised before every read) after one untimed warm-up
group each:

- ``ours``: `ar`'s batch decode (``DraftVerify.decode_batch`` over the target's static cache of B rows, compiled per
  row bucket with ``compile=true``; ``bench.runner.timed_batch``);
- ``hf``: ``generate(do_sample=False)`` on the group left-padded to its longest prompt (the tokenizer's ``padding_side
  = "left"``, an attention mask), its rows cut at their first stop token.

Throughput is each one's new tokens (to the first stop token or the budget) over its seconds, summed over the groups;
the target: ours at least 0.95x transformers' at B = 8 (issue 41). Rows whose tokens differ are counted: left padding
changes fp32 sums a little, so transformers' rows may part from the unpadded decode at a near-tie, where ours, which
pads nothing into a row's attention, must not. Prints one JSON object; writes it to <--out, default
results/batch_generate>/<time>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cli import compose  # noqa: E402
from bench.data import encode, load_prompts  # noqa: E402
from bench.models import load_pair, use_threads  # noqa: E402
from bench.results import provenance, write_json_atomic  # noqa: E402
from bench.runner import batch_models, clocked, timed_batch  # noqa: E402
from bench.validate import validate_run  # noqa: E402
from core import metrics  # noqa: E402
from decoding.sampling import Sampling  # noqa: E402
from methods.registry import get_method  # noqa: E402


def hf_batch(pair, group: list[list[int]], max_new: int, stops: frozenset[int]) -> tuple[list[list[int]], float]:
    """transformers' greedy ``generate()`` on ``group`` left-padded: each row's new tokens to its first stop token
    (kept), and the seconds."""
    tok = pair.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(ids) for ids in group)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=pair.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=pair.device)
    out, seconds = clocked(pair.device, pair.target.module.generate, input_ids=ids, attention_mask=mask,
                           max_new_tokens=max_new, do_sample=False, pad_token_id=pad)
    rows = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        rows.append(row[:end])
    return rows, seconds


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "batch_generate")
    args, overrides = ap.parse_known_args(argv)
    cfg, checked = validate_run(compose(["method=ar", f"batch_size={args.batch}", *overrides]))
    use_threads(cfg)
    pair = load_pair(cfg, 0, checked)
    prompts = load_prompts(cfg.dataset, cfg.seed)
    encoded = [encode(p, pair.tokenizer, cfg.dataset.get("template")) for p in prompts]
    ar = get_method("ar")(cfg.method, pair)
    batch_models(cfg, pair, encoded, [ar])  # the target's static cache of B rows (compiled with compile=true)
    max_new, b = int(cfg.max_new_tokens), args.batch
    groups = [list(range(g, min(g + b, len(encoded)))) for g in range(0, len(encoded), b)]
    tensors = [torch.tensor([ids], device=pair.device) for ids in encoded]

    def ours(group):
        res = timed_batch(ar, pair, [tensors[i] for i in group], max_new, Sampling(), [cfg.seed] * len(group))
        return [r["decoded"].output_ids for r in res], res[0]["batch"]["wall_s"]

    def hf(group):
        return hf_batch(pair, [encoded[i] for i in group], max_new, ar.eos_ids)

    runners = {"ours": ours, "hf": hf}
    for fn in runners.values():  # untimed: first-call allocations, lazy inits
        fn(groups[0])
    totals = {n: {"tokens": 0, "seconds": 0.0} for n in runners}
    differ = 0
    for g, group in enumerate(groups):
        outs = {}
        for name in (list(runners) if g % 2 == 0 else list(runners)[::-1]):
            rows, seconds = runners[name](group)
            outs[name] = rows
            totals[name]["tokens"] += sum(len(r) for r in rows)
            totals[name]["seconds"] += seconds
        differ += sum(a != h for a, h in zip(outs["ours"], outs["hf"]))
        print(f"group {g + 1}/{len(groups)}: " + "  ".join(
            f"{n}={totals[n]['tokens'] / totals[n]['seconds']:.1f} tok/s so far" for n in runners), flush=True)
    tps = {n: metrics.ratio(t["tokens"], t["seconds"]) for n, t in totals.items()}
    result = {
        "batch_size": b, "prompts": len(encoded), "max_new_tokens": max_new, "compile": bool(cfg.compile),
        "threads": torch.get_num_threads(), "device": str(pair.device), "pair": cfg.pair.name,
        "tokens_per_s": tps, "ours_over_hf": metrics.ratio(tps["ours"], tps["hf"]),
        "totals": totals, "rows_differing": differ,
    }
    print(json.dumps(result, indent=2))
    out = args.out / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, {**result, "provenance": provenance(cfg, pair.device)})
    print(f"written: {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
