"""Rolling a KV cache back: what every draft-and-verify loop does after a rejection."""

from __future__ import annotations


def truncate_cache(cache, length: int) -> None:
    """Roll a KV cache back to its first ``length`` positions (rejected drafts are dropped, not recomputed).

    Layer by layer: after a layer-skipping draft (SWIFT) the skipped attention layers hold fewer positions
    than the others, and transformers' ``Cache.crop`` removes the same number from every layer."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)  # transformers >= 5 takes the number of positions to remove, negated
