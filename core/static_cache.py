"""A static KV cache with one length per row: what a compiled, static-shape forward writes into and reads.

transformers' ``StaticCache`` keeps one length for the whole batch (a 0-d ``cumulative_length``), so its rows cannot
hold prompts of different lengths, and 5.17's cannot be rolled back at all (no ``crop``). This one is the harness's
own, the same on every supported release (docs/design/static-verification.md, part B1):

- per layer, ``keys`` and ``values`` of shape ``(rows, kv_heads, max_len, head_dim)``, allocated once and zeroed then:
  a slot no forward has written yet holds zeros, never garbage, because a masked column whose key or value is NaN
  still turns the rows that mask it into NaN (0 * NaN);
- the rows' lengths twice: ``lengths`` (host ints, what the decoding loop reads) and ``lengths_t`` (a ``(rows,)`` long
  tensor on the device, which the compiled forward reads, so a length is never a Python constant a graph is
  specialised on). The forward's wrapper copies the host lengths into ``lengths_t`` before each call, and advances
  ``lengths`` after it by the rows that were real (padding rows are written past them, and never counted);
- a forward of ``q`` query rows writes row ``b``'s keys at slots ``lengths[b] .. lengths[b] + q - 1`` of that row;
- rolling back (``crop``; what ``decoding.cache.truncate_cache`` and ``decoding.tree.keep_path`` do after a rejection)
  only moves the length: stale slots past it are masked by every later forward and overwritten by the next write.

A cache of one row is read and rolled back as a whole (``get_seq_length``, ``crop``); a batch of rows (issue 41) row
by row, each through its :class:`RowView` (``cache.row(b)``), which a decode of that row holds as its cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache


class RowLayer(CacheLayerMixin):
    """One decoder layer's keys and values in a :class:`RowCache`; its lengths are the cache's (every layer holds the
    same positions)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: RowCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner, self.keys, self.values = owner, keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing: the tensors are allocated with the cache."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``key_states (rows, kv_heads, q, head_dim)`` (and the values) at each row's slots from its length on,
        and return the whole allocation, which the forward's mask limits to what each query may see."""
        if self.owner.writer is None:  # lengths_t is set for the forward that CompiledLM runs, and only then
            raise RuntimeError("a RowCache is written by its compiled model's own forwards only (this forward did "
                               "not go through core.compiled.CompiledLM)")
        rows, heads, q, dim = key_states.shape
        device = key_states.device
        window = self.owner.window  # None: every row; else the rows this forward computes
        keys, values = (self.keys, self.values) if window is None else (self.keys[window], self.values[window])
        slots = self.owner.forward_lengths[:, None, None] + torch.arange(q, device=device)  # (rows, 1, q)
        # index_put_, not scatter_: inductor writes it in place, where a scatter_ into the cache (a graph input) became
        # copies of the whole cache, every layer, every forward.
        where = (torch.arange(rows, device=device)[:, None, None], torch.arange(heads, device=device)[None, :, None], slots)
        keys.index_put_(where, key_states)  # a view of the cache: written in place
        values.index_put_(where, value_states)
        attend = self.owner.attend  # the slots this forward reads (CompiledLM.attended)
        return keys[:, :, :attend], values[:, :, :attend]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.owner.attend, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return self.keys.shape[-2]

    def crop(self, tokens_to_remove: int) -> None:
        self.owner.crop(tokens_to_remove)

    def reset(self) -> None:
        self.owner.reset()


class RowCache(Cache):
    """A static KV cache of ``rows`` sequences of at most ``max_len`` positions for ``config``'s decoder layers, in
    ``dtype`` on ``device``. Made once per run and :meth:`reset` between prompts: a compiled forward is specialised
    on these tensors (docs/design/static-verification.md, finding A5.2: a frozen graph handed a new cache of the same
    shape may keep reading the old one)."""

    def __init__(self, config, rows: int, max_len: int, dtype: torch.dtype, device):
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (rows, kv_heads, max_len, head_dim)
        self.max_len = max_len
        self.lengths = [0] * rows
        self.lengths_t = torch.zeros(rows, dtype=torch.long, device=device)
        self.writer = None  # the forward writing now (set by core.compiled.CompiledLM around each call)
        # The rows the forward running now reads and writes: None, all; else a slice of them (the running rows of a
        # batch, one row of a prefill row by row; set by core.compiled.CompiledLM, a Python constant its graphs are
        # specialised on, one graph per compiled batch size).
        self.window: slice | None = None
        # The slots the forward now running reads, from 0 (set by each CompiledLM forward: up to the longest row's end,
        # core.compiled.CompiledLM.attended).
        self.attend = max_len
        self.views: list[RowView] = []  # every row handed out since the last reset (:meth:`row`), moved by :meth:`move`
        super().__init__(layers=[RowLayer(self, torch.zeros(shape, dtype=dtype, device=device),
                                          torch.zeros(shape, dtype=dtype, device=device))
                                 for _ in range(config.num_hidden_layers)])

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def forward_lengths(self) -> torch.Tensor:
        """``lengths_t`` of the rows the forward running now reads: all, or its :attr:`window`'s."""
        return self.lengths_t if self.window is None else self.lengths_t[self.window]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The one row's length (a cache of several rows is read row by row)."""
        if self.rows != 1:
            raise ValueError("a RowCache of several rows has one length per row: read cache.lengths")
        return self.lengths[0]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (a number <= 0, as transformers 5 takes it; 0 drops none)."""
        self.get_seq_length()  # one row only
        self.crop_row(0, tokens_to_remove)

    def crop_row(self, b: int, tokens_to_remove: int) -> None:
        """Drop row ``b``'s last ``-tokens_to_remove`` positions (a number <= 0; 0 drops none)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of positions to drop, got {tokens_to_remove}")
        self.lengths[b] = max(self.lengths[b] + tokens_to_remove, 0)

    def row(self, b: int) -> RowView:
        """Row ``b`` as a cache of its own for one decode: its length, its rollback, its slots."""
        view = RowView(self, b)
        self.views.append(view)
        return view

    def move(self, src: int, dst: int) -> None:
        """The sequence in row ``src`` moves to row ``dst`` and the one in ``dst`` to ``src`` (a batch keeps its running
        rows first, so that its uncompiled forwards leave the finished ones out: ``core.compiled.CompiledLM._run``).
        Only ``src``'s filled slots are copied: ``dst``'s sequence has finished, and no forward reads it again. The
        rows' views follow their sequences."""
        for layer in self.layers:
            for t in (layer.keys, layer.values):
                t[dst, :, :self.lengths[src]] = t[src, :, :self.lengths[src]]
        self.lengths[src], self.lengths[dst] = self.lengths[dst], self.lengths[src]
        for view in self.views:
            if view.b in (src, dst):
                view.point_at(dst if view.b == src else src)

    def prefix(self, length: int) -> DynamicCache:
        """A ``DynamicCache`` holding a copy of the one row's first ``length`` positions, for eager forwards beside the
        compiled ones (SWIFT's skip-set search)."""
        return _prefix(self, length)

    def reset(self) -> None:
        """Empty every row (the tensors keep their addresses and contents; no forward reads past a row's length)."""
        self.lengths = [0] * self.rows
        self.views = []

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))


class RowView:
    """Row ``b`` of a :class:`RowCache`: what a decode of that row reads and rolls back (``get_seq_length``, ``crop``,
    and per layer ``keys`` / ``values`` of shape ``(1, kv_heads, max_len, head_dim)``, views into the cache's, which
    ``decoding.tree.keep_path`` rearranges in place). Its forwards run through the whole cache's
    (``core.compiled.CompiledLM.forward_rows``), all rows at once."""

    def __init__(self, owner: RowCache, b: int):
        self.owner = owner
        self.point_at(b)

    def point_at(self, b: int) -> None:
        """Read and write row ``b`` from now on (:meth:`RowCache.move`)."""
        self.b = b
        self.layers = [_LayerView(self, layer) for layer in self.owner.layers]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.owner.lengths[self.b]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the row's last ``-tokens_to_remove`` positions (a number <= 0, as transformers 5 takes it)."""
        self.owner.crop_row(self.b, tokens_to_remove)

    def prefix(self, length: int) -> DynamicCache:
        """:meth:`RowCache.prefix` of this row."""
        return _prefix(self, length)


def _prefix(cache: RowCache | RowView, length: int) -> DynamicCache:
    """A ``DynamicCache`` holding a copy of one row's first ``length`` positions (``cache``: a cache of one row, or a
    row of a batch's)."""
    if not 0 <= length <= cache.get_seq_length():
        raise ValueError(f"the cache holds {cache.get_seq_length()} positions, not {length}")
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone(), i)
    return out


class _LayerView:
    """One layer of a :class:`RowView`: the row's slice of the layer's tensors and the row's length."""

    def __init__(self, view: RowView, layer: RowLayer):
        self.view = view
        self.keys = layer.keys[view.b:view.b + 1]
        self.values = layer.values[view.b:view.b + 1]

    def get_seq_length(self) -> int:
        return self.view.get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        self.view.crop(tokens_to_remove)
