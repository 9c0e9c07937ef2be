"""Analytic forward-pass FLOPs, one formula for every role, so methods are compared on the same footing.

Kaplan et al. (2020), "Scaling Laws for Neural Language Models", Table 1: a forward pass costs
``2 * N`` FLOPs per token for the N non-embedding weights (one multiply and one add each), plus
``2 * n_layer * n_ctx * d_attn`` for attention scores and another as much for the weighted sum of values.
Here N is counted from the modules themselves (every Linear / GPT-2 Conv1D, the output head included,
since it is a real matmul), and n_ctx is the number of key positions each query attends to (cache +
new tokens), which is also what ``torch.utils.flop_counter.FlopCounterMode`` counts for a masked attention.
"""

from __future__ import annotations

import copy

from torch import nn


def matmul_weights(module: nn.Module) -> int:
    """Number of weights that take part in a matmul per token (Linear and GPT-2's Conv1D)."""
    total = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear) or type(sub).__name__ == "Conv1D":
            total += sub.weight.numel()
        elif isinstance(sub, nn.MultiheadAttention):  # its query/key/value projection is a bare parameter
            total += sum(w.numel() for w in (sub.in_proj_weight, sub.q_proj_weight, sub.k_proj_weight,
                                             sub.v_proj_weight) if w is not None)
    return total


def attention_width(config) -> tuple[int, int]:
    """``(n_layer, d_attn)`` of a Hugging Face config; ``(0, 0)`` for a module without attention."""
    if config is None:
        return 0, 0
    n_layer = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
    n_head = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 0)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    head_dim = getattr(config, "head_dim", None) or (hidden // n_head if n_head else 0)
    return n_layer, n_head * head_dim


class FlopFormula:
    """FLOPs of one forward over ``new_tokens`` query positions that attend to ``kv_len`` keys each."""

    def __init__(self, module: nn.Module, config=None):
        self.weights = matmul_weights(module)
        self.n_layer, self.d_attn = attention_width(config)

    def without(self, modules, attention_layers: int) -> FlopFormula:
        """This formula with ``modules`` (sub-layers a forward skips) and ``attention_layers`` attention layers
        (those of them that attend) taken out: the cost of a layer-skipping forward (SWIFT's draft)."""
        out = copy.copy(self)
        out.weights = self.weights - sum(matmul_weights(m) for m in modules)
        out.n_layer = self.n_layer - attention_layers
        return out

    def __call__(self, new_tokens: int, kv_len: int) -> float:
        dense = 2 * self.weights * new_tokens
        # QK^T and (softmax)V: 2 FLOPs per multiply-add each, per layer, per query, per key.
        attention = 4 * self.n_layer * self.d_attn * new_tokens * kv_len
        return float(dense + attention)
