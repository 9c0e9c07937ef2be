"""Hydra (Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding"): head k also
reads the input embeddings of the tokens already chosen along the candidate path, so the tree is filled
depth by depth, each head run once per parent node; verified in one target forward like Medusa
(:mod:`methods.heads._tree_heads`).

Hydra++ (``method=hydra_pp``): deeper heads (four residual MLP blocks each), trained with the teacher-distillation
loss (the target's whole distribution instead of its greedy token) and reading the output of the prefix attention layer
(``recipe.prefix_layer``: one more decoder layer over the target's hidden states of the whole sequence,
trained jointly with the heads; :class:`methods.heads._heads.PrefixLayer`, fed by
:meth:`methods.heads._tree_heads.TreeHeadsMethod.heads_input`).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from pydantic import Field

from decoding.tree import Tree
from methods.heads._heads import HeadsRecipe
from methods.heads._tree_heads import PublishedHeadsSettings, TreeHeadsMethod
from methods.registry import register


@lru_cache(maxsize=64)
def expansion_plan(tree: Tree) -> list[tuple[list[int], torch.Tensor, list[int], list[tuple[int, int]]]]:
    """Per depth d = 1 .. depth: ``(parents, parent_paths (P, d), nodes, [(parent row, rank) per node])``;
    ``parent_paths`` holds the node indices from the root to each parent (whose tokens head d-1 reads)."""
    plan = []
    for d in range(1, tree.max_depth + 1):
        nodes = [i for i, p in enumerate(tree.paths) if len(p) == d]
        parents = sorted({tree.parent[i] for i in nodes})
        paths = torch.tensor([tree.path_to(p) for p in parents], device="cpu")  # cached: moved per call
        plan.append((parents, paths, nodes, [(parents.index(tree.parent[i]), tree.paths[i][-1]) for i in nodes]))
    return plan


@register("hydra")
class Hydra(TreeHeadsMethod):
    kind = "hydra"
    Config = PublishedHeadsSettings
    lossless = True  # greedy, and sampling verified exactly; typical acceptance when sampling is not

    def row_parts(self, batch: int) -> list[tuple]:
        # Head d - 1 reads h and the d tokens to each parent at depth d, one row per parent (of every prompt).
        width = self.pair.target.module.config.hidden_size
        return [(self.heads, {((width,), (d, width)): batch * len(parents)
                              for d, (parents, *_) in enumerate(expansion_plan(self.shape), start=1)})]

    def fill(self, hidden, pending, shape: Tree):
        tokens = torch.full((len(shape),), pending, dtype=torch.long, device=hidden.device)
        vocab_map = self.heads.module.vocab_map
        for parents, paths, nodes, slots in expansion_plan(shape):
            # Head d-1 reads h and the d tokens from the root to each parent: one call per depth (in a batch, one for
            # every row at that depth).
            emb = self.embed(tokens[paths.to(hidden.device)]).to(hidden.dtype)  # (P, d, hidden)
            sub = yield {"lm": self.heads, "args": (hidden.expand(len(parents), -1), emb)}  # (P, V')
            width = 1 + max(rank for _, rank in slots)
            top = vocab_map[sub.topk(width, dim=-1).indices]  # (P, width)
            rows = torch.tensor(slots, device=hidden.device)
            tokens[torch.tensor(nodes, device=hidden.device)] = top[rows[:, 0], rows[:, 1]]
        return shape.fill(tokens.tolist())


@register("hydra_pp")
class HydraPP(Hydra):
    """Hydra++: Hydra's heads and decoding; its recipe adds the teacher loss and the prefix layer, which the
    shared loop runs when the recipe has one."""

    class Config(PublishedHeadsSettings):
        recipe: HeadsRecipe = Field(default_factory=lambda: HeadsRecipe(loss="teacher", prefix_layer=True, layers=4),
                                    description="how the heads are trained (Hydra++: four blocks per head, the "
                                    "teacher loss and the prefix layer)")
