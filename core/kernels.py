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
``ar`` (and every one-token step) on some days and not on others, and every speedup with it. And on
2026-11-27 ``F.linear``'s 2- and 3-row forwards were the fastest of all (0.89x its one-row forward) while the packed
weights cost 1.18x (scripts/verify_cost.py, docs/measuring.md). So no fixed rule holds: :func:`choose_kernels` times
both kernels on the loaded model's own forwards of :data:`TIMED_ROWS` tokens when a run loads it, and each
:class:`PackedLinear` then sends a forward of r rows to the kernel that was faster at the smallest timed count >= r
(the largest beyond them): plain decoding and verification each take the fastest kernel this machine has for
their size.

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

# Before the kernels are timed (and where they are not: a model nobody timed): packed from 2 rows. Measured: F.linear's
# cost jumps between 3 and 4 rows on the machine above in 2026-11; on 2026-11-24 its 2- and 3-row target forwards
# cost 1.5x and 2x a one-row one, the packed weights 1.2x and 1.25x (docs/measuring.md).
MIN_ROWS = 2
# The row counts choose_kernels times: a step, chains of 1-3 drafts, then the sizes trees and longer chains reach.
TIMED_ROWS = (1, 2, 3, 4, 8, 16)


def packed_from(rows: int) -> tuple[bool, ...]:
    """The kernel table (:attr:`PackedLinear.packed_at`) of packed weights from ``rows`` rows on, ``F.linear`` below."""
    return (False,) * rows + (True,)


PLAIN = (False,)  # F.linear at every row count
PACKED = packed_from(1)  # the packed weights at every row count


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose CPU fp32 forwards of r rows use oneDNN-packed weights where ``packed_at`` says so.

    ``forward(x (..., in_features)) -> (..., out_features)``, numerically equal to ``F.linear`` up to
    float summation order (~1e-4 on SmolLM2-135M's logits).
    """

    # packed_at[r]: whether r rows take the packed weights (rows beyond the table: its last entry). Packed from
    # MIN_ROWS until choose_kernels times this machine's kernels.
    packed_at: tuple[bool, ...] = packed_from(MIN_ROWS)
    _packed: torch.Tensor | None = None
    _packed_of: tuple = ()

    def _packed_weight(self) -> torch.Tensor:
        # Repack when the weight changed since it was packed (in-place update: _version; replaced: data_ptr).
        state = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed_of != state:
            # oneDNN's layout hint: four times the fewest rows that take the packed weights.
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 4 * self.packed_at.index(True))
            self._packed_of = state
        return self._packed

    def __getstate__(self):
        # The packed weight is an opaque oneDNN tensor that cannot be copied or pickled; a copy repacks.
        return {k: v for k, v in self.__dict__.items() if k not in ("_packed", "_packed_of")}

    def uses_packed(self, rows: int) -> bool:
        """Whether a forward of ``rows`` rows takes the packed weights (on the CPU in fp32, without autograd)."""
        return self.packed_at[min(rows, len(self.packed_at) - 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        plain = (
            # Traced by torch.compile (compile=true): inductor packs the weights per graph itself, and the oneDNN ops
            # here cannot be traced.
            torch.compiler.is_compiling()
            or not self.uses_packed(rows)
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
            module.packed_at = packed_from(min_rows)
            n += 1
    return n


def time_forwards(model: nn.Module, tables: dict[str, tuple[bool, ...]], rows: tuple[int, ...], reps: int,
                  past: int) -> dict[str, dict[int, float]]:
    """``{name: {k: ms}}``: the median time of ``model``'s forward of k tokens (a causal LM, after a ``past``-token
    cache; every row's logits kept, as a verification keeps them) with every :class:`PackedLinear` on kernel table
    ``tables[name]``, for each k of ``rows``; tables and sizes interleaved in each of ``reps`` rounds after an untimed
    one, under the harness clock. The linears keep the tables they had."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    before = [lin.packed_at for lin in linears]
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.arange(past + max(rows), device=device).remainder(vocab).unsqueeze(0)
    cache = DynamicCache()
    with torch.inference_mode():
        lm_forward(model, ids[:, :past], cache)
    times = {(name, k): [] for name in tables for k in rows}
    try:
        for round_ in range(reps + 1):
            for k in rows:
                for name, table in tables.items():
                    for lin in linears:
                        lin.packed_at = table
                    _, seconds = clocked(device, lm_forward, model, ids[:, past:past + k], cache)
                    cache.crop(-k)
                    if round_:  # the first round packs the weights and warms the caches
                        times[(name, k)].append(seconds)
    finally:
        for lin, table in zip(linears, before):
            lin.packed_at = table
    return {name: {k: round(statistics.median(times[(name, k)]) * 1e3, 2) for k in rows} for name in tables}


def choose_kernels(model: nn.Module, rows: tuple[int, ...] = TIMED_ROWS, reps: int = 5, past: int = 64) -> dict | None:
    """Time ``model``'s forwards of each count of ``rows`` tokens on ``F.linear`` and on the packed weights
    (:func:`time_forwards`) and set every :class:`PackedLinear` to take the faster kernel at each count (a count
    between two timed ones: the next larger one's; beyond the largest: its). Returns ``{"by_rows": {k: "packed" or
    "plain"}, "plain_ms": {k: ms}, "packed_ms": {k: ms}}`` (medians), or None when nothing in it is packed. Untimed
    by the harness: it runs when a pair loads (seconds for SmolLM2-135M)."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not linears:
        return None
    rows = tuple(sorted(set(rows)))
    ms = time_forwards(model, {"plain": PLAIN, "packed": PACKED}, rows, reps, past)
    packed = {k: ms["packed"][k] < ms["plain"][k] for k in rows}
    table = tuple(packed[next(k for k in rows if k >= r)] for r in range(rows[-1] + 1))
    for lin in linears:
        lin.packed_at = table
    return {"by_rows": {k: "packed" if packed[k] else "plain" for k in rows}, "plain_ms": ms["plain"],
            "packed_ms": ms["packed"]}
