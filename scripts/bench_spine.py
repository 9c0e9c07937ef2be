"""Benchmark of the harness spine against transformers' own decoding, in ONE run, on the same prompts.

  python scripts/bench_spine.py [--out DIR] [hydra overrides, e.g. dataset.n_prompts=18 max_new_tokens=128 method.gamma=4]

For every prompt, in an order that alternates from prompt to prompt:
  ours `ar`  vs  transformers `generate()` greedy          (our baseline must not be slower)
  ours `sd`  vs  transformers assisted generation with the same draft (`assistant_model=`, constant gamma)
All four must produce the same greedy tokens. Prints a table and writes <--out, default results/bench_spine>/<time>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers.utils import is_sklearn_available

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cli import compose  # noqa: E402
from bench.data import encode, load_prompts  # noqa: E402
from bench.models import load_pair, use_threads  # noqa: E402
from bench.results import provenance, write_json_atomic  # noqa: E402
from bench.runner import clocked, cost_ratio, timed_decode  # noqa: E402
from bench.validate import validate_run  # noqa: E402
from core import metrics  # noqa: E402
from decoding.sampling import Sampling  # noqa: E402
from methods.registry import get_method  # noqa: E402


def hf_generate(pair, x, max_new, gamma=None, confidence=0.0):
    """transformers' greedy generate(), or its assisted generation with our draft when ``gamma`` is set
    (``confidence``: its assistant_confidence_threshold, the same early stop as ``method.confidence``)."""
    kwargs = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=pair.tokenizer.eos_token_id)
    if gamma is not None:
        draft = pair.draft.module
        draft.generation_config.num_assistant_tokens = gamma
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        # 0: plain gamma-token drafts. transformers tunes a non-zero threshold online only when scikit-learn
        # is installed (it is not, by default): the summary says which it did.
        draft.generation_config.assistant_confidence_threshold = confidence
        kwargs["assistant_model"] = draft
    out, seconds = clocked(pair.device, pair.target.module.generate, x, **kwargs)
    return out[0, x.shape[1]:].tolist(), seconds, None


def ours(method, pair, x, max_new, seed):
    """Our method under the harness's own clock (bench.runner.timed_decode)."""
    res = timed_decode(method, pair, x, max_new, Sampling(), seed)
    return res["decoded"].output_ids, res["wall_s"], res["decoded"]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench_spine")
    args, overrides = ap.parse_known_args(argv)
    cfg, checked = validate_run(compose(["method=sd", *overrides]))  # defaults filled in (max_new_tokens: the dataset's)
    use_threads(cfg)
    pair = load_pair(cfg, checked=checked)  # distils the draft first when it is missing
    prompts = load_prompts(cfg.dataset, cfg.seed)
    xs = [torch.tensor([encode(p, pair.tokenizer)], device=pair.device) for p in prompts]
    ar = get_method("ar")(compose(["method=ar"]).method, pair)
    sd = get_method("sd")(cfg.method, pair)
    gamma, max_new, confidence = int(cfg.method.gamma), int(cfg.max_new_tokens), float(cfg.method.confidence)

    runners = {
        "ours_ar": lambda x, i: ours(ar, pair, x, max_new, i),
        "hf_generate": lambda x, i: hf_generate(pair, x, max_new),
        "ours_sd": lambda x, i: ours(sd, pair, x, max_new, i),
        "hf_assisted": lambda x, i: hf_generate(pair, x, max_new, gamma, confidence),
    }
    for fn in runners.values():  # untimed warm-up of every path
        fn(xs[0], 0)
    c = cost_ratio(pair, xs[0])
    rows = {k: [] for k in runners}
    sd_steps = ([], [])
    for i, x in enumerate(xs):
        order = list(runners) if i % 2 == 0 else list(runners)[::-1]
        outs = {}
        for name in order:
            tokens, seconds, decoded = runners[name](x, i)
            if name == "ours_sd":
                sd_steps[0].extend(decoded.accept_lengths)
                sd_steps[1].extend(decoded.drafted)
            outs[name] = tokens
            rows[name].append({"prompt_id": prompts[i].prompt_id, "seconds": seconds, "tokens": len(tokens)})
        same = {n: outs[n] == outs["ours_ar"] for n in outs}
        print(f"{prompts[i].prompt_id:>8}: " + "  ".join(f"{n}={r[-1]['tokens'] / r[-1]['seconds']:.1f} tok/s" for n, r in rows.items())
              + ("" if all(same.values()) else f"  MISMATCH {same}"), flush=True)
        for n in rows:
            rows[n][-1]["matches_ours_ar"] = same[n]

    def tps(name):
        return metrics.median(r["tokens"] / r["seconds"] for r in rows[name])

    def paired(a, b):  # median over prompts of (b's seconds per token / a's)
        return metrics.median((rb["seconds"] / rb["tokens"]) / (ra["seconds"] / ra["tokens"]) for ra, rb in zip(rows[a], rows[b]))

    alpha = metrics.alpha_estimate(*sd_steps)
    summary = {
        "tokens_per_s": {n: tps(n) for n in rows},
        "ours_ar_over_hf_generate": paired("ours_ar", "hf_generate"),
        "ours_sd_speedup_over_ours_ar": paired("ours_sd", "ours_ar"),
        "hf_assisted_speedup_over_hf_generate": paired("hf_assisted", "hf_generate"),
        "ours_sd_over_hf_assisted": paired("ours_sd", "hf_assisted"),
        "alpha": alpha,
        "c": c,
        "gamma": gamma,
        "confidence": confidence,
        "hf_threshold_tuned_online": bool(confidence) and is_sklearn_available(),
        "packed_linear": bool(cfg.packed_linear) and pair.device.type == "cpu",
        "mean_accepted": metrics.ratio(sum(sd_steps[0]), len(sd_steps[0])),
        "analytic_speedup": metrics.analytic_speedup(alpha, gamma, c),
        "all_outputs_equal": all(r["matches_ours_ar"] for rs in rows.values() for r in rs),
        "prompts": len(xs),
        "max_new_tokens": max_new,
    }
    print(json.dumps(summary, indent=2))
    out = args.out / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, {"summary": summary, "rows": rows, "provenance": provenance(cfg, pair.device)})
    print(f"written: {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
