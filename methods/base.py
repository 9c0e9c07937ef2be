"""The one decode interface every method implements, and what a decode returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch
from omegaconf import DictConfig

from bench.models import Pair
from decoding.sampling import Sampling, next_token


@dataclass
class Decoded:
    """What one decode returns; timings and model calls are added by the harness, not by the method.

    ``output_ids``: the new tokens only (prompt excluded), at most ``max_new_tokens``.
    ``accept_lengths``: tokens committed by each target call after the prefill (bonus token counted, so
    plain decoding gives 1 per call).
    ``drafted``: tokens proposed for verification at each of those calls (0 for plain decoding); with
    ``accept_lengths`` it gives the acceptance rate per draft position.
    ``extra``: method-specific per-prompt figures (tree size, per-level hits, ...), JSON-able.
    """

    output_ids: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


class Method:
    """Base class. A method proposes and verifies tokens; it never times, counts or writes anything.

    Subclasses set ``lossless`` (True when greedy output must equal ``ar`` token for token and sampled output
    follow the target's distribution) and ``drafts`` (how many of the pair's draft models they run; a run
    loads and trains only those).
    """

    name: str = "?"
    lossless: bool = True
    drafts: int = 0

    def is_lossless(self, sampling: Sampling) -> bool:
        """Whether this instance's output is exactly the target's under ``sampling`` (what records say)."""
        return self.lossless

    @classmethod
    def analytic_speedup(cls, alpha: float, gamma: float, c: float) -> float:
        """The method's own analytic speedup model from the measured per-token acceptance ``alpha``, mean
        tokens drafted per target call ``gamma`` and draft/target cost ratio ``c``; NaN: it states none."""
        return float("nan")

    def __init__(self, cfg: DictConfig, pair: Pair):
        self.cfg = cfg
        self.pair = pair

    def setup(self, train_if_missing: bool = True) -> None:
        """Load (or train, when missing) what the method needs beyond the pair: heads, verifier, tables."""

    def decode(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling,
        generator: torch.Generator | None,
        on_tokens: Callable[[int], None],
    ) -> Decoded:
        """Decode one prompt.

        Args:
            prompt_ids: ``LongTensor`` of shape ``(1, prompt_len)`` on the pair's device.
            on_tokens: call with the number of tokens just committed, every time some are (the harness
                reads its clock on the first call: time to first token).
        """
        raise NotImplementedError

    # Shared helpers -----------------------------------------------------------------------------------

    @cached_property  # read at every decoding step: the tokenizer and generation config do not change
    def eos_ids(self) -> set[int]:
        tok = self.pair.tokenizer
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        gen = getattr(self.pair.target.module, "generation_config", None)
        extra = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(extra, int):
            ids.add(extra)
        elif extra:
            ids.update(extra)
        return ids

    def prefill(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens, draft=None):
        """Prefill the target (and ``draft``, if given) on the prompt and commit the target's first token.

        Returns ``(target_cache, draft_cache, seq, out, done)``: ``seq`` is prompt + committed tokens (a
        list), ``out`` the committed tokens. The draft's prefill is part of its cost and is counted as such.
        """
        from transformers import DynamicCache

        tcache, dcache = DynamicCache(), DynamicCache() if draft is not None else None
        logits = self.pair.target(prompt_ids, tcache, logits_to_keep=1).logits[0, -1]
        if draft is not None:
            draft(prompt_ids, dcache, logits_to_keep=1)
        out = [int(next_token(logits, sampling, generator))]
        on_tokens(1)
        out, done = self.finish(out, max_new_tokens)
        return tcache, dcache, prompt_ids[0].tolist() + out, out, done

    def finish(self, out: list[int], max_new_tokens: int) -> tuple[list[int], bool]:
        """Cut committed tokens at the first EOS (kept) and at ``max_new_tokens``; True when decoding is done."""
        eos = self.eos_ids
        for i, t in enumerate(out):
            if t in eos:
                return out[: min(i + 1, max_new_tokens)], True
        if len(out) >= max_new_tokens:
            return out[:max_new_tokens], True
        return out, False
