"""A verifier whose acceptance rate is set, not learned: what a synthetic pair (``pair.acceptance``) decodes with.

vLLM times speculation at real model sizes without real drafters the same way (its synthetic rejection mode):
every forward, every drafted token and every host step of a method is real, and only the target's choice at
each verified node is decided by a coin of probability ``rate``. Here the coin rewrites the target's logits in
:func:`decoding.tree.score_tree`, the one forward every method verifies with, so every verifier (a chain's, a
tree's, SpecHub's, a lossy method's) sees a target that agrees with a drafted token with that probability:

- at each node with children, the children are tried in the order drafted and each is the target's choice with
  probability ``rate`` (a tree of width k keeps a token with probability 1 - (1 - rate)^k, as independent drafts
  would); the first one chosen gets a logit :data:`SPREAD` above the row's largest, so it takes all the
  probability mass;
- when none is chosen, the drafted tokens get logits :data:`SPREAD` below the row's smallest (no mass), so the
  target's choice is its own best other token; rows without children (the bonus position, side rows) are left as
  the model computed them.

Greedy decoding only: the coin decides the argmax (a synthetic run with temperature > 0 is refused before it
loads). Position by position, a chain's accepted length is then geometric, as Leviathan et al.'s formula assumes.
"""

from __future__ import annotations

import random

import torch

from decoding.tree import Tree

# How far above (below) every other logit of its row a chosen (refused) token's logit is set: far enough that
# softmax gives it all the mass (none) in any dtype, yet finite, so a method that tempers the logits stays finite
# (the dtype's largest value over NEST's temperature 0.7 is inf, and a softmax over inf is NaN).
SPREAD = 1e4


class SetAcceptance:
    """The coin of a synthetic target: ``rate`` in [0, 1], drawn from its own generator seeded with ``seed``
    (runs with the same seed draw the same coins in the same order)."""

    def __init__(self, rate: float, seed: int = 0):
        self.rate = float(rate)
        self.rng = random.Random(seed)

    def rewrite(self, tree: Tree, logits: torch.Tensor) -> torch.Tensor:
        """``logits (r, vocab)``: the rows of the tree's last r nodes (r = ``len(tree)`` unless the forward kept
        fewer), row i scoring the token after node ``len(tree) - r + i``. Returns them with each node's choice
        decided by the coin (a copy; the input is not changed)."""
        first = len(tree) - logits.shape[0]
        out = logits.clone()
        for v in range(max(first, 0), len(tree)):
            kids = tree.children[v]
            if not kids:
                continue
            row = out[v - first]
            chosen = next((c for c in kids if self.rng.random() < self.rate), None)
            if chosen is None:
                row[[tree.tokens[c] for c in kids]] = row.min() - SPREAD
            else:
                row[tree.tokens[chosen]] = row.max() + SPREAD
        return out
