"""The harness clock: the device is synchronised before every read, so a reading means the work is done.

:mod:`bench.runner` times every decode with it. The one other user is a phase a method runs inside a decode
and must report separately (SWIFT's on-the-fly skip-set search): it reads the same clock, never its own.
"""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    """Wait for queued device work, so the clock reads when the work is really done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clocked(device: torch.device, fn, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)`` under the harness clock: the device is synchronised before each read.
    For code the harness does not drive step by step (e.g. transformers' own ``generate`` in scripts/)."""
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = fn(*args, **kwargs)
    sync(device)
    return out, time.perf_counter() - start
