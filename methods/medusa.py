"""Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads"): K independent heads on the target's last hidden state; head k's top-k fill depth k + 1 of a sparse
candidate tree, verified in one target forward (:mod:`methods._tree_heads`, :mod:`decoding.tree`).

Heads are trained by the harness (:mod:`methods._heads`, ``python -m bench train heads method=medusa``).
"""

from __future__ import annotations

import torch

from bench.registry import register
from decoding.tree import Tree
from methods._tree_heads import TreeHeadsMethod


@register("medusa")
class Medusa(TreeHeadsMethod):
    kind = "medusa"
    lossless = True  # greedy; an instance with typical: true sets it False

    def propose(self, hidden, pending, tree: Tree) -> torch.Tensor:
        sub = self.heads(hidden.unsqueeze(0))[0]  # (K, V'): one call runs every head on the same hidden state
        width = 1 + max(p[-1] for p in tree.paths[1:])
        top = self.heads.module.vocab_map[sub[: tree.max_depth].topk(width, dim=-1).indices]  # (depth, width)
        depth = tree.depth[1:].to(top.device)
        rank = torch.tensor([p[-1] for p in tree.paths[1:]], device=top.device)
        # Independent heads: a node's token depends only on its depth and its own rank, not on its parent.
        return torch.cat([torch.tensor([pending], device=top.device), top[depth - 1, rank]])
