"""``compile=true`` for a method's cache-free parts (issue 40): draft heads whose input rows are independent of each
other (Medusa's and Hydra's heads, :class:`core.counting.CountedModule`), compiled per bucket of rows like the
target's forwards (:mod:`core.compiled`), so that a compiled run times the method's own forwards compiled as well as
the models it verifies with.

A call's rows are padded with zeros to the smallest bucket holding them, and the padding's outputs dropped: no row
reads another, so the padding changes no real row's output (checked against the eager module before any clock, and
counted as wasted rows and FLOPs by the caller).
"""

from __future__ import annotations

import time

import torch

from core.clock import sync
from core.compiled import (backend_of, bucket_for, check_tolerance, compile_settings, forget_graphs, generated_code,
                           no_recompiles, own_code)
from core.errors import BenchError

Signature = tuple[tuple[int, ...], ...]  # the shapes beyond dim 0 of a call's inputs, in order


def row_buckets(most: int) -> tuple[int, ...]:
    """The powers of two up to the first holding ``most`` rows: ``1 -> (1,)``, ``3 -> (1, 2, 4)``."""
    return tuple(2 ** i for i in range(max(int(most) - 1, 0).bit_length() + 1))


class CompiledRows:
    """``module``'s forward compiled once per input :data:`Signature` and bucket of rows.

    Args:
        module: its forward takes tensors that all carry the call's rows along dim 0, each row on its own, and returns
            one tensor of the same rows: ``(n, *sig[0]), (n, *sig[1]), ... -> (n, ...)``.
        buckets: per input signature the run calls it with (the shapes beyond dim 0: Medusa's heads ``((hidden,),)``,
            Hydra's one per head, ``((hidden,), (k + 1, hidden))``), the row counts compiled for (a call of n rows
            runs the smallest >= n); :meth:`warm` compiles each. A call with another signature, or more rows than its
            largest bucket, runs eagerly.
    """

    def __init__(self, module: torch.nn.Module, buckets: dict[Signature, tuple[int, ...]], role: str):
        self.module = module
        self.role = role
        self.buckets = {tuple(tuple(int(d) for d in s) for s in sig): tuple(sorted({int(b) for b in rows}))
                        for sig, rows in buckets.items()}
        weight = next(module.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.options = backend_of(self.device)
        self.compiles = True  # core.counting reads it as CompiledLM's: an eager call of a compiled part is counted
        self.reused = False
        self.compile_s: dict[int, float] = {}
        self.code: list = []  # the Python modules inductor generated for these graphs (their frozen weights)
        self.graph = torch.compile(own_code(module.forward), dynamic=False, fullgraph=True, mode=self.options["mode"])

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
        """``(the real rows' output, rows run, compiled)``: the bucket's rows, or the call's own when run eagerly."""
        n = args[0].shape[0]
        bucket = bucket_for(n, self.buckets.get(tuple(tuple(a.shape[1:]) for a in args), ()))
        if bucket is None:
            return self.module(*args), n, False
        # Contiguous, as the graphs were compiled (Hydra's heads read an expanded view of one hidden state).
        padded = [torch.cat([a, a.new_zeros(bucket - n, *a.shape[1:])]) if bucket > n else a.contiguous() for a in args]
        if self.options["cuda_graphs"]:
            torch.compiler.cudagraph_mark_step_begin()
        # A CUDA graph's output lives in its pool and is overwritten by the next replay: the caller keeps a copy.
        out = self.graph(*padded)
        return (out[:n].clone() if self.options["cuda_graphs"] else out[:n]), bucket, True

    def _inputs(self, sig: Signature, rows: int, seed: int = 0) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(rows, *shape, generator=gen).to(self.device, self.dtype) for shape in sig]

    def warm(self) -> None:
        """Compile every signature's buckets (untimed), largest first; each bucket's seconds (over the signatures) in
        :attr:`compile_s`."""
        graphs = sum(len(rows) for rows in self.buckets.values())
        with torch.inference_mode(), compile_settings(self.options, graphs), generated_code(self.code):
            for rows in sorted({b for buckets in self.buckets.values() for b in buckets}, reverse=True):
                sync(self.device)
                start = time.perf_counter()
                for sig in (sig for sig, buckets in self.buckets.items() if rows in buckets):
                    self.graph(*self._inputs(sig, rows))
                sync(self.device)
                self.compile_s[rows] = round(time.perf_counter() - start, 3)

    def check(self) -> None:
        """Refuse (one sentence) compiled outputs that are not the eager module's for the same rows: every graph, on
        as many rows as it holds and, where it holds more than one, on one row fewer (padded: the padding must change
        no real row). After :meth:`warm`."""
        tolerance = check_tolerance(self.dtype)
        with torch.inference_mode(), no_recompiles():
            for sig, rows in ((sig, n) for sig, buckets in self.buckets.items() for b in buckets
                              for n in ({b, b - 1} - {0})):
                args = self._inputs(sig, rows, seed=rows)
                got, _, compiled = self(*args)
                ref = self.module(*args)
                error = (got.float() - ref.float()).abs().max().item()
                scale = ref.float().abs().max().item()
                if not compiled or not error <= tolerance * max(scale, 1.0):
                    raise BenchError(f"the compiled forward of the {self.role} is {error:.3g} away from the eager one "
                                     f"for the same inputs (largest output {scale:.3g}); compile=false runs it "
                                     "uncompiled.")

    def release(self) -> None:
        """When the run ends: let go of the graphs and of the code inductor generated for them, which holds their
        frozen weights and which inductor would keep for the life of the process (:func:`core.compiled.forget_graphs`)."""
        forget_graphs(self.graph, self.code)
        self.code, self.graph = [], None

    def describe(self) -> dict:
        """What ``run.json`` says about the compiled part."""
        return {**self.options, "compiled": True,
                "buckets": [{"inputs": [list(s) for s in sig], "rows": list(rows)} for sig, rows in self.buckets.items()],
                "compile_s": dict(self.compile_s),
                "reused": False, "torch": torch.__version__}
