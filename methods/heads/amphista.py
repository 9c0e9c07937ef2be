"""Amphista (Li et al. 2025, "Amphista: Bi-directional Multi-head Decoding for Accelerating LLM Inference"):
Medusa's non-autoregressive heads, fed by staged adaptation layers over the target's features and letting the
heads attend to each other (the auto-embedding block; :mod:`methods.heads._amphista`).

Each step the adaptation layers read the positions the target committed since the last step (their hidden
states and the tokens after them; a KV cache each, roles ``adapt1``, ``adapt2``, ...), the auto-embedding block and the
heads run once at the last position (role ``heads``), and the heads' top-k fill Medusa's candidate tree, which
the target verifies in ONE forward (:mod:`methods.heads._tree_heads`): lossless as Medusa.

Trained by the harness from the teacher store like Medusa's heads, at Medusa's budget
(``python -m bench train method method=amphista``); ``baseline=medusa`` times the two prompt by prompt.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from core.static_cache import RowView
from core.swapped_embeddings import fed
from methods.heads._amphista import CountedAmphistaHeads, CountedStage
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

    def heads_input_shape(self) -> tuple[int, ...]:
        return (len(self.stages), self.pair.target.module.config.hidden_size)  # every stage's output

    def add_roles(self, heads, prefix) -> None:
        # A role per adaptation stage, each a causal LM of its own with a KV cache (a batch's: one forward per stage for
        # every row, docs/batching.md); the auto-embedding block and the heads, stacked across a batch's rows.
        self.stages = [self.pair.add(CountedStage(stage, f"adapt{s + 1}")) for s, stage in enumerate(heads.stages)]
        self.heads = self.pair.add(CountedAmphistaHeads(heads))

    def batch_parts(self) -> list:
        return list(self.stages)

    def new_memory(self, state):
        return [state.own_cache(stage) for stage in self.stages]  # in a batch, the prompt's row of each stage's

    def heads_input(self, hiddens: torch.Tensor, next_ids: list[int], memory):
        """``(S, hidden)``: every adaptation stage's output at the last committed position, each stage over the n new
        positions (stage s + 1 reads stage s's outputs at all of them). A generator of the stages' forwards: in a batch
        each is yielded as a causal LM's (``fc``'s output swapped in for token embeddings), the rows' run as one."""
        emb = self.embed(torch.tensor(next_ids, device=hiddens.device)).to(hiddens.dtype)
        f, last = hiddens, []
        for stage, cache in zip(self.stages, memory):
            if isinstance(cache, RowView):
                out = yield {"lm": stage, "cache": cache, **fed(stage.fused(f, emb))}
                f = stage.module.combine(f, out.logits[0])
            else:
                f = stage(f[None], emb[None], cache)[0]
            last.append(f[-1])
        return torch.stack(last)
