"""Amphista (Li et al. 2025, "Amphista: Bi-directional Multi-head Decoding for Accelerating LLM Inference"):
Medusa's non-autoregressive heads, fed by staged adaptation layers over the target's features and letting the
heads attend to each other (the auto-embedding block; :mod:`methods.heads._amphista`).

Each step the adaptation layers read the positions the target committed since the last step (their hidden
states and the tokens after them; a KV cache of their own, role ``adapt``), the auto-embedding block and the
heads run once at the last position (role ``heads``), and the heads' top-k fill Medusa's candidate tree, which
the target verifies in ONE forward (:mod:`methods.heads._tree_heads`): lossless as Medusa.

Trained by the harness from the teacher store like Medusa's heads, at Medusa's budget
(``python -m bench train method method=amphista``); ``baseline=medusa`` times the two prompt by prompt.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from transformers import DynamicCache

from methods.heads._amphista import CountedAdapt, CountedAmphistaHeads
from methods.heads._heads import HeadsRecipe
from methods.heads._tree_heads import TreeHeadsSettings
from methods.heads.medusa import Medusa
from methods.registry import register


class AmphistaRecipe(HeadsRecipe):
    """How Amphista's adaptation layers, auto-embedding block and heads are trained (jointly, Medusa's loss)."""

    stages: int = Field(2, ge=1, description="staged adaptation layers (the paper: 2); head k reads stage "
                        "ceil((k + 1) * stages / num_heads)")


class AmphistaSettings(TreeHeadsSettings):
    """Amphista's settings (``method.*``): Medusa's tree and verification, Amphista's recipe."""

    recipe: AmphistaRecipe = Field(default_factory=AmphistaRecipe, description="how the heads are trained")

    @model_validator(mode="after")
    def no_prefix_layer(self):
        if self.recipe.prefix_layer:
            raise ValueError("recipe.prefix_layer is Hydra++'s; Amphista's staged adaptation layers take its place.")
        if self.recipe.stages > self.recipe.num_heads:
            raise ValueError(f"recipe.stages ({self.recipe.stages}) must not exceed recipe.num_heads "
                             f"({self.recipe.num_heads}): each stage feeds at least one head.")
        return self


@register("amphista")
class Amphista(Medusa):
    kind = "amphista"
    Config = AmphistaSettings
    # A batch stacks every row's heads call into one, but runs the adaptation layers row after row, each row with
    # caches of its own (docs/batching.md).
    batched_drafting = False

    def add_roles(self, heads, prefix) -> None:
        self.adapt = self.pair.add(CountedAdapt(heads))
        self.heads = self.pair.add(CountedAmphistaHeads(heads))

    def new_memory(self, state):
        return [DynamicCache() for _ in self.adapt.module]  # one KV cache per adaptation layer

    def heads_input(self, hiddens: torch.Tensor, next_ids: list[int], memory) -> torch.Tensor:
        """``(S, hidden)``: every adaptation layer's output at the last committed position."""
        emb = self.embed(torch.tensor(next_ids, device=hiddens.device)).to(hiddens.dtype)
        return self.adapt(hiddens.unsqueeze(0), emb.unsqueeze(0), memory)[0, -1]
