"""How fast the target labels data for the teacher store, and what batching its answers buys.

  python scripts/teacher_throughput.py [--prompts 16] [--batch 16] [--new-tokens 64] [--seqs 16] [hydra overrides]

Measured under the harness clock (device synchronised before every read) on the pair's target (default:
SmolLM2-135M-Instruct, fp32, unpacked as the trainers read it):

- ``answers``: the target's greedy answers to ``--prompts`` packaged instructions (``training.labelling.
  target_answers``, what the store's answer shards run) one prompt at a time and ``--batch`` at a time: new
  tokens per second, and the ratio.
- ``teacher_forced``: ``training.labelling.teacher_pass`` over ``--seqs`` rows of ``recipe.store.seq_len`` packaged
  tokens with the last hidden states kept (what the store's text shards run): tokens per second.

Prints one JSON object (with the settings and the machine's thread count).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cli import compose  # noqa: E402
from bench.models import load_pair, use_threads  # noqa: E402
from bench.runner import clocked  # noqa: E402
from bench.validate import validate_run  # noqa: E402
from core.corpus import corpus, instruction_prompts  # noqa: E402
from training.labelling import target_answers, teacher_pass, token_chunks  # noqa: E402


def answer_rate(pair, prompts: list[str], batch: int, new_tokens: int) -> dict:
    """New answer tokens per second when ``prompts`` are answered ``batch`` at a time."""
    run = lambda: list(target_answers(pair.target.module, pair.tokenizer, prompts, batch, new_tokens, f"batch {batch}"))  # noqa: E731
    answers, seconds = clocked(pair.device, run)
    tokens = sum(len(a) for _, a, _, _ in answers)
    return {"batch": batch, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seqs", type=int, default=16)
    args, overrides = p.parse_known_args(argv)
    cfg, checked = validate_run(compose([*overrides, "packed_linear=false", "train_if_missing=false"]))
    use_threads(cfg)
    pair = load_pair(cfg, 0, checked)
    prompts = instruction_prompts(args.prompts, int(cfg.recipe.store.seed))
    one, many = (answer_rate(pair, prompts, b, args.new_tokens) for b in (1, args.batch))
    seq_len = int(cfg.recipe.store.seq_len)
    chunks = token_chunks(pair.tokenizer, corpus(cfg.recipe.store.corpus, "train"), seq_len, args.seqs * seq_len).to(pair.device)
    _, seconds = clocked(pair.device, teacher_pass, pair.target.module, chunks, int(cfg.recipe.store.topk),
                         int(cfg.recipe.store.batch_size), "teacher-forced", True)
    result = {
        "pair": cfg.pair.name, "threads": torch.get_num_threads(), "device": str(pair.device),
        "answers": {"one_at_a_time": one, "batched": many,
                    "batched_over_one": round(many["tokens_per_s"] / one["tokens_per_s"], 2)},
        "teacher_forced": {"tokens": chunks.numel(), "seconds": round(seconds, 2),
                           "tokens_per_s": round(chunks.numel() / seconds, 1)},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
