"""``compile=true`` across a sweep: the loaded models and their compiled forwards kept from one run to the next.

A sweep's jobs (``python -m bench run -m method=...``) run one after another in one process under hydra's basic
launcher. Compiling every bucket of every model takes minutes on a CPU (inductor does not cache graphs compiled
with weight freezing), and each job would compile the same target again. So a compiled run keeps what it loaded and
compiled in one slot, keyed by what decides them (the pair's settings, device, dtype, cache folder, threads), and the
next compiled run with the same key takes them from there: models by role, compiled forwards by role, longest
sequence and buckets. A run whose key differs, an eager run, and a run that fails let go of the slot first (and of
dynamo's caches, which hold the graphs' frozen weights).

What the records see: ``run.json``'s ``compile`` section says per model whether it was ``reused`` and what warming it
took in this run (seconds per bucket: near zero when its graphs were alive, a full compile when not); every reused
model is checked against its eager module again before any clock. Models an earlier job of the sweep loaded stay
resident while a later one runs without them (a draft during a ``pld`` job): memory figures are totals of what is
resident (:mod:`bench.memory`), and in a compiled sweep they include those.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging

import torch
from omegaconf import DictConfig, OmegaConf

from bench.models import pair_settings, resolve_device, resolve_dtype
from core.compiled import drop_generated_code

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Kept:
    """What compiled runs with one key share: ``modules`` (role -> the loaded model, as :func:`bench.models.load_pair`
    made it) and ``compiled`` ((role, max_len, buckets) -> :class:`core.compiled.CompiledLM`)."""

    key: str
    modules: dict = dataclasses.field(default_factory=dict)
    compiled: dict = dataclasses.field(default_factory=dict)


_slot: Kept | None = None


def key_of(cfg: DictConfig, checked: dict | None = None) -> str:
    """What decides the models a run loads and how they compile: the pair's checked settings (a draft's recipe among
    them), device, dtype, cache folder and CPU threads (``checked``: as :func:`bench.models.pair_settings` takes it)."""
    pair_cfg, cache, _ = pair_settings(cfg, checked)
    device = resolve_device(cfg.device)
    return json.dumps({"pair": OmegaConf.to_container(pair_cfg, resolve=True), "device": str(device),
                       "dtype": str(resolve_dtype(cfg.dtype, device)), "cache": str(cache),
                       "threads": torch.get_num_threads()}, sort_keys=True, default=str)


def slot_for(key: str) -> Kept:
    """The slot of compiled runs keyed ``key``: the one kept when its key is ``key``, else a new, empty one (the
    kept one let go first)."""
    global _slot
    if _slot is not None and _slot.key == key:
        log.info("compile: reusing the %s loaded and compiled by an earlier run in this process",
                 ", ".join(sorted(_slot.modules)) or "nothing")
        return _slot
    release()
    _slot = Kept(key)
    return _slot


def release(graphs: bool = False) -> None:
    """Let go of the kept models and compiled forwards, and of dynamo's caches (its compiled graphs hold frozen
    copies of the weights on the CPU, a CUDA-graph pool on CUDA); a no-op when nothing is kept, unless ``graphs``: a
    run compiled graphs it did not keep (a batch run's: about 4 GB per run of a sweep for SmolLM2 and its draft)."""
    global _slot
    if _slot is None and not graphs:
        return
    _slot = None
    torch._dynamo.reset()
    drop_generated_code()
    gc.collect()


def held() -> dict:
    """role -> model kept now (empty when nothing is)."""
    return dict(_slot.modules) if _slot is not None else {}
