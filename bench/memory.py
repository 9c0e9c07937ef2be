"""A run's memory figures, each taken outside the clock.

Three figures per record (docs/measuring.md):

- ``peak_mem_bytes``: everything resident at the decode's worst moment: the allocator's peak on CUDA, the
  process's peak RSS on the CPU. It includes every model the run loaded, the other method's parts too (``ar``'s
  record of an ``sd`` run holds the draft), so it is a total, not a method's cost.
- ``method_param_bytes``: what the method itself holds beyond the target (:func:`method_param_bytes`): the bytes
  of the parameters and buffers of every part it runs and of the tensors it keeps. The same for every prompt.
- ``peak_decode_bytes``: CUDA only: the allocator's peak during the decode above what was allocated when it
  started (:func:`decode_start`, :func:`decode_peak`): the KV caches, activations and logits one decode holds at its
  worst moment. None on the CPU, where the peak RSS cannot be reset per prompt and torch keeps no allocator count.
"""

from __future__ import annotations

import resource

import torch
from torch import nn

from core.counting import Counted
from methods.base import Method


def peak_memory(device: torch.device) -> int:
    """Peak bytes: CUDA allocator peak since the last reset; on CPU the process's peak RSS (a high-water mark)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def decode_start(device: torch.device) -> int | None:
    """Before a decode (outside the clock): resets the CUDA allocator's peak and returns the bytes allocated now;
    None off CUDA. Reading the allocator's counters is a host-side call, no device synchronisation."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def decode_peak(device: torch.device, start: int | None) -> int | None:
    """After the decode: the allocator's peak since :func:`decode_start` less what was allocated then (None off
    CUDA)."""
    if start is None:
        return None
    return torch.cuda.max_memory_allocated(device) - start


def _storage(t: torch.Tensor) -> tuple[tuple, int] | None:
    """``(key, bytes)`` of the storage behind ``t`` (views and tied weights share one key); None for a tensor with
    no countable storage (meta, or an opaque oneDNN tensor)."""
    try:
        s = t.untyped_storage()
        return (t.device.type, t.device.index, s.data_ptr()), s.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers of ``module`` (each object once, as ``nn.Module`` lists them)."""
    return [*module.parameters(), *module.buffers()]


def held_tensors(obj, seen: set[int] | None = None) -> list[torch.Tensor]:
    """The tensors a method object keeps in its own attributes (not through its ``pair``): tensors, modules, counting
    wrappers and nested methods (SAM-Decoding's auxiliary EAGLE, KOALA's base), one level into lists, tuples and
    dicts. Host-side tables (numpy arrays, n-gram dicts, suffix arrays) are not tensors and are not counted."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    found = []

    def take(value, nested: bool = True) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, nn.Module):
            found.extend(module_tensors(value))
        elif isinstance(value, Counted):
            found.extend(module_tensors(value.module))
        elif nested and isinstance(value, (list, tuple)):
            for v in value:
                take(v, nested=False)
        elif nested and isinstance(value, dict):
            for v in value.values():
                take(v, nested=False)
        elif isinstance(value, Method):  # a method nested in this one
            found.extend(held_tensors(value, seen))

    for name, value in vars(obj).items():
        if name != "pair":  # the pair's models are counted by role, below
            take(value)
    return found


def method_param_bytes(method) -> int:
    """Bytes the method holds beyond the pair's target: the parameters and buffers of every role it counts (the draft
    models it runs, its heads, verifier, draft layers) and the tensors it keeps (:func:`held_tensors`), each storage
    counted once (tied weights, views), the target's never (SWIFT's skipping target adds nothing). The drafts a pair
    loaded for the other method of the run are not this one's: ``ar``'s figure in an ``sd`` run is 0."""
    pair = method.pair
    unused = {id(d) for d in pair.drafts[type(method).drafts:]}
    tensors = [t for role, c in pair.roles.items() if c is not pair.target and id(c) not in unused
               for t in module_tensors(c.module)]
    tensors += held_tensors(method)
    target = {s[0] for s in map(_storage, module_tensors(pair.target.module)) if s is not None}
    own = dict(s for s in map(_storage, tensors) if s is not None and s[0] not in target)
    return int(sum(own.values()))
