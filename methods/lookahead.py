"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding"): no draft model and no training. Each step's ONE target forward reads two branches beside the pending
token:

- the **lookahead branch**, a 2D Jacobi window of ``level - 1`` levels by ``window`` columns. Level ``l`` holds a
  guess of the tokens at offsets ``l .. l + window - 1`` after the pending token (level 0 one fewer, from offset
  1), each level one Jacobi iteration later than the one below it. A token at level ``l``, column ``i`` attends
  to the pending token, level 0's first ``i`` tokens and column ``i`` of levels 1 .. l: the diagonal of the
  window, a sequence of consecutive positions. The top level's predictions form the next level; each column's
  diagonal, read with its new token, is an n-gram of ``level`` tokens that goes into the pool. The window's KV
  entries are dropped after the forward (``decoding.tree.SideRows``).
- the **verification branch**: the n-grams in the pool that start with the pending token (at most ``guess`` per
  key, the most recent kept), merged into a token tree and verified by the shared tree verifier: greedy keeps
  the longest match; sampling is the paper's rule for several deterministic drafts (each tried in turn with
  probability p(token), the residual renormalised after each rejection), which is the tree verifier's recursive
  rejection with one-hot q: lossless.

As the authors' code (hao-ai-lab/LookaheadDecoding, as Spec-Bench vendors it): level 0 starts as ``window +
level - 3`` tokens drawn from the prompt (``random.seed(10)``), the first ``level - 2`` steps fill the levels
(and find the pool empty, unless it holds the prompt's n-grams), the window advances one column per step whatever
was accepted, the window's new level is the argmax (when sampling too), and the pool keeps ``guess`` n-grams per
key, least recently seen dropped. Their optional ``POOL_FROM_PROMPT`` (the prompt's n-grams, then each committed
token's) is ``pool_from_prompt``.
Differences, said on docs/methods/lookahead.md: shared prefixes are scored once (a trie), a fully matched
n-gram also gains the target's token after it (their loop drops it), and the prompt's n-grams are verified from
the first step (theirs wait for the window to fill).
"""

from __future__ import annotations

import random
from functools import lru_cache

import torch
from pydantic import Field

from decoding.tree import SideRows, Tree
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register

WINDOW_SEED = 10  # the authors' random.seed(10) before drawing the first level from the prompt


@register("lookahead")
class Lookahead(DraftVerify):
    lossless = True
    label_settings = ("level", "window", "guess")  # a row always says which (N, W, G) ran

    class Config(MethodSettings):
        # The CPU defaults (N 4, W 2, G 2, the prompt's n-grams) were measured best of eight on a 2-core CPU
        # (docs/methods/lookahead.md), where every token the forward reads costs.
        level: int = Field(4, ge=3, description="N: the n-grams' length; the window has N - 1 levels and a "
                           "verified n-gram proposes N - 1 tokens (Spec-Bench: 5)")
        window: int = Field(2, ge=1, description="W: the Jacobi window's columns, n-grams gathered per step "
                            "(Spec-Bench: 7)")
        guess: int = Field(2, ge=1, description="G: n-grams kept per first token and verified per step "
                           "(Spec-Bench: 7)")
        pool_from_prompt: bool = Field(True, description="the prompt's n-grams and then each committed token's "
                                       "join the pool (the authors' POOL_FROM_PROMPT; Spec-Bench's run: false)")

    class State(PromptState):
        """One prompt's window, pool and per-call tallies."""

        levels: list[list[int]]  # the Jacobi window, level 0 first: level 0 one token shorter than the others
        pool: dict[int, list[tuple[int, ...]]]  # first token -> up to `guess` continuations of level - 1 tokens
        next_end: int  # pool_from_prompt: the next n-gram to pool is seq[next_end - level: next_end]
        guesses: list[int]  # n-grams verified at each call
        rows: list[int]  # tokens the target read at each call (tree and window)

    def start(self, state: State) -> None:
        n, w = self.cfg.level, self.cfg.window
        rng = random.Random(WINDOW_SEED)
        state.levels = [[rng.choice(state.seq) for _ in range(w + n - 3)]]
        state.pool, state.guesses, state.rows = {}, [], []
        state.next_end = self.cfg.level
        if self.cfg.pool_from_prompt:
            self.pool_committed(state)

    def propose(self, state: State) -> Proposal:
        root, n = state.seq[-1], self.cfg.level
        tree = Tree(root)
        depth = min(state.draft_budget, n - 1)
        grams = state.pool.get(root, []) if depth > 0 else []
        for gram in grams:  # shared prefixes become one node
            tree.add(gram[:depth])
        side = window_rows(state.levels)
        state.guesses.append(len(grams))
        state.rows.append(len(tree) + len(side.tokens))
        return Proposal(tree, side=side)

    def side_scored(self, state: State, proposal: Proposal, logits: torch.Tensor) -> None:
        """The window's next level from its top level's logits; a full window gives each column's n-gram to the
        pool and drops its oldest level, as the authors' code does (one column per step, whatever is accepted)."""
        new, levels = logits.argmax(-1).tolist(), state.levels
        if len(levels) == 1:  # the first step: level 0's own predictions become level 1
            state.levels = [levels[0][1:], new]
        elif len(levels) < self.cfg.level - 1:  # filling: every level loses its first column
            state.levels = [level[1:] for level in levels] + [new[1:]]
        else:
            keys = [proposal.tree.tokens[0]] + levels[0]  # the token before each column's diagonal
            for i, key in enumerate(keys):
                remember(state.pool, key, tuple(level[i] for level in levels[1:]) + (new[i],), self.cfg.guess)
            state.levels = [levels[1][1:]] + levels[2:] + [new]

    def accepted(self, state: State, proposal: Proposal, path: list[int], hidden: torch.Tensor | None) -> None:
        if self.cfg.pool_from_prompt:
            self.pool_committed(state)

    def pool_committed(self, state: State) -> None:
        """Give the pool the n-gram ending at each token of the text not yet pooled: the prompt's at the start,
        then each step's committed tokens."""
        n = self.cfg.level
        for end in range(state.next_end, len(state.seq) + 1):
            gram = state.seq[end - n: end]
            remember(state.pool, gram[0], tuple(gram[1:]), self.cfg.guess)
        state.next_end = max(state.next_end, len(state.seq) + 1)

    def extra(self, state: State) -> dict:
        calls = len(state.rows) or float("nan")
        return {
            "guesses_per_call": sum(state.guesses) / calls,  # n-grams verified per target call
            "tokens_per_call": sum(state.rows) / calls,  # tokens the target read per call: tree and window
            "pool_ngrams": sum(len(grams) for grams in state.pool.values()),
        }


def remember(pool: dict[int, list[tuple[int, ...]]], key: int, gram: tuple[int, ...], size: int) -> None:
    """Put ``gram`` last in ``pool[key]`` (moved there when present), dropping the first (least recently seen)
    when the key already holds ``size``."""
    grams = pool.setdefault(key, [])
    if gram in grams:
        grams.remove(gram)
    elif len(grams) == size:
        del grams[0]
    grams.append(gram)


def window_rows(levels: list[list[int]]) -> SideRows:
    """The window as side rows of the step's forward: level 0 (``m - 1`` tokens at offsets 1 ..) then levels 1 ..
    (``m`` tokens each, column i of level l at offset l + i); the top level's logits are kept."""
    shape = window_shape(len(levels[0]) + 1, len(levels) - 1)
    return SideRows([t for level in levels for t in level], *shape)


@lru_cache(maxsize=64)
def window_shape(m: int, top: int) -> tuple[list[int], torch.Tensor, list[int]]:
    """``(offsets, allowed, keep)`` of a window whose level 0 has ``m - 1`` tokens and levels 1 .. ``top`` have
    ``m`` each: each token attends to level 0 up to its column (level 0 causally) and to its own column of levels
    1 .. its own, so it reads its diagonal as a plain sequence. Rows in level order."""
    first = m - 1
    size = first + top * m
    offsets = list(range(1, m)) + [level + i for level in range(1, top + 1) for i in range(m)]
    allowed = torch.zeros(size, size, dtype=torch.bool, device="cpu")  # host-side, like a tree's ancestry
    allowed[:first, :first] = torch.ones(first, first, dtype=torch.bool, device="cpu").tril()
    for level in range(1, top + 1):
        for i in range(m):
            row = first + (level - 1) * m + i
            allowed[row, :i] = True
            allowed[row, [first + (lower - 1) * m + i for lower in range(1, level + 1)]] = True
    keep = list(range(first)) if top == 0 else list(range(size - m, size))
    return offsets, allowed, keep
