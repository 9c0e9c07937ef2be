"""A token datastore searched through its suffix array (REST, He et al. 2023), and the draft trie built from it.

The datastore is one array of token ids (``uint32``: any vocabulary size, where the REST authors' ``u16`` file
wraps ids above 65,535) and its suffix array (``pydivsufsort``, libdivsufsort's bindings: the suffixes'
start positions in lexicographic order). Every suffix that starts with a pattern lies in one contiguous range of
the suffix array, found by two binary searches; the tokens after each match are that match's continuation, and,
since all the matches share the pattern, the continuations come out in lexicographic order too, which is what
lets :func:`draft_trie` count the trie's nodes with a few vectorised comparisons.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The suffix array of ``tokens (n,)`` (an unsigned integer array): ``(n,) int64``, start positions sorted by
    the suffixes they start."""
    from pydivsufsort import divsufsort

    return np.asarray(divsufsort(np.ascontiguousarray(tokens)), dtype=np.int64)


def match_range(tokens: np.ndarray, sa: np.ndarray, pattern: list[int]) -> tuple[int, int]:
    """``[lo, hi)``: the suffix-array rows whose suffix starts with ``pattern`` (``lo == hi``: no match)."""
    n = len(pattern)

    def head(row: int) -> list[int]:  # the first n tokens of a suffix: sorted rows give sorted heads
        start = int(sa[row])
        return tokens[start : start + n].tolist()

    lo = bisect_left(range(len(sa)), pattern, key=head)
    hi = bisect_right(range(lo, len(sa)), pattern, key=head) + lo
    return lo, hi


def continuations(tokens: np.ndarray, sa: np.ndarray, rows: tuple[int, int], skip: int, length: int) -> np.ndarray:
    """The ``length`` tokens after each match of rows ``[lo, hi)`` (whose pattern is ``skip`` tokens long):
    ``(hi - lo, length) int64``, -1 past the datastore's end."""
    starts = sa[rows[0] : rows[1]] + skip
    at = starts[:, None] + np.arange(length)[None, :]
    inside = at < len(tokens)
    out = np.full(at.shape, -1, dtype=np.int64)
    out[inside] = tokens[at[inside]]
    return out


def draft_trie(rows: np.ndarray, choices: int) -> list[tuple[int, int, int]]:
    """REST's draft: the ``choices`` most frequent prefixes of the continuations ``rows (m, L)`` (sorted
    lexicographically, -1 past an end), as trie nodes ``(depth, parent node or -1, token)`` in an order where a
    parent comes before its children.

    A node's count is how many continuations start with its prefix; ties go to the shallower node, then to the
    lexicographically first, so the kept nodes are closed under prefixes (a prefix counts at least as often as
    any extension of it) and form a trie.
    """
    m, length = rows.shape
    if m == 0:
        return []
    # first[i]: how many leading tokens rows i and i + 1 share; a new node at depth d starts at row i + 1 when
    # first[i] < d (rows are sorted, so equal prefixes are adjacent).
    differ = rows[1:] != rows[:-1]
    first = np.where(differ.any(1), differ.argmax(1), length)
    count, depth, row, token, group_of = [], [], [], [], []
    total = 0
    for d in range(1, length + 1):
        starts = np.concatenate([[0], np.nonzero(first < d)[0] + 1])
        sizes = np.diff(np.concatenate([starts, [m]]))
        tok = rows[starts, d - 1]
        alive = tok >= 0  # rows that ended before depth d have no node there
        ids = np.where(alive, total + np.cumsum(alive) - 1, -1)
        group_of.append(np.repeat(ids, sizes))  # (m,) the node each row is in at depth d
        count.append(sizes[alive]), depth.append(np.full(alive.sum(), d)), row.append(starts[alive])
        token.append(tok[alive])
        total += int(alive.sum())
    count, depth, row, token = (np.concatenate(a) for a in (count, depth, row, token))
    best = np.lexsort((row, depth, -count))[:choices]  # most frequent first; ties: shallower, then first in order
    kept = best[np.lexsort((row[best], depth[best]))]  # parents before children
    index = {int(node): k for k, node in enumerate(kept)}
    return [(int(depth[n]), -1 if depth[n] == 1 else index[int(group_of[depth[n] - 2][row[n]])], int(token[n]))
            for n in kept]
