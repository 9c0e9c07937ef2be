"""Where the distilled draft agrees with the target: on the target's own answers, counted on answer tokens only.

  python scripts/answer_agreement.py [--prompts 16] [overrides, e.g. recipe=full recipe.store.instructions=mixed]

Greedy speculative decoding drafts only after the target's own greedy text, so what predicts its acceptance α is
the draft's top-1 agreement with the target on answer tokens. The training reports' ``answer_agreement`` is
taken on the held-out store's answer rows, which hold the end of the prompt too (where the draft is compared with
the target's prediction, not with text the target wrote). This script generates the target's greedy answers
(128 tokens, the chat template) to three sets of prompts and teacher-forces the pair's first draft over them:

- the default prompts (``dataset=default``: conversation, translation, summaries, QA, maths, RAG), the text α is
  measured on;
- held-out instructions on packaged text (``recipe.store.instructions=news+wiki``, test split: the store's own
  held-out answers);
- held-out instructions of the other kinds (``mixed``, test split, those not on packaged text: advice,
  explanations, word problems).

For each: agreement on answer tokens only, and on the store's row view (the last ``seq_len`` tokens of prompt
and answer, each position compared with the next token). The draft is the cached one (``train_if_missing`` off).
Writes <--out, default results/answer_agreement>/<time>.json with provenance.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cli import compose  # noqa: E402
from bench.data import builtin_prompts  # noqa: E402
from bench.models import load_pair, use_threads  # noqa: E402
from bench.results import provenance, write_json_atomic  # noqa: E402
from bench.validate import validate_run  # noqa: E402
from core.corpus import instruction_prompts  # noqa: E402
from core.errors import BenchError  # noqa: E402
from training import kit  # noqa: E402
from training.labelling import target_answers  # noqa: E402


def prompt_sets(n: int) -> dict[str, list[str]]:
    packaged = instruction_prompts(10**4, 0, "test")
    return {
        "default prompts": [p.turns[0] for p in builtin_prompts({})],
        "held-out, packaged text": packaged[:n],
        "held-out, other kinds": [p for p in instruction_prompts(10**4, 0, "test", "mixed") if p not in set(packaged)][:n],
    }


@torch.inference_mode()
def agreement(draft, rows, row_len: int) -> dict:
    """Top-1 agreement of ``draft`` (a ``DraftLM`` or any causal LM) with the next token over ``rows`` of
    ``(prompt_ids, answer_ids)``: on answer tokens only, and on the last ``row_len`` tokens of each sequence
    (:func:`training.kit.agreement`, one row at a time: rows differ in length)."""
    device = next(draft.parameters()).device

    def judge(index: torch.Tensor) -> list[tuple]:
        prompt, answer = rows[int(index[0])]
        seq = torch.cat([prompt, answer]).to(device)
        hit = draft(seq[None, :-1]).logits[0].argmax(-1) == seq[1:]  # a DraftLM's logits are -inf outside its vocabulary
        last_row, on_answer = torch.zeros_like(hit), torch.zeros_like(hit)
        last_row[-(row_len - 1):] = True
        on_answer[len(prompt) - 1:] = True
        return [(hit[None], last_row[None], on_answer[None])]

    figures = kit.agreement(judge, range(len(rows)), 1)
    return {"answer_agreement": figures["answer_tokens"][0], "row_agreement": figures["all"][0],
            "answer_tokens": sum(len(answer) for _, answer in rows)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="held-out instructions per set")
    parser.add_argument("--out", default="results/answer_agreement")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg, checked = validate_run(compose([*overrides, "train_if_missing=false"]))
        use_threads(cfg)
        pair = load_pair(cfg, 1, checked)
        draft = pair.draft.module  # one sentence for a pair without a draft
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    target = pair.target.module
    table = []
    for name, prompts in prompt_sets(args.prompts).items():
        answers = target_answers(target, pair.tokenizer, prompts, 16, 128, f"target answers: {name}")
        rows = [(prompt, answer) for prompt, answer, _, _ in answers]
        table.append({"prompts": name, "n": len(rows), **agreement(draft, rows, int(cfg.recipe.store.seq_len))})
    print(tabulate(table, headers="keys", tablefmt="github"))
    out = Path(args.out) / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, {"rows": table, "provenance": provenance(cfg, pair.device)})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
