"""The optimised plain-decoding reference: the fastest greedy decoding transformers itself offers, timed beside ``ar``.

Spec-Bench's speedups are against eager plain decoding (``ar`` here: one forward per token over a dynamic KV cache,
nothing compiled). On a GPU anyone gets faster plain decoding from transformers' own ``generate`` with two settings: a
static KV cache, and the one-token decode step compiled by ``torch.compile`` in its ``reduce-overhead`` mode, which
replays each step as one CUDA graph instead of hundreds of kernel launches. So every run on CUDA also times that
(``reference=auto``; ``ar_compiled`` in the records) on the same prompts, and each record carries its speedup against
it (``speedup_vs_ref``) beside the one against ``ar`` (Spec-Bench's convention). On the CPU it is off unless asked for
(``reference=compiled``, or ``reference=static``: the same loop without ``torch.compile``, the dry run CI takes).

How it is run, so that it is the fastest plain decoding and its timing is the harness's own:

- ``generate`` with one ``StaticCache`` made when the run starts, sized for the longest prompt plus the budget, and
  reset after each prompt: its tensors keep their addresses, so the compiled step and its CUDA graph are recorded
  once, in the untimed warm-up (a new cache per call, ``generate``'s own default, re-records the graph every call);
- greedy, the same budget and the same stop tokens as ``ar`` (its ``eos_ids``; a synthetic pair's: none);
- timed by :func:`bench.runner.timed_decode` like any method: the device is synchronised before each clock read; the
  time to first token is read by a logits processor that, at the first step only, synchronises and reads the clock
  (``generate`` runs the prefill eagerly; only the one-token steps are compiled);
- its forwards are counted as ``ar``'s are (one prefill, then one one-token forward per later token:
  :meth:`core.counting.CountedLM.count_plain_loop`), since ``generate`` calls the model itself;
- its tokens are compared with ``ar``'s in every greedy record (``matches_baseline``, ``divergence``); the runner logs
  any prompt where they differ.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from pydantic import Field
from transformers import CompileConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList, StaticCache

from core.errors import BenchError
from core.kv_cache import cache_kwargs
from core.pair import Pair
from core.schema import Settings
from methods.base import DecodeOutput

NAMES = {"compiled": "ar_compiled", "static": "ar_static"}  # the reference's name in records, by mode
COMPILE_MODE = "reduce-overhead"  # torch.compile's mode: CUDA graphs on CUDA (transformers' CompileConfig default)
WARMUP_TOKENS = 16  # the warm-up decode's length: enough one-token steps to compile and record the CUDA graph


class ReferenceConfig(Settings):
    """What a reference record says it ran (its ``method_cfg``; not a setting: ``reference=`` picks the mode)."""

    name: str = Field(description="ar_compiled or ar_static")
    cache: Literal["static"] = Field("static", description="transformers' StaticCache, made once, reset per prompt")
    compiled: bool = Field(description="the one-token step compiled by torch.compile")
    compile_mode: str | None = Field(None, description="torch.compile's mode (reduce-overhead: CUDA graphs on CUDA)")

    @classmethod
    def of(cls, mode: str) -> ReferenceConfig:
        compiled = mode == "compiled"
        return cls(name=NAMES[mode], compiled=compiled, compile_mode=COMPILE_MODE if compiled else None)


def mode_for(cfg, device: torch.device, packed: bool) -> str | None:
    """The reference this run times (``compiled``, ``static``) or None, from ``cfg.reference``: ``auto`` is ``compiled``
    on CUDA for greedy runs and None elsewhere. ``packed``: the pair's CPU linears will be oneDNN-packed
    (``packed_linear`` on a CPU in fp32), which ``torch.compile`` cannot lower. A reference asked for where it cannot
    run is one sentence."""
    setting = cfg.get("reference") or "auto"
    greedy = float(cfg.temperature) == 0
    if setting == "none" or (setting == "auto" and (device.type != "cuda" or not greedy)):
        return None
    mode = "compiled" if setting == "auto" else setting
    if not greedy:
        raise BenchError(f"reference={setting} is greedy plain decoding; run it with temperature=0, or set "
                         "reference=none.")
    if mode == "compiled" and packed:
        raise BenchError("reference=compiled on the CPU in float32 needs packed_linear=false: torch.compile cannot "
                         "compile the packed oneDNN kernels (core/kernels.py); reference=static runs without "
                         "compiling.")
    return mode


class FirstStep(LogitsProcessor):
    """Leaves the scores alone; at the first step (the prefill's logits) tells the harness a token is coming, so it
    synchronises and reads its clock (time to first token), and does nothing at later steps."""

    def __init__(self, on_tokens):
        self.on_tokens, self.seen = on_tokens, False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.seen:
            self.seen = True
            self.on_tokens(1)
        return scores


class Reference:
    """Plain greedy decoding by transformers' ``generate`` with a static KV cache (compiled in mode ``compiled``), with
    the decode interface of a method (:meth:`decode`), so the runner warms it up, times, counts and records it like one.

    ``eos_ids``: ``ar``'s stop tokens; ``max_cache_len``: the longest prompt plus the budget (and the warm-up's).
    """

    lossless = True
    drafts = 0

    def __init__(self, mode: str, pair: Pair, eos_ids, max_cache_len: int):
        self.cfg = ReferenceConfig.of(mode)
        self.name = self.cfg.name
        self.pair = dataclasses.replace(pair, roles=dict(pair.roles))  # its own role table, as every method's
        self.module = pair.target.module
        self.eos = sorted(eos_ids)
        self.compile = CompileConfig(mode=COMPILE_MODE) if self.cfg.compiled else None
        if self.compile is not None and pair.device.type not in ("cuda", "xpu"):
            self.compile._compile_all_devices = True  # transformers compiles only on accelerators unless told
        self.cache = StaticCache(config=self.module.config, max_cache_len=max_cache_len)
        self.configs: dict[int, GenerationConfig] = {}

    @classmethod
    def trains(cls, pair_spec, settings=None) -> bool:
        return False

    def is_lossless(self, sampling) -> bool:
        return True

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        """Greedy, ``max_new_tokens`` at most, stopping at ``ar``'s stop tokens (``[]``: none, over the model's own),
        the repetition and n-gram penalties and the minimum length a model's generation config may set switched off
        (any other processor it switches on would show as tokens that are not ``ar``'s)."""
        if max_new_tokens not in self.configs:
            self.configs[max_new_tokens] = GenerationConfig(
                max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=list(self.eos),
                pad_token_id=self.eos[0] if self.eos else 0, repetition_penalty=1.0, no_repeat_ngram_size=0,
                min_length=0, compile_config=self.compile, disable_compile=self.compile is None)
        return self.configs[max_new_tokens]

    @property
    def kept_cache_bytes(self) -> int:
        """Bytes of the static cache it keeps from prompt to prompt (allocated at its first forward)."""
        return int(sum(t.numel() * t.element_size() for layer in self.cache.layers
                       if getattr(layer, "is_initialized", False) for t in (layer.keys, layer.values)))

    def decode(self, prompt_ids: torch.Tensor, max_new_tokens: int, sampling, generator, on_tokens) -> DecodeOutput:
        """``prompt_ids (1, prompt_len)`` decoded greedily by ``generate``; the new tokens, with ``ar``'s per-call
        figures (one token per target call after the prefill, nothing drafted)."""
        if not sampling.greedy:
            raise BenchError(f"{self.name} decodes greedily; it cannot time a sampling run.")
        try:
            out = self.module.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                       generation_config=self.generation_config(max_new_tokens),
                                       logits_processor=LogitsProcessorList([FirstStep(on_tokens)]),
                                       **cache_kwargs(self.cache))
        finally:
            self.cache.reset()  # the same tensors for the next prompt: no new CUDA graph
        new = out[0, prompt_ids.shape[1]:].tolist()
        self.pair.target.count_plain_loop(prompt_ids.shape[1], len(new))
        steps = max(len(new) - 1, 0)
        return DecodeOutput(new, [1] * steps, [0] * steps,
                            {"generate": "static cache" + (f", torch.compile {COMPILE_MODE}" if self.compile else "")})

    def close(self) -> None:
        """Let go of what the compiled step holds, when the run ends: transformers keeps the compiled ``__call__`` on
        the model, and torch's compile caches and CUDA-graph pool (process-wide) keep the model's weights and the
        graph's memory alive. Left there, a sweep's next runs in the same process (``-m``) decode beside that copy of
        the target: on the first lent H200 (2026-11-27) the eleven runs after a compiled reference peaked at 30 GiB
        for an 8B target of 15 GiB, the eleven after them at 15."""
        self.module.__dict__.pop("_compiled_call", None)
        self.module.__dict__.pop("_last_compile_config", None)
        if self.compile is not None:
            torch._dynamo.reset()  # its code caches and, on CUDA, the CUDA-graph trees and their memory pool
        self.cache = None


def build(mode: str | None, pair: Pair, eos_ids, prompts: list[list[int]], max_new_tokens: int) -> Reference | None:
    """The run's reference (None when ``mode`` is None), its cache sized for ``prompts`` and the budget."""
    if mode is None:
        return None
    longest = max((len(p) for p in prompts), default=0)
    return Reference(mode, pair, eos_ids, longest + max(max_new_tokens, WARMUP_TOKENS))

