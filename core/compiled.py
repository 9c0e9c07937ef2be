"""A causal LM's forwards compiled for a few fixed shapes (``compile=true``): issue 40, docs/design/static-verification.md.

The target's, each draft model's a method decodes with (``sd``, ``cascade``, ``spechub``, ``gsd``, ``sprinter``), and
the methods' own models with a KV cache (``Method.batch_parts``: EAGLE's draft layer, Hydra++'s prefix layer, Amphista's
adaptation stages, GliDe's draft, which reads the target's cache too): one :class:`CompiledLM` per model.

Why: what a speculative method gains depends on what a k-token verification forward costs against a one-token step,
and an eager forward's cost is set by its kernels' quirks (BLAS blocking on the CPU, kernel launches on a GPU), not by
the bytes and FLOPs it needs. Production runs the target compiled, so the harness times it that way too, the baseline
and every method alike.

How:

- one :class:`~core.static_cache.RowCache` per run, allocated once, sized for the longest prompt plus the budget plus
  the largest bucket (room for padding rows);
- every target forward of n query rows (a verification tree, a one-token step, a prompt chunk) is padded to the
  smallest **bucket** >= n (default 1, 2, 4, 8, 16, 32, 64) and runs one graph compiled for that size (``dynamic=False``,
  ``fullgraph=True``): on the CPU inductor with weight freezing (weights folded and pre-packed for the bucket's row
  count, as ``core/kernels.py`` does by hand for eager runs), on CUDA ``mode="reduce-overhead"`` (CUDA graphs);
- what changes per step is a tensor, never a Python number a graph is specialised on: the token ids ``(1, Q)``, each
  row's depth below the pending token ``(1, Q)``, which cache slots each row may see ``(1, Q, max_len)`` (the cached
  ones, less any a tree hides, and the new rows its mask allows), the cache's length ``(1,)``, and the rows whose token
  embedding a method replaces ``(1, Q)`` with their vectors ``(1, Q, hidden)`` (SPACE's mask slots; none for every
  other); the graph derives positions, the cache slots it writes and the additive attention mask from them;
- the graphs return each decoder layer's input too (the residual stream, which the forward writes anyway), for methods
  whose drafters read the target's middle layers (``core.layer_taps``);
- padding rows repeat the first token at the next positions, each sees the prefix and itself (a row that sees nothing
  would be NaN), and no real row sees them; they are written past the real rows, then the cache's length moves by the
  real rows only, so the next forward overwrites them. Their cost is counted as waste
  (``core.counting.Counted.padded_tokens`` / ``padded_flops``), never hidden;
- the output head runs inside the graph on every row (frozen and packed with the rest; one graph per bucket, whatever
  ``logits_to_keep`` is), and the rows whose logits are not kept are counted as waste; an uncompiled forward runs it on
  the kept rows only;
- a batch (issue 41) keeps its running rows first, and a forward runs the graph for the smallest of the batch sizes
  compiled (``compile_batch_sizes``; by default the powers of two below the batch on CUDA, the batch only on the CPU)
  that holds them: a finished row past it costs nothing, one inside it runs as padding, counted;
- a forward of more rows than the largest bucket (a long prompt's prefill) runs the same code uncompiled (counted as
  ``uncompiled_calls``), as transformers' own compiled ``generate`` runs its prefill eagerly;
- :meth:`CompiledLM.warm` compiles every bucket before anything is timed (compile seconds per bucket are in
  ``run.json``), then :meth:`CompiledLM.check` refuses, in one sentence, a compiled forward whose logits are not
  the eager model's for the same tokens (after the cache, and without it);
- timed decodes run under ``torch.compiler.set_stance("fail_on_recompile")`` (:func:`no_recompiles`): a shape or guard
  the warm-up did not see stops the run instead of compiling inside the clock or falling back to eager silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import types

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from core.clock import sync
from core.errors import BenchError
from core.kv_cache import lm_forward
from core.model_parts import decoder_layers
from core.static_cache import RowCache
from core.swapped_embeddings import fed, with_swapped

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # query rows a graph is compiled for (SGLang and vLLM capture similar sizes)
# The cache slots an eager forward reads are rounded up to a multiple of this (the kernels' inner loops stay whole).
ATTEND_STEP = 16


def backend_of(device: torch.device) -> dict:
    """How a forward is compiled on ``device``: torch.compile's arguments and what the records say."""
    if device.type == "cuda":
        return {"backend": "inductor", "mode": "reduce-overhead", "freezing": False, "cuda_graphs": True}
    if device.type == "cpu":
        return {"backend": "inductor", "mode": None, "freezing": True, "cuda_graphs": False}
    raise BenchError(f"compile=true runs on the CPU or on CUDA; device {device} has no compiled path here "
                     "(set compile=false).")


def check_compiler(device: torch.device) -> None:
    """One sentence when inductor cannot compile on ``device`` (on the CPU it needs a C++ compiler)."""
    backend_of(device)
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as err:  # torch raises several kinds here, all meaning "no usable C++ compiler"
            raise BenchError(f"compile=true on the CPU needs a C++ compiler for torch inductor, and none was found "
                             f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); install g++ or set "
                             "compile=false.") from None


def foreign(hook) -> bool:
    """Whether a module hook is someone else's than transformers' or this module's: transformers installs its own on a
    model's layers the first time a forward asks for hidden states, inert unless a forward records them, which compiled
    forwards do not ask it to; this module's :class:`LayerRecorder` on the decoder layers, which record their inputs
    inside a :class:`CompiledLM`'s forwards only."""
    return not getattr(hook, "__module__", "").startswith(("transformers.", __name__))


def own_code(method):
    """``method`` (a bound method) on a copy of its code object. Dynamo keeps compiled graphs per code object: with a
    copy of its own, a compiled target's graphs are its own, and another one's in the same process (an earlier run of a
    sweep, frozen on other weights, until ``torch._dynamo.reset()``) never count against its recompile limit."""
    fn = method.__func__
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(copy, method.__self__)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``n`` rows; None beyond the largest."""
    return next((b for b in buckets if b >= n), None)


def compiled_batch_sizes(rows: int, asked: tuple[int, ...] | None, device: torch.device) -> tuple[int, ...]:
    """The running-row counts a batch of ``rows`` compiles graphs for: ``asked`` below ``rows``, and ``rows``. A forward
    of the first r rows runs the smallest >= r, the finished rows past it left out, as vLLM captures a CUDA graph per
    batch size and pads a batch to the next one. By default (``asked`` None) the powers of two below ``rows`` on CUDA,
    none on the CPU: there each graph holds its own frozen copy of the weights (SmolLM2-135M at B = 8, buckets 1, 4,
    16: 12 graphs took 11.4 GiB and 12 minutes to compile, against 3.7 GiB and 3 minutes for the 8-row graphs alone,
    and were not faster; docs/batching.md)."""
    below = asked if asked is not None else [2 ** i for i in range(rows.bit_length())] if device.type == "cuda" else []
    return tuple(sorted({int(r) for r in below if int(r) < rows} | {rows}))


def logits_head(module):
    """What turns ``module``'s last hidden states ``(..., hidden)`` into its logits ``(..., vocab)``: its own
    ``logits_of`` where it has one (a distilled draft maps its reduced vocabulary onto the full one), else its output
    head."""
    return getattr(module, "logits_of", None) or module.get_output_embeddings()


class LayerRecorder:
    """Each decoder layer's input of one model, recorded by forward pre-hooks on its layers while :attr:`on` (inside a
    :class:`CompiledLM`'s forwards; a no-op in every other forward of the model, which may run eagerly elsewhere).

    One per model, installed before its first graph is traced and never removed, shared by every CompiledLM of the
    model: dynamo guards on the number of a module's hooks, so hooks added or removed per CompiledLM would make every
    other CompiledLM of the same model compile again (a sweep's kept target, a test's second wrapper)."""

    def __init__(self, blocks: list):
        self.on = False
        self.box: dict[int, torch.Tensor] = {}
        self.n_layers = len(blocks)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(_Record(self, i), with_kwargs=True)

    def take(self) -> tuple[torch.Tensor, ...]:
        """The inputs ``(rows, Q, hidden)`` the forward that just ran recorded, bottom layer first."""
        inputs = tuple(self.box[i] for i in range(self.n_layers))
        self.box.clear()
        return inputs


class _Record:
    """Layer ``i``'s hook of a :class:`LayerRecorder`. An object, not a closure: a deep copy of the model copies it
    with its recorder (a closure would keep recording into the original's)."""

    def __init__(self, recorder: LayerRecorder, i: int):
        self.recorder, self.i = recorder, i

    def __call__(self, module, args, kwargs) -> None:
        if self.recorder.on:
            self.recorder.box[self.i] = args[0] if args else kwargs["hidden_states"]


def recorder_of(module) -> LayerRecorder:
    """``module``'s one :class:`LayerRecorder`, made the first time (none of its layers for a model whose layers sit
    elsewhere, such as a distilled draft)."""
    recorder = module.__dict__.get("_bench_layer_recorder")
    if recorder is None:
        try:
            blocks = decoder_layers(module)
        except BenchError:
            blocks = []
        recorder = LayerRecorder(blocks)
        module.__dict__["_bench_layer_recorder"] = recorder
    return recorder


@dataclasses.dataclass
class RowForward:
    """One sequence's part of a forward: ``ids`` (n new tokens), each at ``depth`` below its cached length, seeing the
    cached slots ``seen (n, past)`` marks (None: all) and the new rows ``sees (n, n)`` marks, with the logits of the
    rows ``keep`` (a 1-D tensor of indices); ``swap``: None, or ``(rows (n,) bool, fill (n, hidden))``, the rows whose
    token embedding is replaced, and by what (``core.swapped_embeddings``: SPACE's mask slots)."""

    ids: list[int]
    depth: list[int]
    seen: torch.Tensor | None
    sees: torch.Tensor
    keep: torch.Tensor
    swap: tuple[torch.Tensor, torch.Tensor] | None = None
    cross_seen: torch.Tensor | None = None  # (n, m) bool: the other model's cached slots 0 .. m-1 each row sees


class CompiledLM:
    """A causal LM's forwards over one :class:`RowCache`, compiled per bucket of query rows.

    ``module``: a transformers causal LM (or the harness's distilled draft, or EAGLE's draft layer, whose inputs come in
    as swapped embeddings) whose logits are :func:`logits_head` applied to its decoder's last hidden state (checked by
    :meth:`check`); ``max_len``: the longest sequence a decode holds
    (prompt plus budget); ``role``: the model's role in the pair (``target``, ``draft``...), for the sentences;
    ``rows``: the sequences its cache holds (1: :meth:`__call__` reads one; more: a batch, :meth:`forward_rows`
    reads them all in one forward, issue 41); ``compiled``: False runs the same code uncompiled, always (a batch's
    eager forwards: a ``DynamicCache`` cannot hold rows of different lengths); ``reads``: for a module that also
    attends to another model's cache (GliDe's draft: ``module.read_layers``, the target's layers its blocks read),
    that model's cache of as many rows, whose keys and values of those layers every forward takes as inputs, each query
    row seeing the slots its forward's ``cross_seen`` marks.
    """

    def __init__(self, module, max_len: int, buckets: tuple[int, ...] = BUCKETS, role: str = "target", rows: int = 1,
                 compiled: bool = True, reads: RowCache | None = None, batch_sizes: tuple[int, ...] | None = None):
        if not buckets or min(buckets) < 1:
            raise BenchError(f"compile_buckets must be row counts >= 1, got {list(buckets)}.")
        if batch_sizes is not None and any(int(r) < 1 for r in batch_sizes):
            raise BenchError(f"compile_batch_sizes must be row counts >= 1, got {list(batch_sizes)}.")
        self.module, self.role = module, role
        self.decoder = module.get_decoder() if hasattr(module, "get_decoder") else module.model
        self.head = logits_head(module)
        param = next(module.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.batch_sizes = compiled_batch_sizes(rows, batch_sizes, self.device)
        self.options = backend_of(self.device)
        # Room past the longest sequence for the largest forward's rows (padding, or a tree's rejected nodes).
        self.cache = RowCache(module.config, rows, max_len + 2 * max(self.buckets), self.dtype, self.device)
        # Every module of the model: a hook added to one after compiling would not run inside the graphs (torch
        # does not guard on nn.Module hooks), so a forward with one is refused (:meth:`_refuse_hooks`).
        self.modules = list(module.modules())
        if self.options["cuda_graphs"]:  # CUDA graphs replay fixed addresses; on the CPU this would freeze them in
            for layer in self.cache.layers:
                torch._dynamo.mark_static_address(layer.keys)
                torch._dynamo.mark_static_address(layer.values)
            torch._dynamo.mark_static_address(self.cache.lengths_t)
        # Each decoder layer's input (the residual stream entering it), recorded inside the forwards while a method reads
        # them (core.layer_taps: EAGLE-3's three layers, NEST's last), by the model's one LayerRecorder.
        self.recorder = recorder_of(module)
        self.tapped = 0  # LayerTaps open on this model: while any is, each forward's layer inputs are kept
        self.layer_inputs: tuple[torch.Tensor, ...] = ()  # (1, n, hidden) per layer, the last forward's real rows
        # Token embeddings replaced by given vectors at some rows (core.swapped_embeddings: SPACE's mask slots), an
        # input of every graph: (rows (n,) bool, fill (n, hidden)) for the forwards while it is set, else none.
        self.embed = module.get_input_embeddings()
        self.swap: tuple[torch.Tensor, torch.Tensor] | None = None
        self._no_fill: dict[tuple, tuple] = {}  # per (rows, Q): (False (rows, Q), zeros (rows, Q, hidden)): no swap
        self.graph = torch.compile(own_code(self._scored), dynamic=False, fullgraph=True, mode=self.options["mode"])
        self.compile_s: dict[int, float] = {}
        self.code: list = []  # the Python modules inductor generated for these graphs (their frozen weights): drop()
        self.reused = False  # made by an earlier run of this process and kept (bench.kept); compile_s say what warming took
        # The last call's forward, per row: cached positions before it, its real rows, the rows it ran, the rows the
        # output head ran on, whether it ran compiled, the cache slots it read.
        self.ran: list[tuple[int, int, int, int, bool, int]] | None = None
        self.holder: str | None = None
        self.compiles = compiled  # False: a batch's eager forwards, never compiled
        self.eager = not compiled  # every forward runs the graphs' code uncompiled (also inside eagerly())
        self.layer_inputs_of: list[tuple] = []  # per row of the last batch forward, as layer_inputs for one sequence
        # The other model's keys and values its forwards read (keys, values per read layer, (rows, n_kv, M, d) each: the
        # whole allocation, fixed addresses), and M; none for a module that reads its own cache only.
        layers = getattr(module, "read_layers", None)
        if (layers is None) != (reads is None) or (reads is not None and reads.rows != rows):
            raise ValueError(f"the {role}'s forwards read another model's cache of {rows} rows exactly when its module "
                             "names the layers it reads (read_layers)")
        self.cross_kv = tuple(t for i in layers for t in (reads.layers[i].keys, reads.layers[i].values)) if reads else ()
        self.cross_len = reads.max_len if reads is not None else 0

    # ------------------------------------------------------------------------------------------- the graph

    def _hidden(self, ids: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor, swapped: torch.Tensor,
                fill: torch.Tensor, cross: tuple | None = None) -> torch.Tensor:
        """``hidden (rows, Q, hidden)``: the decoder's last hidden states for ``ids (rows, Q)`` read after each row's
        cached positions, row i of each at position ``length + depth[i]``, seeing the cache slots ``visible (rows, Q,
        max_len)`` marks (the new rows are written at slots ``length .. length + Q - 1`` first); where ``swapped (rows,
        Q)`` is set the token's embedding is ``fill (rows, Q, hidden)`` instead; ``cross``: :meth:`_cross`'s, the other
        model's keys and values the decoder also reads (None: none)."""
        self.cache.attend = visible.shape[-1]  # the slots the cache's layers hand attention (CompiledLM.attended)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=ids.device)
        mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[:, None]  # (rows, 1, Q, L), additive
        embeds = with_swapped(self.embed(ids), swapped, fill)
        if cross is not None:  # the other model's rows this forward's rows are (sliced here, inside a graph: its
            # inputs keep their fixed addresses, which CUDA graphs replay)
            kv = cross[0] if self.cache.window is None else [t[self.cache.window] for t in cross[0]]
            other = {"cross": (list(zip(kv[0::2], kv[1::2])), cross[1])}
        else:
            other = {}
        return lm_forward(self.decoder, None, self.cache, inputs_embeds=embeds, attention_mask=mask,
                          position_ids=self.cache.forward_lengths[:, None] + depth, **other).last_hidden_state

    def _scored(self, ids: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor, swapped: torch.Tensor,
                fill: torch.Tensor, cross: tuple | None = None) -> tuple:
        """What a bucket's graph computes: :meth:`_hidden`'s states, the output head on every row, ``(rows, Q,
        vocab)``, and each decoder layer's input ``(rows, Q, hidden)``, bottom to top. The head is in the graph so that
        freezing packs it too: it is a fifth of SmolLM2-135M's weights, and run eagerly on k rows it paid the eager
        kernels' jump at 4 rows that the graph avoids."""
        hidden = self._hidden(ids, depth, visible, swapped, fill, cross)
        return hidden, self.head(hidden), self.recorder.take()

    def _visible(self, b: int, n: int, width: int, seen: torch.Tensor | None, sees: torch.Tensor) -> torch.Tensor:
        """``(width, max_len)``: the cache slots each query row of cache row ``b`` sees: row i of its ``n`` real ones
        the cached slots ``seen (n, past)`` marks (None: all) and the new rows ``sees (n, n)`` marks; a padding row the
        cached slots and itself (a row that sees nothing would be NaN), and no real row sees a padding row."""
        past = self.cache.lengths[b]
        visible = torch.zeros(width, self.cache.max_len, dtype=torch.bool)
        visible[:, :past] = True
        if seen is not None:
            visible[:n, :past] = seen
        visible[:n, past:past + n] = sees
        visible[torch.arange(n, width), torch.arange(past + n, past + width)] = True
        return visible

    def attended(self, q: int | None, width: int, lengths: list[int]) -> int:
        """The cache slots a forward of ``width`` query rows reads, from 0: eagerly (``q`` None) up to the longest row's
        end, rounded up to a multiple of :data:`ATTEND_STEP`, so that a cache sized for a dataset's longest prompt costs
        a group of short ones nothing; all of them in a compiled graph (``q``: its bucket), whose shapes are static.
        (A dynamic size in the graphs was tried: inductor specialised it in a contiguity check, and the graphs compiled
        again when the size changed.)"""
        if q is not None:
            return self.cache.max_len
        end = max(lengths) + width
        return min(-(-end // ATTEND_STEP) * ATTEND_STEP, self.cache.max_len)

    def _swapped(self, rows: list[RowForward | None], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(swapped (len(rows), width) bool, fill (len(rows), width, hidden))``: the query rows of each row's forward
        whose token embedding its ``swap`` replaces, and the vectors (padding rows never); with no swap, all False and
        zeros."""
        if all(r is None or r.swap is None for r in rows):
            if (len(rows), width) not in self._no_fill:
                self._no_fill[len(rows), width] = (
                    torch.zeros(len(rows), width, dtype=torch.bool, device=self.device),
                    torch.zeros(len(rows), width, self.embed.embedding_dim, dtype=self.dtype, device=self.device))
            return self._no_fill[len(rows), width]
        swapped = torch.zeros(len(rows), width, dtype=torch.bool, device=self.device)
        fill = torch.zeros(len(rows), width, self.embed.embedding_dim, dtype=self.dtype, device=self.device)
        for i, r in enumerate(rows):
            if r is None or r.swap is None:
                continue
            marks, vectors = r.swap
            if len(marks) != len(r.ids):
                raise ValueError(f"the compiled {self.role}'s swapped embeddings are for {len(marks)} rows; the "
                                 f"forward has {len(r.ids)}")
            swapped[i, :len(marks)] = marks.to(self.device, torch.bool)
            fill[i, :len(marks)] = vectors.to(self.device, self.dtype)
        return swapped, fill

    def _cross(self, rows: list[RowForward | None], width: int) -> tuple | None:
        """What a forward of ``rows`` reads of the other model's cache: ``(keys and values (rows of the cache, n_kv, M,
        d) per read layer, which the forward slices to its own rows, visible (len(rows), width, M) bool)``, each query
        row seeing the slots its forward's ``cross_seen`` marks (a padding row none: the draft's cross-attention gives
        it zeros); None for a module that reads its own cache only."""
        if not self.cross_kv:
            return None
        visible = torch.zeros(len(rows), width, self.cross_len, dtype=torch.bool)
        for i, r in enumerate(rows):
            if r is not None and r.cross_seen is not None:
                n, m = r.cross_seen.shape
                visible[i, :n, :m] = r.cross_seen
        return self.cross_kv, visible.to(self.device)

    def _run(self, rows: list[RowForward | None]) -> list[tuple | None]:
        """One forward over the rows of the cache: row b's ``rows[b]`` (None: an idle row), each padded to the bucket
        of the longest (its padding rows see its cached slots and themselves). Per row, ``(hidden (n, hidden), logits
        (len(keep), vocab), layer inputs ((1, n, hidden) per decoder layer))``, None for an idle row; each row's length
        then grows by its real rows.

        A batch keeps its running rows first (:meth:`RowCache.move`), so a finished row stops costing compute (issue
        41): uncompiled, the rows after the last running one are not computed at all; compiled, the first r rows run,
        r the smallest of :attr:`batch_sizes` holding the running ones (the idle ones among them as padding, counted).

        A forward longer than the largest bucket (a prompt's prefill, uncompiled) runs each real row on its own slice
        of the cache instead: padding 8 prompts to the longest cost 4.5 s of prefill at B = 8 for a fifth of the work
        real (docs/batching.md), and at that many rows a single row already fills the kernels."""
        if len(rows) != self.cache.rows:
            raise ValueError(f"a forward of the compiled {self.role} reads all {self.cache.rows} rows of its cache")
        running = [b for b, r in enumerate(rows) if r is not None]
        if not running:
            raise ValueError(f"a forward of the compiled {self.role} with no running row")
        longest = max(len(rows[b].ids) for b in running)
        if len(running) < 2 or longest <= max(self.buckets):
            compiled = not self.eager and longest <= max(self.buckets)
            if compiled:  # the first rows, as many as the smallest compiled batch size holding the running ones
                start, end = 0, bucket_for(running[-1] + 1, self.batch_sizes)
            else:  # uncompiled: the idle rows around the running ones left out
                start, end = running[0], running[-1] + 1
            out = self._forward(rows[start:end], range(start, end), compiled)
            left_out = [self._left_out(b) for b in range(self.cache.rows)]
            self.ran = left_out[:start] + self.ran + left_out[end:]
            return [None] * start + out + [None] * (self.cache.rows - end)
        out, ran = [], []
        for b, r in enumerate(rows):
            out.append(self._forward([r], range(b, b + 1), False)[0] if r is not None else None)
            ran.append(self.ran[0] if r is not None else self._left_out(b))
        self.ran = ran
        return out

    def _left_out(self, b: int) -> tuple:
        """:attr:`ran`'s entry for cache row ``b`` when a forward left it out: nothing ran."""
        return (self.cache.lengths[b], 0, 0, 0, False, 0)

    def _forward(self, rows: list[RowForward | None], at: range, compiled: bool) -> list[tuple | None]:
        """:meth:`_run`'s forward of ``rows`` on the cache rows ``at`` (``range(i, j)``: all of them, or that slice of
        the cache), ``compiled`` or not (compiled: ``at`` starts at 0 and holds one of :attr:`batch_sizes` rows)."""
        sizes = [len(r.ids) if r is not None else 0 for r in rows]
        lengths = [self.cache.lengths[b] for b in at]
        part = len(at) < self.cache.rows
        q = bucket_for(max(sizes), self.buckets) if compiled else None
        width = q or max(sizes)
        if max(lengths) + width > self.cache.max_len:  # every row writes `width` rows, padding included
            raise BenchError(f"a {self.role} forward of {max(sizes)} rows at position {max(lengths)} passes "
                             f"the compiled {self.role}'s cache of {self.cache.max_len} positions (the run's longest "
                             "prompt and budget, and twice the largest bucket); a larger largest bucket makes room.")
        ids, depth, visible = [], [], []
        for b, r, n in zip(at, rows, sizes):
            first, deepest = (r.ids[0], max(r.depth)) if r is not None else (0, -1)
            ids.append((r.ids if r is not None else []) + [first] * (width - n))
            depth.append((r.depth if r is not None else []) + list(range(deepest + 1, deepest + 1 + width - n)))
            visible.append(self._visible(b, n, width, r.seen if r is not None else None,
                                         r.sees if r is not None else torch.zeros(0, 0, dtype=torch.bool)))
        ids_t, depth_t = torch.tensor(ids, device=self.device), torch.tensor(depth, device=self.device)
        attend = self.attended(q, width, lengths)
        visible_t = torch.stack(visible)[..., :attend].to(self.device)
        swapped, fill = self._swapped(rows, width)
        cross = self._cross(rows, width)
        self.cache.lengths_t.copy_(torch.tensor(self.cache.lengths), non_blocking=True)
        self.ran = [(past, n, width, width if q is not None else (len(r.keep) if r else 0), q is not None, attend)
                    for past, r, n in zip(lengths, rows, sizes)]
        self.cache.writer, self.recorder.on = self, True
        self.cache.window = slice(at[0], at[-1] + 1) if part else None
        try:
            if q is None:  # uncompiled: the head on the kept rows only, of every row at once (its weights read once)
                hidden = self._hidden(ids_t, depth_t, visible_t, swapped, fill, cross)
                kept = [hidden[i, r.keep] for i, r in enumerate(rows) if r is not None]
                scored = iter(self.head(torch.cat(kept)).split([len(k) for k in kept]))
                logits = [next(scored) if r is not None else None for r in rows]
                inputs = self.recorder.take()
            else:
                if self.options["cuda_graphs"]:
                    torch.compiler.cudagraph_mark_step_begin()
                hidden, all_logits, inputs = self.graph(ids_t, depth_t, visible_t, swapped, fill, cross)
                logits = [all_logits[i, r.keep] if r is not None else None for i, r in enumerate(rows)]
                if self.options["cuda_graphs"]:
                    hidden = hidden.clone()  # a replay overwrites its output buffers
        finally:
            self.cache.writer, self.recorder.on, self.cache.window = None, False, None
            self.recorder.box.clear()
        copy = self.options["cuda_graphs"] and q is not None  # out of a CUDA graph's buffers, which the next replay reuses
        out = []
        for i, (b, r, n) in enumerate(zip(at, rows, sizes)):
            if r is None:
                out.append(None)
                continue
            # A method's layer taps read them (copied out of a CUDA graph's buffers, which the next replay overwrites).
            taps = tuple(x[i:i + 1, :n].clone() if copy else x[i:i + 1, :n] for x in inputs) if self.tapped else ()
            out.append((hidden[i, :n], logits[i], taps))
            self.cache.lengths[b] += n
        return out

    def _row_forward(self, b: int, input_ids: list[int], attention_mask, position_ids, logits_to_keep,
                     swap=None, cross_seen=None) -> RowForward:
        """Row ``b``'s part of a forward, from what ``lm_forward`` takes for one sequence: ``input_ids`` (n tokens),
        ``attention_mask`` None (causal) or the harness's ``(1, 1, n, past + n)`` additive tree mask, ``position_ids``
        None or ``(1, n)``, ``logits_to_keep`` 0 (all), k (the last k) or a 1-D tensor of rows; ``swap``, ``cross_seen``:
        :class:`RowForward`'s."""
        n, past = len(input_ids), self.cache.lengths[b]
        if isinstance(logits_to_keep, torch.Tensor):
            keep = logits_to_keep.to(self.device)
        else:
            keep = torch.arange(n - logits_to_keep if logits_to_keep else 0, n, device=self.device)
        if attention_mask is None and position_ids is None:  # causal
            return RowForward(input_ids, list(range(n)), None, torch.ones(n, n, dtype=torch.bool).tril(), keep, swap,
                              cross_seen)
        if attention_mask is None or position_ids is None:
            raise ValueError("a tree forward gives both attention_mask and position_ids")
        visible = (attention_mask[0, 0] == 0).cpu()
        seen = None if bool(visible[:, :past].all()) else visible[:, :past]
        return RowForward(input_ids, (position_ids[0] - past).tolist(), seen, visible[:, past:], keep, swap, cross_seen)

    # ------------------------------------------------------------------------------------------- the forward

    def __call__(self, input_ids: torch.Tensor, cache: RowCache, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, logits_to_keep=0, output_hidden_states: bool = False,
                 **kwargs) -> CausalLMOutputWithPast:
        """What ``lm_forward(module, input_ids, cache, ...)`` returns, for ``input_ids (1, n)``: ``logits (1, r, vocab)``
        on the rows ``logits_to_keep`` names (0: all; k: the last k; a 1-D tensor: those), and ``hidden_states`` (only
        the last: the decoder's normed output, as transformers' ``hidden_states[-1]``) when asked for.

        ``attention_mask``: None (causal) or the harness's ``(1, 1, n, past + n)`` additive tree mask
        (``decoding.tree.additive_mask``; a cached column it hides stays hidden); ``position_ids``: None (``past + i``)
        or ``(1, n)``."""
        if cache is not self.cache:
            raise ValueError(f"a compiled {self.role} reads and writes its own RowCache only")
        if kwargs:
            raise ValueError(f"the compiled {self.role} takes no {sorted(kwargs)}")
        rows, n = input_ids.shape
        if rows != 1 or self.cache.rows != 1:
            raise ValueError(f"the compiled {self.role} reads one sequence at a time here (a batch: forward_rows)")
        self._refuse_hooks()
        row = self._row_forward(0, input_ids[0].tolist(), attention_mask, position_ids, logits_to_keep, self.swap)
        hidden, logits, self.layer_inputs = self._run([row])[0]
        return CausalLMOutputWithPast(logits=logits[None], hidden_states=(hidden[None],) if output_hidden_states else None)

    def forward_rows(self, rows: list[dict | None]) -> list[CausalLMOutputWithPast | None]:
        """ONE forward over every row of a cache of several sequences (a batch): ``rows[b]``, row b's part, is what
        :meth:`__call__` takes for one sequence (``input_ids (1, n)``, and ``attention_mask``, ``position_ids``,
        ``logits_to_keep``, ``output_hidden_states`` as there), or None for a row that idles (a finished prompt: it
        runs as padding). Per row, what :meth:`__call__` returns for it, None for an idle row; :attr:`layer_inputs`
        is left empty (each row's are in ``layer_inputs_of``)."""
        self._refuse_hooks()
        parts = []
        for b, row in enumerate(rows):
            if row is None:
                parts.append(None)
                continue
            ids = row["input_ids"]
            if ids.shape[0] != 1:
                raise ValueError(f"row {b} of a batch forward is one sequence, got {ids.shape[0]}")
            parts.append(self._row_forward(b, ids[0].tolist(), row.get("attention_mask"), row.get("position_ids"),
                                           row.get("logits_to_keep", 0), row.get("swap"), row.get("cross_seen")))
        self.layer_inputs = ()
        outs, self.layer_inputs_of = [], []
        for row, result in zip(rows, self._run(parts)):
            if result is None:
                outs.append(None)
                self.layer_inputs_of.append(())
                continue
            hidden, logits, taps = result
            outs.append(CausalLMOutputWithPast(logits=logits[None], hidden_states=(hidden[None],)
                                               if row.get("output_hidden_states") else None))
            self.layer_inputs_of.append(taps)
        return outs

    @contextlib.contextmanager
    def eagerly(self):
        """Within the block, forwards run the graphs' code uncompiled on the same static cache: for a model whose
        modules a method changes for some forwards (SWIFT's draft skips sub-layers of the target), which the compiled
        graphs would not see."""
        before, self.eager = self.eager, True
        try:
            yield
        finally:
            self.eager = before

    def _refuse_hooks(self) -> None:
        """One sentence when a hook sits on one of the model's modules: it would not run inside a compiled graph
        (torch skips guards on nn.Module hooks), so a method reading what it captures would read stale tensors."""
        hooked = next((m for m in self.modules if any(foreign(h) for h in (*m._forward_hooks.values(),
                                                                          *m._forward_pre_hooks.values()))), None)
        if hooked is not None:
            raise BenchError(f"a hook on the {self.role}'s {type(hooked).__name__} would not run inside its compiled "
                             f"forwards; a method that hooks the {self.role} cannot run with compile=true.")

    # ------------------------------------------------------------------------------------------- set-up

    def new_cache(self, holder: str) -> RowCache:
        """The run's one cache, emptied, for the decode ``holder`` names; released by :meth:`release`. One sentence
        when another decode holds it (a method that runs a second target decode inside its own)."""
        if self.holder is not None:
            raise BenchError(f"{holder} asked for the compiled {self.role}'s cache while {self.holder} holds it: a "
                             f"method that runs two {self.role} decodes at once cannot run with compile=true yet.")
        self.holder = holder
        self.cache.reset()
        return self.cache

    def release(self) -> None:
        self.holder = None
        self.cache.reset()

    def drop(self) -> None:
        """When the run ends, for graphs no later run takes (a method's own model, compiled per run: bench.runner's
        ``compile_parts``): let go of them and of the code inductor generated for them (:func:`forget_graphs`)."""
        forget_graphs(self.graph, self.code)
        self.code, self.graph = [], None

    def warm(self) -> None:
        """Compile every bucket (untimed), largest first, for each of :attr:`batch_sizes`, and keep each bucket's
        seconds in :attr:`compile_s`. Graphs compiled before (a sweep's kept model, a test's fixture) are reused while
        their guards hold; when they no longer do, the buckets compile afresh on a new code object rather than piling
        a second set onto the old one's entries (dynamo's recompile limit counts them): a ``torch._dynamo.reset()``
        since, or a model class first made since, which grows transformers' output-capturing registry, whose size the
        graphs guard on."""
        if not self.compiles:
            return
        if self.compile_s and not self._graphs_hold():
            self.graph = torch.compile(own_code(self._scored), dynamic=False, fullgraph=True, mode=self.options["mode"])
        with (torch.inference_mode(), compile_settings(self.options, len(self.buckets) * len(self.batch_sizes)),
              generated_code(self.code)):
            for q in sorted(self.buckets, reverse=True):
                sync(self.device)
                start = time.perf_counter()
                for rows in self.batch_sizes:
                    self._warm_forward(q, rows)
                sync(self.device)
                self.compile_s[q] = round(time.perf_counter() - start, 3)
            self.cache.reset()

    def _warm_forward(self, q: int, rows: int | None = None) -> None:
        """A forward of ``q`` query rows in each of the first ``rows`` cache rows (None: all), on an emptied cache."""
        self.cache.reset()
        rows = self.cache.rows if rows is None else rows
        row = RowForward([0] * q, list(range(q)), None, torch.ones(q, q, dtype=torch.bool).tril(),
                         torch.arange(q, device=self.device))
        self._run([row] * rows + [None] * (self.cache.rows - rows))

    def _graphs_hold(self) -> bool:
        """Whether the smallest bucket's graph runs without compiling again."""
        try:
            with torch.inference_mode(), no_recompiles():
                self._warm_forward(min(self.buckets))
        except RuntimeError as err:
            if "recompile" not in str(err):
                raise
            return False
        finally:
            self.cache.reset()
        return True

    def check(self, context: int = 6, new: int = 3) -> None:
        """Refuse (one sentence) compiled forwards whose logits are not the eager model's: ``context`` tokens read
        through the cache, then ``new`` after them, against the same tokens read whole without any cache; and a
        one-token step against the same. Catches a graph that ignores or misreads its cache, a model whose logits
        are not its output head on its last hidden state, and a compiler that miscompiles. A cache of several rows
        reads a sequence per row, row b's context ``b`` tokens longer (rows of different lengths in one forward), once
        per compiled batch size on its first rows. After :meth:`warm` (it runs under :func:`no_recompiles`, where even
        a first compile is an error)."""
        rows, length = self.cache.rows, context + self.cache.rows + new
        # A module fed vectors, never token ids, has a one-row token table (EAGLE's draft layers, Hydra++'s prefix
        # layer): token ids would make every input the same, and the context invisible. It reads fixed random vectors,
        # swapped in for every row of its compiled forwards; its eager reference is its decoder over them, then its head.
        vocab = self.embed.num_embeddings
        fed_vectors = vocab == 1
        if not fed_vectors:
            ids = (torch.arange(length, device=self.device) * 7 + vocab // 3).remainder(vocab).unsqueeze(0)
        else:
            ids = torch.arange(length, device=self.device).unsqueeze(0)  # which vector each position reads
            vectors = torch.randn(length, self.embed.embedding_dim, generator=torch.Generator().manual_seed(0))
            vectors = vectors.to(self.device, self.dtype)
        seqs = [ids[:, :context + b + new] for b in range(rows)]
        # A module that reads another model's cache too (GliDe's draft) reads its row b's first `seen[b]` slots, as they
        # are (what that model's own check left there).
        seen = [min(context + b, self.cross_len) for b in range(rows)]

        def request(s: torch.Tensor, b: int) -> dict:
            out = fed(vectors[s[0]]) if fed_vectors else {"input_ids": s}
            return {**out, "cross_seen": torch.ones(s.shape[1], seen[b], dtype=torch.bool)} if self.cross_kv else out

        def eager(s: torch.Tensor, b: int) -> torch.Tensor:  # (n, vocab): the eager model's logits for s read whole, no cache
            if not fed_vectors:
                return lm_forward(self.module, s).logits[0].float()
            other = {}
            if self.cross_kv:
                visible = torch.zeros(1, s.shape[1], self.cross_len, dtype=torch.bool, device=self.device)
                visible[..., :seen[b]] = True
                kv = [t[b:b + 1] for t in self.cross_kv]
                other = {"cross": (list(zip(kv[0::2], kv[1::2])), visible)}
            hidden = lm_forward(self.decoder, None, inputs_embeds=vectors[s[0]][None], **other).last_hidden_state
            return self.head(hidden)[0].float()

        # Each batch size's graphs on its first rows (the rest finished), as a batch runs them when rows finish.
        sizes = sorted(self.batch_sizes if self.compiles else (rows,), reverse=True)
        got: dict[tuple[int, int], list] = {}  # (batch size, row) -> the row's logits, forward by forward
        with torch.inference_mode(), no_recompiles():
            for size in sizes:
                self.new_cache(f"the compiled {self.role}'s check")
                try:
                    for part in (lambda s: s[:, :-new], lambda s: s[:, -new:], lambda s: s[:, :1]):  # a step after
                        outs = self.forward_rows([request(part(s), b) if b < size else None
                                                  for b, s in enumerate(seqs)])
                        for b in range(size):
                            got.setdefault((size, b), []).append(outs[b].logits[0].float())
                finally:
                    self.release()
            for b, s in enumerate(seqs):
                whole, alone = eager(s, b), eager(s[:, -new:], b)
                ref_step = eager(torch.cat([s, s[:, :1]], 1), b)[-1:]
                for size in (size for size in sizes if b < size):
                    self._compare(torch.cat(got[size, b]), torch.cat([whole, ref_step]), alone, whole[-new:], b, size)

    def _compare(self, got: torch.Tensor, ref: torch.Tensor, alone: torch.Tensor, after: torch.Tensor, b: int,
                 size: int) -> None:
        """One sentence when ``got`` (the compiled forwards' logits) is not ``ref`` (the eager model's) within the
        dtype's tolerance, or not clearly nearer to it than the context changes the logits (``alone``: the last tokens
        read without their context, ``after``: with it)."""
        # A distilled draft's logits are -inf outside its vocabulary: the same entries must be, the rest close.
        finite = ref.isfinite()
        error = (got - ref)[finite].abs().max().item() if bool((got.isfinite() == finite).all()) else float("inf")
        scale = ref[finite].abs().max().item()
        context_effect = (alone - after)[after.isfinite()].abs().max().item()
        if not error <= check_tolerance(self.dtype) * max(scale, 1.0) or (context_effect > 0 and not error < 0.25 * context_effect):
            where = f" (row {b} of its cache, {size} rows running)" if self.cache.rows > 1 else ""
            raise BenchError(f"the compiled {self.role}'s logits are {error:.3g} away from the eager model's for the "
                             f"same tokens{where} (largest logit {scale:.3g}); compile=false runs it uncompiled.")

    def describe(self) -> dict:
        """What ``run.json`` says about the compiled model."""
        options = self.options if self.compiles else {}  # an eager batch: nothing compiled
        return {**options, "compiled": self.compiles, "rows": self.cache.rows,
                "buckets": list(self.buckets), **({"batch_sizes": list(self.batch_sizes)} if self.compiles else {}),
                "compile_s": dict(self.compile_s), "reused": self.reused,
                "cache_positions": self.cache.max_len, "cache_bytes": self.cache.nbytes,
                "torch": torch.__version__}


@contextlib.contextmanager
def compile_settings(options: dict, graphs: int):
    """torch's compile settings while the buckets compile: freezing where asked, and room for one graph per bucket
    (dynamo's default limit, 8, would fall back to eager silently past it; here a ninth graph is an error)."""
    import torch._dynamo
    import torch._inductor.config as inductor

    with torch._dynamo.config.patch(recompile_limit=max(graphs + 2, torch._dynamo.config.recompile_limit),
                                    fail_on_recompile_limit_hit=True), inductor.patch(freezing=options["freezing"]):
        yield


def check_tolerance(dtype: torch.dtype) -> float:
    """How far (relative to the largest output, at least 1) a compiled forward's outputs may lie from the eager one's."""
    return 1e-3 if dtype == torch.float32 else 5e-2


def drop_generated_code(modules: list | None = None) -> None:
    """Let go of the Python modules inductor generated for compiled graphs: ``modules`` (some graphs' own), or every
    one so far (None). With weight freezing, each holds its graph's frozen weights as module attributes, and inductor
    keeps every one it loads (its ``PyCodeCache`` and ``sys.modules``) after ``torch._dynamo.reset()``: found as the
    rest of a sweep's leak, a whole frozen copy of the pair per batch job. Call only when those graphs are not used
    again."""
    from torch._inductor.codecache import PyCodeCache

    for mod in list(PyCodeCache.modules if modules is None else modules):
        if sys.modules.get(mod.__name__) is mod:
            del sys.modules[mod.__name__]
    if modules is None:
        PyCodeCache.cache_clear()
        return
    mine = {id(mod) for mod in modules}
    PyCodeCache.modules[:] = [mod for mod in PyCodeCache.modules if id(mod) not in mine]
    for path in [p for p, mod in PyCodeCache.modules_no_attr.items() if id(mod) in mine]:
        del PyCodeCache.modules_no_attr[path]


@contextlib.contextmanager
def generated_code(into: list):
    """Within the block, the Python modules inductor generates (each compiled graph's code, with weight freezing its
    frozen weights) are added to ``into``, for :func:`forget_graphs`."""
    from torch._inductor.codecache import PyCodeCache

    before = {id(mod) for mod in PyCodeCache.modules}
    try:
        yield
    finally:
        into.extend(mod for mod in PyCodeCache.modules if id(mod) not in before)


def forget_graphs(graph, code: list) -> None:
    """Let go of one ``torch.compile``'d function's graphs (``graph``, made on :func:`own_code`'s copy) and of ``code``,
    the modules inductor generated for them (:func:`generated_code`), leaving every other compiled model's alone. For
    the parts a run compiles for itself: a sweep's jobs each compile their own, and would otherwise pile up a frozen
    copy of every job's parts (measured with heads: 68 MiB a job, and dynamo's entries on a class's shared code grew
    job after job until its recompile limit failed the fifth)."""
    compiled_fn = getattr(graph, "_torchdynamo_orig_callable", None)
    if compiled_fn is not None:
        torch._dynamo.reset_code(getattr(compiled_fn, "__func__", compiled_fn).__code__)
    drop_generated_code(code)


def no_recompiles():
    """A context where a compiled graph that would compile again raises instead (timed decodes)."""
    return torch.compiler.set_stance("fail_on_recompile")
