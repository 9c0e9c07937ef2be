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
from methods.base import Draft, DraftVerify, MethodSettings, PromptState
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

    def start(self, state: PromptState) -> None:
        self.index = NGramIndex(int(self.cfg.min_ngram), int(self.cfg.max_ngram))
        self.index.add_document(state.seq)
        self.lookups = self.hits = 0

    def propose(self, state: PromptState) -> Draft:
        self.index.extend(state.seq[len(self.index):])  # what was committed since the last step
        k = min(int(self.cfg.draft_len), state.draft_budget)
        found = self.index.continuations(state.seq, k) if k > 0 else []
        self.lookups += k > 0
        self.hits += bool(found)
        return Draft.chain(state.seq[-1], found[0] if found else [])

    def extra(self, state: PromptState) -> dict:
        proposed, accepted = sum(state.drafted), sum(a - 1 for a in state.accept_lengths)
        return {
            "lookups": self.lookups,  # steps that looked for a match (a draft was allowed)
            "hit_rate": ratio(self.hits, self.lookups),  # lookups that found a continuation
            "proposed": proposed,  # tokens proposed from the text
            "accepted": accepted,  # proposed tokens the target kept
            "accept_rate": ratio(accepted, proposed),
        }
