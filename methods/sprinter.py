"""SPRINTER (Zhong, Teku and Tandon, 2025, "Speeding up Speculative Decoding via Approximate Verification").

The draft generates one token at a time. After each token a small learned verifier, reading the draft's
last hidden state (and its top probability and entropy), predicts whether the target would accept it.
While it predicts acceptance the draft keeps going, up to ``max_run`` tokens, and the target is not
called. When the verifier flags a token (or the run reaches ``max_run``, or the draft proposes EOS) the
target is called ONCE over the pending tokens, and the standard rule (:func:`decoding.verify.verify_chain`)
is applied to that last token only: it is kept and the target adds a bonus token, or it is replaced by
the target's own (resampled) token. The earlier tokens of the run stand without a target check.

LOSSY: tokens the verifier lets through are never checked, so greedy output may differ from ``ar``;
``bench/quality.py`` measures by how much. With ``threshold: 1`` every token is flagged (a score never
exceeds 1) and the method is exactly SD with gamma = 1 (a test checks it); with ``threshold: 0`` nothing is
flagged (short of a score of exactly 0) and the target checks only every ``max_run``-th token.

The verifier (the paper's linear layer + sigmoid by default, an MLP with ``verifier.width > 0``) is trained once
per (target, draft, recipe, training recipe) from the teacher store and cached under ``cache_dir/verifiers/``
(:mod:`methods._sprinter_verifier`): the draft's own token at each stored position is the candidate, and the
label says whether the target would accept it.
"""

from __future__ import annotations

from collections import Counter

import torch
from pydantic import Field
from transformers import Cache

from core.counting import CountedModule
from core.errors import BenchError
from decoding.sampling import next_token, probs_from_logits, sample
from decoding.tree import Tree
from decoding.verify import verify_chain
from methods._sprinter_verifier import (
    VerifierRecipe,
    features,
    untrained_verifier,
    verifier_artifact,
    verifier_dir,
)
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register
from training.kit import load_or_train, untrained_if_synthetic


@register("sprinter")
class Sprinter(DraftVerify):
    lossless = False  # unchecked tokens stand: see the module docstring and bench/quality.py
    drafts = 1
    batched_drafting = True  # a batch drafts every row's token in one draft forward

    class Config(MethodSettings):
        threshold: float = Field(0.5, ge=0, le=1, description="keep drafting while the verifier's score > "
                                 "threshold; higher = more target checks (0: never flag, the target checks "
                                 "every max_run-th token; 1: every token, = SD with gamma 1)")
        max_run: int = Field(20, ge=1, description="most tokens drafted per target call (the paper: 20)")
        verifier: VerifierRecipe = Field(default_factory=VerifierRecipe, description="the verifier's training recipe")

    def setup(self, train_if_missing: bool = True) -> None:
        model, self.report = untrained_if_synthetic(
            self.pair, lambda: untrained_verifier(self.pair, self.cfg.verifier),
            lambda: load_or_train(verifier_artifact(self.pair, self.cfg.verifier), self.pair.cache, train_if_missing))
        expected = int(self.pair.draft.module.config.hidden_size) + (2 if self.cfg.verifier.probs else 0)
        if model.d_in != expected:
            raise BenchError(f"the cached SPRINTER verifier reads {model.d_in} features but this draft gives "
                             f"{expected}; delete {verifier_dir(self.pair, self.cfg.verifier)} to retrain it.")
        # In fp32 whatever the pair's dtype: it standardises its features in fp32 (Verifier.forward).
        self.verifier = self.pair.add(CountedModule(model.to(self.pair.device, torch.float32), "verifier"))

    def row_parts(self, batch: int) -> list[tuple]:
        return [(self.verifier, {((self.verifier.module.d_in,),): batch})]  # one row per prompt asking it

    class State(PromptState):
        """One prompt's drafting: the draft's KV cache, the last run's checked token's q, and the run tallies."""

        dcache: Cache  # the draft's: a DynamicCache, or its compiled forwards' static one (compile=true)
        q_last: torch.Tensor | None  # (vocab,): what the run's last token was drawn from; None when greedy
        stats: Counter  # runs by how they ended, unchecked tokens, checked tokens rejected (see extra)

    def draft_run(self, state: State, limit: int):
        """Draft up to ``limit`` tokens after ``state.seq``, stopping at the first token the verifier flags.

        Returns ``(tokens, q_last, why)``: the drafted token ids, the distribution the last one was drawn
        from (``FloatTensor (vocab,)``, ``None`` when greedy) and why the run ended (``flagged``,
        ``max_run``, ``eos`` or ``budget``). The last token is the one the target will check.
        """
        threshold, use_probs, sampling = self.cfg.threshold, self.cfg.verifier.probs, state.sampling
        x = torch.tensor([state.seq[state.dcache.get_seq_length():]], device=state.device)
        tokens, q = [], None
        for i in range(limit):
            out = yield {"lm": self.pair.draft, "cache": state.dcache, "input_ids": x, "logits_to_keep": 1,
                         "output_hidden_states": True}
            logits, hidden = out.logits[0, -1], out.hidden_states[-1][0, -1]
            if sampling.greedy:
                tok = logits.argmax(-1)
            else:
                q = probs_from_logits(logits, sampling)
                tok = sample(q, state.generator)
            tokens.append(int(tok))
            if i == limit - 1:
                # The target checks this token anyway: no need to ask the verifier.
                return tokens, q, "max_run" if limit == self.cfg.max_run else "budget"
            if tokens[-1] in self.eos_ids:
                return tokens, q, "eos"  # an end of answer is always checked, never waved through
            # The verifier's call (in a batch, one for every row that asks it now).
            scored = yield {"lm": self.verifier, "args": (features(hidden, logits, use_probs).unsqueeze(0),)}
            score = torch.sigmoid(scored)[0]
            if float(score) <= threshold:  # the paper flags below the threshold; <= makes 1.0 flag all
                return tokens, q, "flagged"
            x = tok.view(1, 1)
        return tokens, q, "budget"  # limit == 0: nothing drafted

    @classmethod
    def has_trained_parts(cls, pair_spec, settings=None) -> bool:
        return True  # the verifier

    def start(self, state: State):
        state.dcache = yield from state.draft_cache(self.pair.draft)  # the draft reads the prompt: its cost
        state.q_last = None
        state.stats = Counter()

    def propose(self, state: State):
        # Never draft past the budget: the target's own token fills the last slot.
        tokens, state.q_last, why = yield from self.draft_run(state, min(self.cfg.max_run, state.draft_budget))
        state.stats[f"runs_{why}"] += 1
        # ONE target forward over the pending token and the run; only the last two rows are needed:
        # the row scoring the last drafted token and the bonus row after it.
        return Proposal(Tree.chain(state.seq[-1], tokens), logit_rows=min(2, len(tokens) + 1))

    def verify(self, state: State, proposal: Proposal, logits: torch.Tensor) -> tuple[list[int], int]:
        k = proposal.depth
        if k == 0:
            return [0], int(next_token(logits[-1], state.sampling, state.generator))
        q = state.q_last.unsqueeze(0) if state.q_last is not None else None
        # The SD rule on the last token only; the k - 1 before it are committed unchecked.
        last = torch.tensor(proposal.tree.tokens[-1:], device=logits.device)
        n, nxt = verify_chain(last, q, logits, state.sampling, state.generator)
        state.stats["checked_rejected"] += 1 - n
        state.stats["unchecked_tokens"] += k - 1
        return list(range(k + n)), nxt

    def extra(self, state: State) -> dict:
        return {
            # Drafted tokens committed without any target check (counted before the EOS / budget cut).
            "unchecked_tokens": state.stats["unchecked_tokens"],
            # Runs that ended because the verifier flagged a token / reached max_run / drafted EOS / hit
            # the token budget; each ends in one target call.
            "runs_flagged": state.stats["runs_flagged"],
            "runs_max_run": state.stats["runs_max_run"],
            "runs_eos": state.stats["runs_eos"],
            "runs_budget": state.stats["runs_budget"],
            # Checked (last) tokens the target rejected and replaced.
            "checked_rejected": state.stats["checked_rejected"],
        }
