"""Counting wrappers: every forward pass of every model goes through one of these, tagged with its role.

Methods call the wrapper exactly as they would call the model; the harness reads and resets the counts.
A method never counts for itself, so calls, tokens and FLOPs are comparable across methods. A wrapper for a
method's own module (a draft layer, heads) says what a call runs -- its formula, the rows its output head
runs on, FLOPs its formula does not describe -- and :meth:`Counted._count` alone adds them up
(``tests/core/test_counting.py`` checks that nothing else writes a count).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from core.errors import BenchError
from core.flops import FlopFormula
from core.kv_cache import lm_forward
from core.static_cache import RowView


def head_rows(logits_to_keep) -> int | None:
    """The rows a forward's output head runs on, from its ``logits_to_keep``: a 1-D tensor lists them, k > 0 is the
    last k, 0 is all (None)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return len(logits_to_keep)
    return logits_to_keep if logits_to_keep > 0 else None


class Counted:
    """Calls, scored tokens and analytic FLOPs of one role (target, draft, heads, verifier, ...)."""

    head_weights: int = 0  # weights of the output head: a call that runs it on fewer rows saves 2 FLOPs each

    def __init__(self, module: nn.Module, role: str, config=None):
        self.module = module
        self.role = role
        self.formula = FlopFormula(module, config)  # FLOPs of (new_tokens, kv_len) for one sequence
        self.reset()

    def reset(self) -> None:
        self.calls = 0  # forward passes
        self.tokens = 0  # query positions scored, summed over the batch
        self.flops = 0.0  # analytic forward FLOPs (core.flops)
        # A compiled forward's padding (core.compiled): rows run only to fill a bucket, and the FLOPs they and the
        # static cache's masked columns cost beyond the real rows' (not in ``tokens`` or ``flops``).
        self.padded_tokens = 0
        self.padded_flops = 0.0
        # Forwards of a compiled model run uncompiled: more rows than the largest bucket, or not on its static cache.
        self.uncompiled_calls = 0

    def stats(self) -> dict:
        return {"calls": self.calls, "tokens": self.tokens, "flops": self.flops, "padded_tokens": self.padded_tokens,
                "padded_flops": self.padded_flops, "uncompiled_calls": self.uncompiled_calls}

    def counted_by(self, count, *args) -> dict:
        """What ``count(*args)`` adds to :meth:`stats`, key by key (one row's share of a batch's forward)."""
        before = self.stats()
        count(*args)
        return {k: v - before[k] for k, v in self.stats().items()}

    def _count(self, batch: int, new_tokens: int, kv_len: int, *, head_rows: int | None = None,
               flops: float | None = None, extra_flops: float = 0.0) -> None:
        """One call over ``batch`` sequences of ``new_tokens`` query positions each, attending to ``kv_len``
        keys. FLOPs: the formula's, or ``flops`` (the whole call's) where the call runs only a part of the module
        (one head of several); less the output head on all but ``head_rows`` positions of each sequence
        (``None``: all rows); plus ``extra_flops`` the formula does not describe (attention over another
        model's keys)."""
        self.calls += 1
        self.tokens += batch * new_tokens
        total = batch * self.formula(new_tokens, kv_len) if flops is None else flops
        if head_rows is not None and head_rows < new_tokens:
            total -= 2.0 * self.head_weights * batch * (new_tokens - head_rows)
        self.flops += total + extra_flops

    def _count_outside(self, flops: float) -> None:
        """``flops`` of a part of the module run outside its counted calls (EAGLE-3's ``fc`` on the target's features,
        ahead of the forward that reads its output): added to the role's FLOPs, no call or token counted."""
        self.flops += flops


class CountedLM(Counted):
    """A causal LM with a KV cache. ``lm(input_ids, cache, **kw)`` returns the model's output object.

    ``input_ids``: ``LongTensor`` of shape ``(batch, new_tokens)``; ``cache`` is a transformers ``Cache``
    holding the earlier positions (it is extended in place).
    """

    # FLOPs per query row and per key of another model's cache its forwards attend to besides their own (GliDe's draft
    # reads the target's: 4 x its cross-attention's width, scores and weighted sum); 0: its own cache only.
    cross_flops_per_key: float = 0.0

    def __init__(self, module: nn.Module, role: str):
        super().__init__(module, role, getattr(module, "config", None))
        self.config = getattr(module, "config", None)
        # A synthetic pair's target: the verification forwards' logits are decided by this coin
        # (decoding.set_acceptance.SetAcceptance, applied by decoding.tree.score_tree); None for a real model.
        self.acceptance = None
        # compile=true: the forwards compiled per bucket of rows over one static cache (core.compiled.CompiledLM),
        # which every decode's cache of this model then is (new_cache); None: eager forwards over a DynamicCache each.
        self.compiled = None
        head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        head = head if head is not None else getattr(module, "head", None)
        self.head_weights = head.weight.numel() if head is not None else 0

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def __call__(self, input_ids: torch.Tensor, cache, **kwargs):
        if isinstance(cache, RowView):
            raise BenchError(f"a forward of the {self.role} on one row of a batch runs with the others "
                             "(forward_rows); this method reads the target outside its verification forward, which "
                             "a batch does not do yet.")
        batch, new_tokens = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        # The output head runs on the last `keep` positions only (0: all), or on the positions a 1D tensor lists.
        rows = head_rows(kwargs.get("logits_to_keep", 0))
        self._count(batch, new_tokens, past + new_tokens, head_rows=rows)
        if self.compiled is not None:
            if cache is self.compiled.cache:
                out = self.compiled(input_ids, cache, **kwargs)
                self._count_padding(rows)
                return out
            # Compiled, but called with another cache (or none): eager, and counted so (a batch's eager forwards are
            # never compiled: nothing to count).
            self.uncompiled_calls += self.compiled.compiles
            self.compiled.layer_inputs = ()  # the compiled forwards did not record this forward's layer inputs
            if self.compiled.swap is not None:
                raise BenchError(f"the compiled {self.role} swaps token embeddings in its compiled forwards only; this "
                                 "forward runs on another cache.")
        return lm_forward(self.module, input_ids, cache, **kwargs)

    def forward_rows(self, rows: list[dict | None]) -> tuple[list, list[dict | None]]:
        """ONE forward over a batch (issue 41): ``rows[b]`` is row b's forward as :meth:`__call__`'s keywords for one
        sequence (``input_ids (1, n)``, ``logits_to_keep``, ...; None: the row idles), run on the batch cache of the
        compiled model (``core.compiled.CompiledLM.forward_rows``; eager or compiled). Returns the outputs per row
        (None for an idle row) and each active row's share of the counts (:meth:`stats`' keys): its forward as one
        call of its own with its real tokens and FLOPs, its padding, and an equal part of the idle rows' padding
        (counted, never hidden)."""
        if self.compiled is None or self.compiled.cache.rows != len(rows):
            raise BenchError(f"a batch forward of the {self.role} needs its static cache of {len(rows)} rows")
        kept = [head_rows(row.get("logits_to_keep", 0)) if row is not None else None for row in rows]
        lengths = list(self.compiled.cache.lengths)
        outs = self.compiled.forward_rows(rows)
        shares: list[dict | None] = []
        idle = dict.fromkeys(self.stats(), 0)
        for b, (row, ran) in enumerate(zip(rows, self.compiled.ran)):
            delta = self.counted_by(self._count_row, row, lengths[b], ran, kept[b])
            if row is None:
                idle = {k: idle[k] + delta[k] for k in idle}
            shares.append(delta if row is not None else None)
        active = [s for s in shares if s is not None]
        for share in active:
            for k in ("padded_tokens", "padded_flops"):
                share[k] += idle[k] / len(active)
        return outs, shares

    def _count_row(self, row: dict | None, past: int, ran: tuple, kept: int | None) -> None:
        """Row ``row``'s forward in a batch (None: an idle row, padding only) after ``past`` cached positions (and,
        for a model that reads another's cache, the keys of it that the row's ``cross_seen (n, m)`` covers)."""
        seen = 0
        if row is not None:
            n = row["input_ids"].shape[1]
            seen = row["cross_seen"].shape[-1] if row.get("cross_seen") is not None else 0
            self._count(1, n, past + n, head_rows=kept, extra_flops=self.cross_flops_per_key * n * seen)
        self._count_row_padding(ran, kept, seen)

    def _count_padding(self, kept: int | None) -> None:
        """What the compiled call just made ran beyond its real rows (``kept``: the real rows whose logits were kept,
        None: all): padding rows, the output head on rows whose logits nobody reads, and the static cache's masked
        columns every row attends to (all of them in a compiled graph, up to the longest row's end eagerly)."""
        self._count_row_padding(self.compiled.ran[0], kept)

    def _count_row_padding(self, ran_row: tuple, kept: int | None, cross_seen: int = 0) -> None:
        """:meth:`_count_padding` for one row of the last forward: ``ran_row`` is its ``CompiledLM.ran`` entry;
        ``cross_seen``: the other model's keys its real rows saw, of the ``CompiledLM.cross_len`` every row read."""
        head = 2.0 * self.head_weights
        past, real, ran, head_ran, compiled, attended = ran_row
        # A batch's eager forwards (compiled=False) are never compiled: nothing to count as uncompiled.
        self.uncompiled_calls += (not compiled) and real > 0 and self.compiled.compiles
        self.padded_tokens += ran - real
        kept_rows = real if kept is None else kept
        self.padded_flops += (self.formula(ran, attended) - head * (ran - head_ran)) - (
            self.formula(real, past + real) - head * (real - kept_rows))
        self.padded_flops += self.cross_flops_per_key * (ran * self.compiled.cross_len - real * cross_seen)

    def new_cache(self, holder: str):
        """A KV cache for one decode by ``holder`` (a method's name): the compiled forwards' static cache when
        compiled (give it back with :meth:`release_cache`), else a new ``DynamicCache``."""
        return DynamicCache() if self.compiled is None else self.compiled.new_cache(holder)

    def release_cache(self, cache) -> None:
        if self.compiled is not None and cache is self.compiled.cache:
            self.compiled.release()

    def count_plain_loop(self, prompt_len: int, new_tokens: int) -> None:
        """Count the forwards of plain greedy decoding run by a loop that calls the module itself, not this wrapper
        (transformers' ``generate``, the harness's compiled reference): what ``ar`` runs for the same tokens, a prefill
        of ``prompt_len`` positions with the output head on the last one, then one one-token forward per new token
        after the first."""
        if new_tokens <= 0:
            return
        self._count(1, prompt_len, prompt_len, head_rows=1)
        for i in range(1, new_tokens):
            self._count(1, 1, prompt_len + i)


class CountedModule(Counted):
    """A small module (draft heads, a verifier) applied to hidden states of shape ``(..., hidden)``, each position on
    its own (no position reads another's), so that the rows of a batch can be stacked into one call
    (:meth:`forward_rows`), and a call's rows padded to a compiled bucket."""

    # compile=true: the module's forward compiled per bucket of rows (core.compiled_rows.CompiledRows), which every
    # call then runs through; None: eager.
    compiled = None

    def count(self, hidden: torch.Tensor, *args) -> None:
        """Count one call on these inputs (what :meth:`__call__` counts; nothing runs)."""
        self._count(1, hidden.shape[:-1].numel(), 0)

    def __call__(self, hidden: torch.Tensor, *args):
        share = self.counted_by(self.count, hidden, *args)
        return self._run(share, hidden, *args)

    def _run(self, counted: dict, *args: torch.Tensor):
        """The module on ``args`` (the rows along dim 0), eagerly or through its compiled graphs; ``counted``: what the
        call's real rows were counted as, from which the padding rows' tokens and FLOPs follow (each row costs alike),
        counted as padding (never hidden); a call the graphs do not hold counts as uncompiled."""
        if self.compiled is None:
            return self.module(*args)
        out, ran, compiled = self.compiled(*args)
        real = args[0].shape[0]
        self.uncompiled_calls += not compiled
        self.padded_tokens += (ran - real) * counted["tokens"] // real
        self.padded_flops += (ran - real) * counted["flops"] / real
        return out

    def forward_rows(self, rows: list[dict | None]) -> tuple[list, list[dict | None]]:
        """The calls of a batch's rows as few calls as their shapes allow (issue 41): ``rows[b]`` is ``{"args": (...)}``,
        row b's call's inputs, each with the row's items along dim 0 (None: the row makes no call). Rows whose inputs
        agree beyond dim 0 (Hydra's heads at the same depth) are stacked into ONE call, whose output is split back
        along dim 0. Returns each row's output (None where none) and its share of the counts: its call as one of its
        own (as :meth:`__call__` would count it)."""
        shares: list[dict | None] = []
        groups: dict[tuple, list[int]] = {}
        for b, row in enumerate(rows):
            if row is None:
                shares.append(None)
                continue
            shares.append(self.counted_by(self.count, *row["args"]))
            groups.setdefault(tuple((a.shape[1:], a.dtype) for a in row["args"]), []).append(b)
        outs: list = [None] * len(rows)
        for members in groups.values():
            stacked = [torch.cat(parts) for parts in zip(*(rows[b]["args"] for b in members))]
            before = self.stats()
            out = self._run({k: sum(shares[b][k] for b in members) for k in ("tokens", "flops")}, *stacked)
            after = self.stats()
            for b in members:  # the stacked call's padding, shared by its rows (as the target's is)
                shares[b]["padded_tokens"] += (after["padded_tokens"] - before["padded_tokens"]) / len(members)
                shares[b]["padded_flops"] += (after["padded_flops"] - before["padded_flops"]) / len(members)
            shares[members[0]]["uncompiled_calls"] += after["uncompiled_calls"] - before["uncompiled_calls"]
            for b, part in zip(members, out.split([rows[b]["args"][0].shape[0] for b in members])):
                outs[b] = part
        return outs, shares
