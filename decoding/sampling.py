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


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax or a sample. ``logits``: ``(..., vocab)`` -> ``LongTensor`` ``(...)``."""
    if sampling.greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, sampling), generator)
