"""CPU matmul kernels chosen by the number of rows a forward scores.

Why (measured on 2 AMD EPYC cores, AVX-512, fp32, torch 2.13 CPU wheel, SmolLM2-135M's shapes): the
default BLAS path of ``F.linear`` costs about the same for 1 to 3 rows, then jumps at 4 rows; a 5-token
target forward cost ~1.7x a one-token one, although the extra arithmetic is a few percent (and on a later day
the same machine's 2- and 3-row forwards were the slow ones: 1.5x and 2x). Verification
blocks (gamma + 1 tokens, trees of candidates) are exactly that size, so the jump is a tax on every
speculative method that plain decoding never pays. oneDNN's inner product on weights reordered ("packed")
once, which is what torch inductor's freezing pass uses on CPU, is nearly flat from 1 to 8 rows, but a
little slower than ``F.linear`` for one row -- on those days. On 2026-11-25 the same machine's one-row target
forward took 56 ms with ``F.linear`` and 41 ms with the packed weights, so a fixed choice for one row would tax
``ar`` (and every one-token step) on some days and not on others, and every speedup with it. So a
:class:`PackedLinear` sends forwards of at least ``min_rows`` rows to the packed weights and everything else to
``F.linear``, and :func:`choose_one_row_kernel` times both kernels on the loaded model's own one-token forward
when a run loads it and keeps the faster for one row: the baseline decodes with the fastest kernel this machine
has for it, as multi-token verification does.

The swap keeps each module's parameters (and weight tying), its state_dict keys and its FLOPs count;
autograd, other dtypes and other devices always take ``F.linear``.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn
from transformers import DynamicCache

from core.clock import clocked
from core.kv_cache import lm_forward

# Measured: F.linear's cost jumps between 3 and 4 rows on the machine above (1-3 rows: flat) in 2026-11; on
# 2026-11-24 the same machine's F.linear made 2- and 3-row target forwards cost 1.5x and 2x a one-row one, the
# packed weights 1.2x and 1.25x (docs/measuring.md): packing starts at 2 rows; one row is timed per run.
MIN_ROWS = 2


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose CPU fp32 forwards of at least ``min_rows`` rows use oneDNN-packed weights.

    ``forward(x (..., in_features)) -> (..., out_features)``, numerically equal to ``F.linear`` up to
    float summation order (~1e-4 on SmolLM2-135M's logits).
    """

    min_rows: int = MIN_ROWS
    _packed: torch.Tensor | None = None
    _packed_of: tuple = ()

    def _packed_weight(self) -> torch.Tensor:
        # Repack when the weight changed since it was packed (in-place update: _version; replaced: data_ptr).
        state = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed_of != state:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.min_rows * 4)
            self._packed_of = state
        return self._packed

    def __getstate__(self):
        # The packed weight is an opaque oneDNN tensor that cannot be copied or pickled; a copy repacks.
        return {k: v for k, v in self.__dict__.items() if k not in ("_packed", "_packed_of")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        plain = (
            rows < self.min_rows
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or self.weight.dtype != torch.float32
            or (torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad))
        )
        if plain:
            return nn.functional.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), bias, "none", [], "")


def pack_linears(model: nn.Module, min_rows: int = MIN_ROWS) -> int:
    """Turn every ``nn.Linear`` of ``model`` into a :class:`PackedLinear` in place; returns how many.

    A no-op (0) where oneDNN is not available. Weights are packed lazily, on the first multi-row forward.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear  # same object, same parameters: nothing else needs to know
            module.min_rows = min_rows
            n += 1
    return n


def choose_one_row_kernel(model: nn.Module, reps: int = 15, past: int = 64) -> dict | None:
    """Time ``model``'s one-token forward (a causal LM, after a ``past``-token cache) with one row on ``F.linear``
    and on the packed weights, ``reps`` times each, interleaved after one untimed round, and keep the faster for one
    row in each of its :class:`PackedLinear` s. Returns ``{"one_row": "packed" or "plain", "plain_ms", "packed_ms"}``
    (medians), or None when nothing in it is packed. Untimed by the harness: it runs when a pair loads."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not linears:
        return None
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.arange(past + 1, device=device).remainder(vocab).unsqueeze(0)
    cache = DynamicCache()
    with torch.inference_mode():
        lm_forward(model, ids[:, :past], cache)
    times = {1: [], MIN_ROWS: []}
    for round_ in range(reps + 1):
        for rows in times:
            for lin in linears:
                lin.min_rows = rows
            _, seconds = clocked(device, lm_forward, model, ids[:, past:], cache, logits_to_keep=1)
            cache.crop(-1)
            if round_:  # the first round packs the weights and warms the caches
                times[rows].append(seconds)
    packed, plain = (statistics.median(times[rows]) * 1e3 for rows in (1, MIN_ROWS))
    for lin in linears:
        lin.min_rows = 1 if packed < plain else MIN_ROWS
    return {"one_row": "packed" if packed < plain else "plain", "plain_ms": round(plain, 2),
            "packed_ms": round(packed, 2)}
