"""Prompt lookup decoding (LLMA, Yang et al. 2023, "Inference with Reference"; Saxena 2023, "prompt lookup
decoding"): no draft model. The last n-gram of prompt + output is looked up earlier in that same text and
the tokens that followed it there are proposed; the target scores them in one forward and the shared
verifier keeps the longest valid prefix. No match: a plain target step.

The drafter is deterministic, so for sampling its proposal distribution is one-hot (q(x) = 1 for the
proposed token), which the rejection rule handles exactly: token x stays with probability p(x), and a
rejection resamples from p with x removed. Lossless: greedy output equals ``ar``.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from core.metrics import ratio
from decoding.ngram import NGramIndex, ngram_sizes
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register


@register("pld")
class PLD(DraftVerify):
    lossless = True

    class Config(MethodSettings):
        max_ngram: int = Field(3, ge=1, description="longest n-gram of the text matched first ...")
        min_ngram: int = Field(1, ge=1, description="... down to this one")
        draft_len: int = Field(10, ge=1, description="tokens proposed per target call at most")

        @model_validator(mode="after")
        def sizes(self):
            return ngram_sizes(self)

    class State(PromptState):
        """One prompt's lookups: the n-gram index of its text, and how often a lookup found a continuation."""

        index: NGramIndex  # n-grams of the prompt and its output so far
        lookups: int  # steps that looked for a match
        hits: int  # of those, the ones that found one

    def start(self, state: State) -> None:
        state.index = NGramIndex(self.cfg.min_ngram, self.cfg.max_ngram)
        state.index.add_document(state.seq)
        state.lookups = state.hits = 0

    def propose(self, state: State) -> Proposal:
        state.index.extend(state.seq[len(state.index):])  # what was committed since the last step
        k = min(self.cfg.draft_len, state.draft_budget)
        found = state.index.continuations(state.seq, k) if k > 0 else []
        state.lookups += k > 0
        state.hits += bool(found)
        return Proposal.chain(state.seq[-1], found[0] if found else [])

    def extra(self, state: State) -> dict:
        proposed, accepted = sum(state.drafted), sum(a - 1 for a in state.accept_lengths)
        return {
            "lookups": state.lookups,  # steps that looked for a match (a draft was allowed)
            "hit_rate": ratio(state.hits, state.lookups),  # lookups that found a continuation
            "proposed": proposed,  # tokens proposed from the text
            "accepted": accepted,  # proposed tokens the target kept
            "accept_rate": ratio(accepted, proposed),
        }
