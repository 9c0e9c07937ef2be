"""Token embeddings replaced by given vectors at some rows of a forward: SPACE feeds the target trained mask
embeddings in the slots where it asks for guesses.

Eager, a forward hook on the model's input embedding replaces its output at those rows. A compiled model
(``compile=true``, :mod:`core.compiled`) runs the lookup inside its graphs, where a hook added after compiling never
runs; its graphs take the rows and vectors as inputs instead. Either way the forward reads the same embeddings.
"""

from __future__ import annotations

import contextlib

import torch


def with_swapped(embeds: torch.Tensor, rows: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """``embeds (..., n, hidden)`` with ``fill (..., n, hidden)`` in place at the rows ``rows (..., n)`` marks."""
    return torch.where(rows[..., None], fill.to(embeds.dtype), embeds)


def fed(vectors: torch.Tensor) -> dict:
    """A forward's inputs that read ``vectors (n, hidden)`` in place of every token's embedding (a module fed vectors,
    never token ids, whose token table has one row: EAGLE's draft layers, Hydra++'s prefix layer): ``input_ids`` zeros
    ``(1, n)`` and ``swap``, every row replaced."""
    n = vectors.shape[0]
    return {"input_ids": torch.zeros(1, n, dtype=torch.long, device=vectors.device),
            "swap": (torch.ones(n, dtype=torch.bool), vectors)}


@contextlib.contextmanager
def swapped_embeddings(lm, rows: torch.Tensor, fill: torch.Tensor):
    """Within the block, every forward of ``lm`` (a ``core.counting.CountedLM``, compiled or not) of ``len(rows)``
    tokens reads ``fill[i]`` in place of its token's embedding at each row i where ``rows[i]``. ``rows (n,)`` bool,
    ``fill (n, hidden)``."""
    compiled = lm.compiled
    if compiled is not None:
        compiled.swap = (rows, fill)
        try:
            yield
        finally:
            compiled.swap = None
        return

    def swap(module, args, out):  # out: (1, n, hidden), the looked-up embeddings of this forward
        return with_swapped(out, rows, fill)

    hook = lm.module.get_input_embeddings().register_forward_hook(swap)
    try:
        yield
    finally:
        hook.remove()
