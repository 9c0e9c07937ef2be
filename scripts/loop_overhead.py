"""The decoding loop's own cost per token, apart from the model's forwards: methods decoding one prompt alone on a pair
whose forwards take about a millisecond (``pair=tiny``), the fastest of ``--repeats`` decodes (the minimum: what the
machine's noise cannot lower). Run from a tree's root, it measures that tree's loop, so two commits compare by
running it in each (docs/batching.md, "B = 1 against the loop before batching"):

    python scripts/loop_overhead.py                                  # this tree
    cd ../old-tree && PYTHONPATH=. python ../main/scripts/loop_overhead.py   # another commit's

Prints ``method=<ms>ms/token`` per method. Only the public interfaces every commit since the loop has had are used
(``bench.cli.compose``, ``bench.models.load_pair``, ``methods.registry.get_method``, ``Method.decode``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the tree it is run from, not the one this file sits in

import torch  # noqa: E402


def per_token_ms(method, ids: list[int], max_new: int, repeats: int) -> float:
    """The fastest of ``repeats`` greedy decodes of ``ids`` (after one untimed), in milliseconds per new token."""
    from decoding.sampling import Sampling

    x = torch.tensor([ids], device=method.pair.device)

    def once():
        gen = torch.Generator(device=method.pair.device).manual_seed(0)
        return method.decode(x, max_new, Sampling(0.0, 1.0), gen, lambda n: None)

    best = float("inf")
    with torch.inference_mode():
        once()
        for _ in range(repeats):
            start = time.perf_counter()
            out = once()
            best = min(best, (time.perf_counter() - start) / len(out.output_ids))
    return best * 1e3


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ar,pld", help="comma-separated registered methods")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*", default=["pair=tiny"], help="config overrides (default: pair=tiny)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from omegaconf import OmegaConf

    from bench.cli import compose
    from bench.data import builtin_prompts, encode
    from bench.models import load_pair
    from methods.registry import get_method

    pair = load_pair(compose(args.overrides))
    ids = encode(builtin_prompts(OmegaConf.create({}))[0], pair.tokenizer)
    out = {}
    for name in args.methods.split(","):
        method = get_method(name)(get_method(name).settings({}), pair)
        method.setup()
        out[name] = per_token_ms(method, ids, args.max_new, args.repeats)
    print(" ".join(f"{name}={ms:.3f}ms/token" for name, ms in out.items()))
    return out


if __name__ == "__main__":
    main()
