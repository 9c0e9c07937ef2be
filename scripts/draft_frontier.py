"""Can a draft made from the target's own first k layers make speculative decoding pay on this machine?

  python scripts/draft_frontier.py [--prompts 32] [--held-out 8] [--depths 1,2,4,...] [--recipe full ...] [--out DIR]
      [hydra overrides]

Measured in one run, on the pair's target (default: SmolLM2-135M-Instruct, fp32):

- ``alpha(k)``: greedy agreement with the target, on held-out target answers, of a linear exit at layer k:
  a ridge-regression translator from the layer-k residual state to the target's final (normed) state,
  followed by the target's own output head ("tuned lens", Belrose et al. 2023). It needs no gradient
  training, so it is cheap enough to fit at every depth; a k-layer draft distilled for minutes lands in
  the same range (README: 0.21-0.29 at k = 4), so read it as what depth k knows, not as a bound.
  ``logit_lens``: the same without the translator (the target's norm and head on layer k directly).
- ``c(k)``: time of a one-token forward through the first k layers with a ``--draft-vocab``-token head
  (8,192: the shape of the harness's distilled draft, training/distill.py), over the target's one-token forward.
- ``r(T)``: time of a T-token target forward over a one-token one: verifying a draft is not free here.
- ``best_speedup(k)``: max over gamma of Leviathan et al.'s expected speedup with that verification cost,
  E[tokens](alpha, gamma) / (gamma c + r(gamma + 1)).

- ``--recipe R`` (repeatable; a recipe name, or a name and overrides: ``--recipe "full recipe.tokens=327680"``):
  the pair's cached distilled draft trained under R, scored on the same held-out positions and timed the same
  way, so a trained draft sits on the same frontier as the linear exits (not trained here: ``python -m bench
  train draft recipe=R`` first; a missing one is skipped with a message).

The fit uses the target's greedy answers to packaged instructions of the training split (the text greedy SD
actually sees) plus Lee news text, teacher-forced; ``--held-out`` answers to instructions of the held-out split
(articles no trainer reads) are only scored. Prints a table and writes <--out, default
results/draft_frontier>/<time>.json with provenance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cli import compose  # noqa: E402
from bench.models import load_pair, use_threads  # noqa: E402
from bench.results import provenance, write_json_atomic  # noqa: E402
from bench.runner import forward_seconds  # noqa: E402
from bench.validate import validate_run  # noqa: E402
from core import metrics  # noqa: E402
from core.corpus import corpus, instruction_prompts  # noqa: E402
from core.errors import BenchError  # noqa: E402
from training.distill import draft_from_target  # noqa: E402
from training.labelling import target_answers, token_chunks  # noqa: E402


@torch.no_grad()
def layer_states(target, ids: torch.Tensor, positions: torch.Tensor):
    """Residual states of every layer and the target's greedy token at ``positions`` of ``ids (1, T)``.

    Returns ``(states, top1)``: a list of ``n_layer + 1`` tensors ``(P, hidden)`` (embeddings first, the final
    normed state last) and ``LongTensor (P,)``.
    """
    out = target(ids, output_hidden_states=True)
    return [h[0, positions] for h in out.hidden_states], out.logits[0, positions].argmax(-1)


def answer_positions(answers):
    """``(ids (1, P + n), positions)`` per ``(prompt, answer)``: position P-1+t predicts answer token t, the
    positions greedy SD drafts for."""
    for prompt, answer in answers:
        ids = torch.cat([prompt, answer]).unsqueeze(0)
        yield ids, torch.arange(len(prompt) - 1, ids.shape[1] - 1)


def stacked_states(target, items):
    """:func:`layer_states` of every ``(ids, positions)`` item, stacked: ``(states, top1)`` as there."""
    parts = [layer_states(target, ids, positions) for ids, positions in items]
    return [torch.cat(layer) for layer in zip(*(s for s, _ in parts))], torch.cat([t for _, t in parts])


def exit_agreement(target, fit, held, k: int, ridge: float) -> tuple[float, float]:
    """``(tuned_lens, logit_lens)`` greedy agreement at layer k on the held-out positions."""
    (fit_states, _), (held_states, held_top1) = fit, held

    def with_bias(x):
        return torch.cat([x, torch.ones(len(x), 1)], 1).double()

    x = with_bias(fit_states[k])
    # Ridge regression to the final normed state; the penalty scales with the sample count.
    w = torch.linalg.solve(x.T @ x + ridge * len(x) * torch.eye(x.shape[1], dtype=x.dtype), x.T @ fit_states[-1].double())
    head = target.get_output_embeddings()
    tuned = head((with_bias(held_states[k]) @ w).float()).argmax(-1)
    lens = head(target.model.norm(held_states[k])).argmax(-1)
    return float((tuned == held_top1).float().mean()), float((lens == held_top1).float().mean())


def best_speedup(alpha: float, c: float, r: dict[int, float], max_gamma: int) -> tuple[int, float]:
    """``(gamma, speedup)`` maximising E[tokens](alpha, gamma) / (gamma c + r(gamma + 1)) over 1..max_gamma."""
    # E[tokens] / (gamma c + r(gamma + 1)) = analytic_speedup(alpha, gamma, c / r) / r
    speedups = {g: metrics.analytic_speedup(alpha, g, c / r[g + 1]) / r[g + 1] for g in range(1, max_gamma + 1)}
    gamma = max(speedups, key=speedups.get)
    return gamma, speedups[gamma]


@torch.no_grad()
def trained_draft_row(recipe: str, overrides: list[str], held_answers, held_top1, context, target_ms, r, args):
    """The frontier's row for the pair's first draft as ``recipe`` trained it (read from the cache, never trained
    here: None when it is missing)."""
    name, *more = recipe.split()
    try:
        cfg, checked = validate_run(compose([*overrides, f"recipe={name}", *more, "train_if_missing=false"]))
        use_threads(cfg)
        pair = load_pair(cfg, 1, checked)
    except BenchError as err:
        print(f"recipe {recipe!r}: skipped ({err})", flush=True)
        return None
    if not pair.drafts:
        print(f"recipe {recipe!r}: skipped (pair={cfg.pair.name} has no draft)", flush=True)
        return None
    draft = pair.draft.module.eval()
    top1 = torch.cat([draft(ids.to(pair.device)).logits[0, positions].argmax(-1).cpu()
                      for ids, positions in answer_positions(held_answers)])
    alpha = float((top1 == held_top1).float().mean())
    c = 1e3 * forward_seconds(pair.device, draft, context, 1, args.repeats) / target_ms[1]
    gamma, speedup = best_speedup(alpha, c, r, args.max_gamma)
    # The recipe's label (``full~<hash>`` when recipe.* is overridden) and any other override, e.g. the draft's own.
    settings = [f"recipe={pair.teacher.recipe.label}", *(m for m in more if not m.startswith("recipe."))]
    label = f"{cfg.pair.name} draft ({', '.join(settings)})"
    print(f"{label}: alpha {alpha:.3f}  c {c:.3f}  best {speedup:.2f}x at gamma={gamma}", flush=True)
    return {"k": label, "alpha_tuned_lens": alpha, "alpha_logit_lens": None, "c": c,
            "best_gamma": gamma, "best_speedup": speedup}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32, help="instructions the target answers (fit + held out)")
    ap.add_argument("--held-out", type=int, default=8, help="of which are only scored")
    ap.add_argument("--news-tokens", type=int, default=8192, help="Lee news tokens added to the fit")
    ap.add_argument("--depths", default="1,2,3,4,6,8,10,12,15,18,21,24,27")
    ap.add_argument("--max-gamma", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--ridge", type=float, default=1e-2)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="output rows of the timed draft's head")
    ap.add_argument("--recipe", action="append", default=[], help="also score the pair's distilled draft trained "
                    "under this recipe (repeatable; a name, or a name and recipe.* overrides)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "draft_frontier")
    args, overrides = ap.parse_known_args(argv)
    if not 0 < args.held_out < args.prompts:
        sys.exit(f"error: --held-out ({args.held_out}) must be at least 1 and below --prompts ({args.prompts}).")
    # Validated: defaults filled in (max_new_tokens: the dataset's); the target alone, as ar runs it.
    cfg, checked = validate_run(compose(["method=ar", "pair.drafts=[]", *overrides]))
    use_threads(cfg)
    pair = load_pair(cfg, checked=checked)
    target, device = pair.target.module.eval(), pair.device
    depths = [int(k) for k in args.depths.split(",")]

    # Fitted on the training split's instructions, scored on the held-out split's: a trained draft never read them.
    fitted = instruction_prompts(args.prompts - args.held_out, int(cfg.seed), "train")
    prompts = [*fitted, *instruction_prompts(args.held_out, int(cfg.seed), "test")]
    answers = [(p.cpu(), a.cpu()) for p, a, _, _ in target_answers(target, pair.tokenizer, prompts, 16,
                                                                   int(cfg.max_new_tokens), "frontier: target answers")]
    fit_answers, held_answers = answers[: len(fitted)], answers[len(fitted) :]
    news = token_chunks(pair.tokenizer, corpus("lee", "train"), 256, args.news_tokens)
    news_rows = ((row.unsqueeze(0), torch.arange(row.numel())) for row in news)
    fit = stacked_states(target, [*answer_positions(fit_answers), *news_rows])
    held = stacked_states(target, answer_positions(held_answers))

    context = torch.cat(held_answers[0]).unsqueeze(0).to(device)
    target_ms = {t: 1e3 * forward_seconds(device, target, context, t, args.repeats) for t in range(1, args.max_gamma + 2)}
    r = {t: ms / target_ms[1] for t, ms in target_ms.items()}  # verification cost of t tokens, in one-token forwards
    vocab = torch.arange(min(args.draft_vocab, target.config.vocab_size))
    rows = []
    for k in depths:
        tuned, lens = exit_agreement(target, fit, held, k, args.ridge)
        draft = draft_from_target(target, list(range(k)), vocab).to(device).eval()
        c = 1e3 * forward_seconds(device, draft, context, 1, args.repeats) / target_ms[1]
        gamma, speedup = best_speedup(tuned, c, r, args.max_gamma)
        rows.append({"k": k, "alpha_tuned_lens": tuned, "alpha_logit_lens": lens, "c": c,
                     "best_gamma": gamma, "best_speedup": speedup})
        print(f"k={k:2d}: alpha {tuned:.3f} (logit lens {lens:.3f})  c {c:.3f}  best {speedup:.2f}x at gamma={gamma}",
              flush=True)
    for recipe in args.recipe:
        row = trained_draft_row(recipe, overrides, held_answers, held[1], context, target_ms, r, args)
        rows += [row] if row else []

    print(f"\ntarget one-token forward {target_ms[1]:.1f} ms; r(T) = " + ", ".join(f"{t}: {v:.2f}" for t, v in r.items()))
    print(f"fit positions {len(fit[1])}, held-out answer positions {len(held[1])}\n")
    print(tabulate(rows, headers="keys", floatfmt=".3f"))
    out = args.out / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"target_ms": target_ms, "r": r, "rows": rows, "fit_positions": len(fit[1]),
               "heldout_positions": len(held[1]), "args": vars(args)}
    write_json_atomic(out, {"summary": summary, "provenance": provenance(cfg, device)})
    print(json.dumps({"written": str(out)}))


if __name__ == "__main__":
    main(sys.argv[1:])
