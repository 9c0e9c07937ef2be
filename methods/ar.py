"""Plain autoregressive decoding with a KV cache: one target forward per new token (the baseline).

It is the draft-and-verify loop with nothing drafted: each step scores the pending token alone and the
target's own choice (argmax, or a sample) is committed.
"""

from __future__ import annotations

from decoding.tree import Tree
from methods.base import DraftVerify, PromptState, Proposal
from methods.registry import register


@register("ar")
class AR(DraftVerify):
    lossless = True

    def propose(self, state: PromptState) -> Proposal:
        return Proposal(Tree(state.seq[-1]))
