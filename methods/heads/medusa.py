"""Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads"): K independent heads on the target's last hidden state; head k's top-k fill depth k + 1 of a sparse
candidate tree, verified in one target forward (:mod:`methods.heads._tree_heads`).

Heads are trained by the harness (:mod:`methods.heads._heads`, ``python -m bench train method method=medusa``), or
the authors' published heads are read (``method.weights``, :mod:`methods.heads._published`).
"""

from __future__ import annotations

import torch

from decoding.tree import Tree
from methods.heads._tree_heads import PublishedHeadsSettings, TreeHeadsMethod
from methods.registry import register


@register("medusa")
class Medusa(TreeHeadsMethod):
    kind = "medusa"
    Config = PublishedHeadsSettings
    lossless = True  # greedy, and sampling verified exactly; typical acceptance when sampling is not

    def heads_input_shape(self) -> tuple[int, ...]:
        """The shape of what :meth:`heads_input` gives the heads per prompt: the target's hidden size."""
        return (self.pair.target.module.config.hidden_size,)

    def row_parts(self, batch: int) -> list[tuple]:
        return [(self.heads, {(self.heads_input_shape(),): batch})]  # one call a step: one row per prompt

    def fill(self, hidden, pending, shape: Tree):
        # (K, V'): one call runs every head on the same hidden state (in a batch, one call for every row)
        sub = (yield {"lm": self.heads, "args": (hidden.unsqueeze(0),)})[0]
        ranks = torch.tensor([p[-1] for p in shape.paths[1:]], device=sub.device)
        top = self.heads.module.vocab_map[sub[: shape.max_depth].topk(int(ranks.max()) + 1, dim=-1).indices]
        depth = torch.tensor(shape.depth[1:], device=sub.device)
        # Independent heads: a node's token depends only on its depth and its own rank, not on its parent.
        return shape.fill([pending, *top[depth - 1, ranks].tolist()])
