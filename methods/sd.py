"""Standard speculative decoding (Leviathan et al., 2023; Chen et al., 2023).

Each step the draft proposes ``gamma`` tokens autoregressively; the target scores the pending token and
all ``gamma`` proposals in ONE forward; :func:`decoding.verify.verify_chain` keeps the longest valid prefix
and adds the target's own next token. Both KV caches are rolled back to the committed text, never
recomputed. Lossless: greedy output equals ``ar``; sampled output is distributed as the target's.
"""

from __future__ import annotations

import torch
from bench import metrics
from bench.counting import truncate_cache
from bench.errors import BenchError
from bench.registry import register
from decoding.sampling import probs_from_logits, sample
from decoding.verify import verify_chain
from methods.base import Decoded, Method


def draft_chain(draft, cache, pending: list[int], gamma: int, sampling, generator, device, confidence: float = 0.0):
    """Let ``draft`` propose up to ``gamma`` tokens after ``pending`` (the committed tokens it has not seen yet).

    With ``confidence`` > 0 drafting stops early after a token the draft itself gives a probability below
    ``confidence`` (that token is still proposed), as transformers' ``assistant_confidence_threshold`` does:
    past an unsure token the draft's guesses are mostly rejected, so drafting them costs time for nothing.

    Returns ``(tokens, probs)``: ``LongTensor (k,)``, k <= gamma, and, when sampling, ``FloatTensor (k, vocab)``
    (the tempered / top-p distribution each token was drawn from; ``None`` when greedy).
    """
    x = torch.tensor([pending], device=device)
    tokens, probs = [], []
    for _ in range(gamma):
        logits = draft(x, cache, logits_to_keep=1).logits[0, -1]
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
class SD(Method):
    lossless = True
    drafts = 1

    @classmethod
    def analytic_speedup(cls, alpha: float, gamma: float, c: float) -> float:
        """Leviathan et al. (2023), Theorem 3.8, with the measured alpha, mean gamma and cost ratio c."""
        return metrics.analytic_speedup(alpha, gamma, c)

    @classmethod
    def check(cls, cfg) -> None:
        """Bad settings, before any model loads: one sentence each."""
        if not 0 <= float(cfg.get("confidence", 0.0)) <= 1:
            raise BenchError(f"method.confidence must be in [0, 1] (0: always draft gamma tokens), got {cfg.confidence}.")

    def decode(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens) -> Decoded:
        target, draft, device = self.pair.target, self.pair.draft, prompt_ids.device
        gamma, confidence = int(self.cfg.gamma), float(self.cfg.get("confidence", 0.0))
        tcache, dcache, seq, out, done = self.prefill(prompt_ids, max_new_tokens, sampling, generator, on_tokens, draft)
        accept_lengths, drafted = [], []
        while not done:
            # Never draft past the token budget: the target's own token fills the last slot.
            k = min(gamma, max_new_tokens - len(out) - 1)
            dlen = dcache.get_seq_length()
            if k > 0:
                tokens, q = draft_chain(draft, dcache, seq[dlen:], k, sampling, generator, device, confidence)
            else:
                tokens, q = torch.empty(0, dtype=torch.long, device=device), None
            # One target forward scores the pending token and all k proposals: k + 1 rows of logits.
            block = torch.cat([torch.tensor(seq[-1:], device=device), tokens]).unsqueeze(0)
            logits = target(block, tcache).logits[0]
            n, nxt = verify_chain(tokens, q, logits, sampling, generator)
            committed = tokens[:n].tolist() + [nxt]
            seq.extend(committed)
            out.extend(committed)
            # Roll both caches back to the committed text minus the pending (last) token.
            truncate_cache(tcache, len(seq) - 1)
            truncate_cache(dcache, min(dcache.get_seq_length(), len(seq) - 1))
            accept_lengths.append(n + 1)
            drafted.append(len(tokens))
            if self.cfg.get("adaptive", False):
                # Hugging Face's heuristic schedule: lengthen after a full accept, shorten otherwise.
                gamma = min(gamma + 2, int(self.cfg.gamma_max)) if n == len(tokens) else max(gamma - 1, int(self.cfg.gamma_min))
            before = len(out)
            out, done = self.finish(out, max_new_tokens)
            on_tokens(len(committed) - (before - len(out)))
        return Decoded(out, accept_lengths=accept_lengths, drafted=drafted)
