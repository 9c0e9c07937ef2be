"""EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test") over EAGLE-2's dynamic draft tree (:mod:`methods.eagle.eagle`).

What differs from ``eagle`` is the draft (:mod:`methods.eagle._draft3`): it reads a fusion of the target's low,
middle and high features instead of its last hidden state, predicts tokens with a head of its own (no feature
regression), and is trained by unrolling its own drafting (training-time test). The decoding loop is EAGLE-2's,
inherited: each step the draft first reads the fused features of the positions committed since the last step
(their true values, from the verification forward), then drafts the tree (or chain) from its own outputs.

The three layers' features come from :class:`core.layer_taps.LayerTaps` on the target (forward pre-hooks on its
decoder layers; a compiled target's graphs return them), opened with the prompt's state (before the prefill, whose
features the draft reads first) and closed by the loop when the decode ends; the target's own forwards are unchanged
(the base loop's ``hidden`` flag returns only the last layer's).

Candidates are the draft's top-k (tree) or its greedy / sampled tokens (chain), so verification is the shared
lossless one: greedy output equals ``ar``, sampled output follows the target's distribution. The authors' tree on
a GPU (Spec-Bench: ``--total-token 60 --depth 5 --top-k 10``, i.e. ``total_tokens=60 depth=6 top_k=10`` here: their
loop adds five levels after the first) costs the target many one-token forwards on this CPU; the defaults are
EAGLE-2's small tree.
"""

from __future__ import annotations

import torch
from pydantic import Field

from core.layer_taps import LayerTaps
from methods.eagle._draft3 import (
    CountedEagle3,
    Eagle3Recipe,
    eagle3_artifact,
    feature_layers,
    untrained_eagle3,
)
from methods.eagle._published3 import load_published_eagle3
from methods.base import Proposal
from methods.eagle.eagle import Eagle, EagleSettings
from methods.registry import register
from training.kit import load_or_train, untrained_if_synthetic


class Eagle3Settings(EagleSettings):
    """EAGLE-3's settings (``method.*``): EAGLE-2's (tree, chain, static tree), its own draft's recipe."""

    total_tokens: int = Field(6, ge=2, description="tree: tokens the target scores per call, the pending one "
                              "included (Spec-Bench's EAGLE-3: 60 on a GPU)")
    depth: int = Field(4, ge=1, description="tree: the deepest draft token (Spec-Bench's EAGLE-3: 6, its "
                       "--depth 5 after the first level)")
    top_k: int = Field(4, ge=1, description="tree: nodes expanded per depth and children per node (Spec-Bench's "
                       "EAGLE-3: 10)")
    recipe: Eagle3Recipe = Field(default_factory=Eagle3Recipe, description="how the draft is trained")
    weights: str | None = Field(None, description="the authors' published EAGLE-3 draft: a hub id or a local folder "
                                "in their layout (docs/published.md); null: the draft this harness trains (recipe)")


@register("eagle3")
class Eagle3(Eagle):
    lossless = True
    hidden = False  # the draft reads three layers' inputs through its own hooks, not the last hidden state
    Config = Eagle3Settings

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.layers = feature_layers(pair.target.module.config.num_hidden_layers)

    def setup(self, train_if_missing: bool = True) -> None:
        target = self.pair.target.module
        if self.cfg.weights:
            draft, self.report = load_published_eagle3(self.cfg.weights, target, self.pair.cache)
        else:
            draft, self.report = untrained_if_synthetic(
                self.pair, lambda: untrained_eagle3(target.config, self.cfg.recipe),
                lambda: load_or_train(eagle3_artifact(target, self.pair.tokenizer, self.cfg.recipe, self.pair.teacher),
                                      self.pair.teacher.cache, train_if_missing))
        self.draft = self.pair.add(CountedEagle3(draft.to(device=self.pair.device, dtype=self.pair.dtype)))
        # A published draft narrower than its target carries its own token embedding; every other reads the target's.
        own = self.draft.module.embed_tokens
        self.embed = own if own is not None else target.get_input_embeddings()
        self.vocab_map = self.draft.module.vocab_map

    class State(Eagle.State):
        """EAGLE-2's state, and the taps that hold the target's three layers' inputs of its last forward."""

        taps: LayerTaps

        def __init__(self, method, *args, **kwargs):
            super().__init__(method, *args, **kwargs)
            # Opened before the prefill; the loop's ``closing`` closes them however the decode ends.
            self.taps = self.closing.enter_context(LayerTaps(method.pair.target, method.layers))

    def start(self, state: State) -> None:
        super().start(state)
        state.todo = state.taps.fused()[0]  # (prompt_len, 3H): the prefill's features

    def accepted(self, state: State, proposal: Proposal, path: list[int], hidden: torch.Tensor | None) -> None:
        if not state.done:  # the fused features of the root and the accepted nodes (the verify forward's rows)
            state.todo = torch.cat([state.todo, state.taps.fused()[0, path]])
