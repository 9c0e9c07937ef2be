"""Grouped-query attention with a mask, without transformers' copy of the keys and values.

Why: a GQA model (Llama-3, Mistral, Qwen2, SmolLM2: ``g = heads / kv_heads`` query heads share each key/value
head) runs transformers' ``sdpa`` attention in one of two ways (``integrations/sdpa_attention.py``, 5.17 and
5.24 alike). With no mask, SDPA is called with ``enable_gqa=True`` and reads the cache's ``kv_heads`` heads as
they are; that is every one-token step of ``ar`` (``create_causal_mask`` returns None for one query row) and
the prefill. With a mask -- every verification of k > 1 tokens after a cache (a chain: the causal mask is
materialised because ``k != past + k``) and every token tree (the harness's own 4-D mask) -- ``repeat_kv``
first copies the keys and the values ``g`` times, the whole cache of every layer, on every call (5.24 spares a
single masked row by folding its heads; 5.17 copies then too). So verification paid a copy plain decoding never
pays: ``2 * (g - 1) * kv_heads * head_dim * context`` elements more written per layer than read, per forward.
transformers keeps ``enable_gqa`` off under a mask because on CUDA a masked call with ``enable_gqa`` leaves the
flash kernel and (as we read torch 2.11's sources) memory-efficient attention, which had no GQA then, and may fall
to the math kernel, which expands the keys itself and also materialises the scores.

What this does instead: the ``g`` query heads of a key/value head are stacked along the query axis, as
FlashInfer's kernels group them, and the mask rows are tiled to match: SDPA then runs with
``kv_heads`` heads and ``g * k`` query rows against the cache as it is, with no GQA flag, so it takes the same
backend as the default path by the same rules (CPU: the fused flash kernel; CUDA: memory-efficient attention
with a mask) with no copy of the cache. Each query row still meets the same keys, values and mask entries, so the
output is the default path's up to the kernel's rounding (bit for bit on the tiny models of
``tests/core/test_gqa_attention.py``; within 5e-7 in fp32 at Llama-3.1-8B's attention shape). On the CPU it
was also faster than SDPA's own ``enable_gqa=True`` with the mask, which avoids the copy too
(``scripts/gqa_cost.py``; docs/measuring.md, "Grouped-query attention in verification"). Not yet run on CUDA.

Everything else (no mask, no grouping, a position bias, attention weights asked for) is transformers' ``sdpa``
unchanged, and the masks are built by its ``sdpa_mask``: the only difference from ``attn_implementation="sdpa"``
is the missing copy. Switched on by :func:`switch_on` (or ``attn_implementation=register()`` at load).
"""

from __future__ import annotations

import torch

NAME = "sdpa_gqa"  # the attn_implementation this module registers


def grouped_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query (B, H, q, d)``, ``key`` and ``value (B, H_kv, kv, d)``
    with ``H = g * H_kv``, ``attention_mask`` boolean (True: attend) or additive, broadcastable to
    ``(B, H, q, kv)`` with a head axis of 1 or H, or None. Returns ``(output (B, q, H, d), None)``, as
    ``sdpa_attention_forward`` does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    special = kwargs.get("position_bias") is not None or kwargs.get("output_attentions") or kwargs.get("softcap")
    if groups == 1 or attention_mask is None or attention_mask.dim() != 4 or special:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    # Head h = j * g + r reads key/value head j (repeat_kv's order); stacked, its query row i becomes row r * q + i.
    folded = query.reshape(batch, kv_heads, groups * q_len, dim)
    mask_batch, mask_heads = attention_mask.shape[0], attention_mask.shape[1]
    if mask_heads == 1:  # one mask for every head: its rows tiled g times (g * q * kv entries, not the cache)
        mask = attention_mask.expand(mask_batch, groups, q_len, kv_len).reshape(mask_batch, 1, groups * q_len, kv_len)
    else:
        mask = attention_mask.reshape(mask_batch, kv_heads, groups * q_len, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :data:`NAME` with transformers (the attention function, and ``sdpa``'s mask builder under the same
    name: without it ``create_causal_mask`` returns no mask at all for an unknown name). Idempotent; returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, grouped_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def groups_heads(config) -> bool:
    """Whether a transformers config shares key/value heads between query heads (g > 1)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return bool(heads and kv_heads and heads > kv_heads)


def switch_on(model) -> bool:
    """Give a loaded transformers model this attention in place of ``sdpa``: True when it did (a GQA model on
    ``sdpa``); False, the model untouched, otherwise (eager, flash, a model without grouped heads)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or not groups_heads(config):
        return False
    model.set_attn_implementation(register())
    return True
