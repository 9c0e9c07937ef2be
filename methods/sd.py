"""Standard speculative decoding (Leviathan et al., 2023; Chen et al., 2023).

Each step the draft proposes ``gamma`` tokens autoregressively; the target scores the pending token and all
of them in ONE forward; :func:`decoding.verify.verify_chain` keeps the longest valid prefix and adds the
target's own next token. The draft's KV cache is rolled back with the target's (:class:`methods.base.PromptState`),
never recomputed. Lossless: greedy output equals ``ar``; sampled output is distributed as the target's.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from transformers import Cache

from core import metrics
from decoding.sampling import probs_from_logits, sample
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register


def draft_chain(draft, cache, pending: list[int], gamma: int, sampling, generator, device, confidence: float = 0.0):
    """Let ``draft`` propose up to ``gamma`` tokens after ``pending`` (the committed tokens it has not seen yet).

    A generator of the draft's forwards (``tokens, probs = yield from draft_chain(...)`` in a method's ``propose``;
    ``methods.base.DraftVerify.steps``), so that a batch runs each drafting step of every row as one forward.

    With ``confidence`` > 0 drafting stops early after a token the draft itself gives a probability below
    ``confidence`` (that token is still proposed), as transformers' ``assistant_confidence_threshold`` does:
    past an unsure token the draft's guesses are mostly rejected, so drafting them costs time for nothing.

    Returns ``(tokens, probs)``: ``LongTensor (k,)``, k <= gamma, and, when sampling, ``FloatTensor (k, vocab)``
    (the tempered / top-p distribution each token was drawn from; ``None`` when greedy).
    """
    x = torch.tensor([pending], device=device)
    tokens, probs = [], []
    for _ in range(gamma):
        out = yield {"lm": draft, "cache": cache, "input_ids": x, "logits_to_keep": 1}
        logits = out.logits[0, -1]
        if sampling.greedy:
            tok = logits.argmax(-1)
            q = torch.softmax(logits.float(), -1) if confidence > 0 else None
        else:
            q = probs_from_logits(logits, sampling)
            tok = sample(q, generator)
            probs.append(q)
        tokens.append(tok)
        if confidence > 0 and float(q[tok]) < confidence:
            break
        x = tok.view(1, 1)
    return torch.stack(tokens), (torch.stack(probs) if probs else None)


@register("sd")
class SD(DraftVerify):
    lossless = True
    drafts = 1
    batched_drafting = True  # a batch drafts every row's token in one draft forward

    class Config(MethodSettings):
        gamma: int = Field(4, ge=1, description="tokens drafted per target call")
        confidence: float = Field(0.0, ge=0, le=1, description="stop drafting after a token the draft gives "
                                  "probability < confidence (still proposed; transformers' "
                                  "assistant_confidence_threshold); 0 = always gamma tokens")
        adaptive: bool = Field(False, description="adapt gamma per step (Hugging Face's heuristic: +2 after a "
                               "full accept, -1 otherwise)")
        gamma_min: int = Field(1, ge=1, description="adaptive: the smallest gamma")
        gamma_max: int = Field(12, ge=1, description="adaptive: the largest gamma")

        @model_validator(mode="after")
        def gamma_range(self):
            if self.adaptive and not self.gamma_min <= self.gamma_max:
                raise ValueError(f"gamma_min ({self.gamma_min}) must not exceed gamma_max ({self.gamma_max}).")
            return self

    @classmethod
    def analytic_speedup(cls, alpha: float, gamma: float, c: float) -> float:
        """Leviathan et al. (2023), Theorem 3.8, with the measured alpha, mean gamma and cost ratio c."""
        return metrics.analytic_speedup(alpha, gamma, c)

    class State(PromptState):
        """One prompt's drafting: the draft's KV cache and the draft length of the next step."""

        dcache: Cache  # the draft's: a DynamicCache, or its compiled forwards' static one (compile=true)
        gamma: int

    def start(self, state: State):
        state.dcache = yield from state.draft_cache(self.pair.draft)  # the draft reads the prompt too: its cost, counted
        state.gamma = self.cfg.gamma

    def propose(self, state: State):
        k = min(state.gamma, state.draft_budget)
        if k <= 0:
            return Proposal.chain(state.seq[-1], [])
        pending = state.seq[state.dcache.get_seq_length():]
        tokens, q = yield from draft_chain(self.pair.draft, state.dcache, pending, k, state.sampling, state.generator,
                                           state.device, self.cfg.confidence)
        return Proposal.chain(state.seq[-1], tokens, q)

    def accepted(self, state: State, proposal: Proposal, path: list[int], hidden) -> None:
        if self.cfg.adaptive:
            # Hugging Face's heuristic schedule: lengthen after a full accept, shorten otherwise.
            full = len(path) - 1 == proposal.depth
            state.gamma = min(state.gamma + 2, self.cfg.gamma_max) if full else max(state.gamma - 1, self.cfg.gamma_min)
