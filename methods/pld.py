"""Prompt lookup decoding (LLMA, Yang et al. 2023, "Inference with Reference"; Saxena 2023, "prompt lookup
decoding"): no draft model. The last n-gram of prompt + output is looked up earlier in that same text and
the tokens that followed it there are proposed; the target scores them in one forward and
:func:`decoding.verify.verify_chain` keeps the longest valid prefix. No match: a plain target step.

The drafter is deterministic, so for sampling its proposal distribution is one-hot (q(x) = 1 for the
proposed token), which the rejection rule handles exactly: token x stays with probability p(x), and a
rejection resamples from p with x removed. Lossless: greedy output equals ``ar``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.counting import truncate_cache
from bench.errors import BenchError
from bench.metrics import ratio
from decoding.ngram import NGramIndex
from bench.registry import register
from decoding.verify import verify_chain
from methods.base import Decoded, Method


def one_hot_probs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The proposal distribution of a deterministic drafter: ``(k,)`` tokens -> ``FloatTensor (k, vocab)``."""
    return F.one_hot(tokens, vocab).float()


def check_ngram_settings(cfg, max_key: str = "max_ngram", min_key: str = "min_ngram") -> None:
    """n-gram sizes must satisfy 1 <= min <= max (shared by the training-free methods)."""
    lo, hi = int(cfg[min_key]), int(cfg[max_key])
    if not 1 <= lo <= hi:
        raise BenchError(f"method.{min_key} and method.{max_key} need 1 <= {min_key} <= {max_key}, got {lo} and {hi}.")


@register("pld")
class PLD(Method):
    lossless = True

    @classmethod
    def check(cls, cfg) -> None:
        check_ngram_settings(cfg)
        if int(cfg.draft_len) < 1:
            raise BenchError(f"method.draft_len must be at least 1, got {cfg.draft_len}.")

    def setup(self, train_if_missing: bool = True) -> None:
        self.check(self.cfg)

    def decode(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens) -> Decoded:
        target, device = self.pair.target, prompt_ids.device
        draft_len = int(self.cfg.draft_len)
        cache, _, seq, out, done = self.prefill(prompt_ids, max_new_tokens, sampling, generator, on_tokens)
        index = NGramIndex(int(self.cfg.min_ngram), int(self.cfg.max_ngram))
        index.add_document(seq)
        accept_lengths, drafted = [], []
        lookups = hits = 0
        while not done:
            # Never draft past the token budget: the target's own token fills the last slot.
            k = min(draft_len, max_new_tokens - len(out) - 1)
            found = index.continuations(seq, k) if k > 0 else []
            lookups += k > 0
            hits += bool(found)
            tokens = torch.tensor(found[0] if found else [], dtype=torch.long, device=device)
            # One target forward scores the pending token and the proposal (a plain step when there is none).
            block = torch.cat([torch.tensor(seq[-1:], device=device), tokens]).unsqueeze(0)
            logits = target(block, cache).logits[0]
            q = None if sampling.greedy else one_hot_probs(tokens, logits.shape[-1]).to(logits.device)
            n, nxt = verify_chain(tokens, q, logits, sampling, generator)
            committed = tokens[:n].tolist() + [nxt]
            seq.extend(committed)
            index.extend(committed)
            out.extend(committed)
            truncate_cache(cache, len(seq) - 1)  # drop the rejected proposals; the last token is pending
            accept_lengths.append(n + 1)
            drafted.append(len(tokens))
            before = len(out)
            out, done = self.finish(out, max_new_tokens)
            on_tokens(len(committed) - (before - len(out)))
        proposed = sum(drafted)
        accepted = sum(a - 1 for a in accept_lengths)
        extra = {
            "lookups": lookups,  # steps that looked for a match (a draft was allowed)
            "hit_rate": ratio(hits, lookups),  # lookups that found a continuation
            "proposed": proposed,  # tokens proposed from the text
            "accepted": accepted,  # proposed tokens the target kept
            "accept_rate": ratio(accepted, proposed),
        }
        return Decoded(out, accept_lengths=accept_lengths, drafted=drafted, extra=extra)
