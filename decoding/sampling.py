"""Turning logits into a distribution: temperature and nucleus (top-p) filtering, shared by all methods."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Softmax of ``logits / temperature`` restricted to the top-p nucleus.

    Args:
        logits: ``FloatTensor`` of shape ``(..., vocab)``.
    Returns:
        ``FloatTensor`` of shape ``(..., vocab)``, rows summing to 1 (fp32 for a stable ratio p/q).
    """
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass *before* it is < top_p.
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < sampling.top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row. ``probs``: ``(..., vocab)`` -> ``LongTensor`` of shape ``(...)``."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def draft_token(logits: torch.Tensor, vocab_map: torch.Tensor, vocab_size: int, sampling: Sampling,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft's token from its ``logits (V',)`` over a reduced vocabulary ``vocab_map (V',)`` (full-vocabulary
    ids): the argmax when greedy, else a sample. Returns the token's full-vocabulary id (a 0-dim ``LongTensor``)
    and, when sampled, the distribution it was drawn from over the full vocabulary, ``q (vocab_size,)``, zero
    outside the draft's (what speculative sampling verifies against); ``None`` when greedy."""
    if sampling.greedy:
        return vocab_map[logits.argmax(-1)], None
    q = probs_from_logits(logits, sampling)
    sub = sample(q, generator)
    return vocab_map[sub], q.new_zeros(vocab_size).index_copy_(0, vocab_map, q)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax or a sample. ``logits``: ``(..., vocab)`` -> ``LongTensor`` ``(...)``."""
    if sampling.greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, sampling), generator)
