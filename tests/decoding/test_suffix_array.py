"""REST's suffix-array datastore (decoding/suffix_array.py): pattern search, continuations, and the draft trie."""

from collections import Counter

import numpy as np
import pytest

from decoding.suffix_array import continuations, draft_trie, match_range, suffix_array


# Release-independent (no transformers model is loaded or called here): CI's oldest-transformers leg skips it.
pytestmark = pytest.mark.newest_only


@pytest.mark.parametrize("vocab", [3, 70000])  # ids above 65,535 are kept (the authors' u16 file wraps them)
def test_every_occurrence_of_a_pattern_is_found(vocab):
    rng = np.random.default_rng(vocab)
    tokens = rng.integers(vocab - 3, vocab, 400).astype(np.uint32)
    sa = suffix_array(tokens)
    assert sorted(sa.tolist()) == list(range(len(tokens)))
    for n in (1, 2, 3, 5):
        pattern = tokens[100 : 100 + n].tolist()
        lo, hi = match_range(tokens, sa, pattern)
        assert sorted(sa[lo:hi].tolist()) == [i for i in range(len(tokens)) if tokens[i : i + n].tolist() == pattern]
    assert match_range(tokens, sa, [vocab + 1]) == (0, 0) or match_range(tokens, sa, [vocab + 1])[0] == \
        match_range(tokens, sa, [vocab + 1])[1]


def test_the_trie_keeps_the_most_frequent_prefixes():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, 3000).astype(np.uint32)
    sa = suffix_array(tokens)
    lo, hi = match_range(tokens, sa, [1, 2])
    rows = continuations(tokens, sa, (lo, hi), 2, 5)
    counts = Counter(tuple(r[:j]) for r in rows.tolist() for j in range(1, 6) if -1 not in r[:j])
    for choices in (1, 7, 30):
        nodes = draft_trie(rows, choices)
        paths = []
        for depth, parent, token in nodes:
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
            assert len(paths[-1]) == depth
        assert len(set(paths)) == len(paths) == choices
        # Most frequent first (ties: shallower, then lexicographic): no left-out prefix counts more than a kept one.
        floor = min(counts[p] for p in paths)
        assert all(counts[p] <= floor for p in counts if p not in paths)


def test_continuations_stop_at_the_datastores_end():
    tokens = np.array([1, 2, 3, 1, 2], dtype=np.uint32)
    sa = suffix_array(tokens)
    rows = continuations(tokens, sa, match_range(tokens, sa, [1, 2]), 2, 3)
    assert rows.tolist() == [[-1, -1, -1], [3, 1, 2]]  # the match at the end, then the one inside
    assert draft_trie(rows, 5) == [(1, -1, 3), (2, 0, 1), (3, 1, 2)]
