"""SAM-Decoding's suffix automaton (decoding/suffix_automaton.py) against brute-force search over random texts."""

import random

import pytest

from decoding.suffix_automaton import SEP, SuffixAutomaton
from tests.helpers import longest_earlier

# Release-independent (no transformers model is loaded or called here): CI's oldest-transformers leg skips it.
pytestmark = pytest.mark.newest_only


def random_texts(n=150, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        vocab = rng.randint(1, 4)  # a small vocabulary: long repeats
        yield [rng.randrange(vocab) for _ in range(rng.randint(0, 50))], rng


def test_the_cursor_is_the_longest_earlier_match_and_its_first_occurrence():
    """Moving the cursor by each token before appending it (as the method reads committed text): its length is
    the longest suffix of the text so far occurring before the last token, its state's first end the earliest."""
    for text, rng in random_texts():
        sam, cursor = SuffixAutomaton(), (0, 0)
        for i, token in enumerate(text):
            cursor = sam.step(*cursor, token)
            length, end = longest_earlier(text[:i], text[:i + 1])
            assert cursor[1] == length, (text, i)
            assert length == 0 or sam.first_end[cursor[0]] == end, (text, i)
            sam.append(token)
        context = [rng.randrange(4) for _ in range(6)]
        state, length = sam.match(context)
        assert (length, sam.first_end[state] if length else -1) == longest_earlier(text, context)
        if length:
            assert sam.continuation(state, 5) == text[sam.first_end[state] + 1:sam.first_end[state] + 6]


def test_growing_equals_building_from_scratch():
    for text, rng in random_texts(60, seed=1):
        cut = rng.randint(0, len(text))
        grown = SuffixAutomaton(text[:cut])
        grown.extend(text[cut:])
        whole = SuffixAutomaton(text)
        for field in ("tokens", "next", "link", "length", "first_end"):
            assert getattr(grown, field) == getattr(whole, field), field
        assert whole.states <= max(2 * len(text) - 1, 1)  # the automaton's bound: linear in the text


def test_counts_are_occurrences_and_rank_the_transitions():
    for text, _ in random_texts(60, seed=2):
        sam = SuffixAutomaton(text)
        counts = sam.counts()
        for s in range(1, sam.states):
            end, n = sam.first_end[s], sam.length[s]
            longest = text[end - n + 1:end + 1]
            assert counts[s] == sum(text[j - n + 1:j + 1] == longest for j in range(n - 1, len(text)))
            ranked = [counts[c] for _, c in sam.top_next(s, 8)]
            assert ranked == sorted(ranked, reverse=True)


def test_documents_never_match_across_a_separator():
    sam = SuffixAutomaton()
    sam.add_document([1, 2, 3])
    sam.add_document([4, 5])
    assert sam.tokens == [1, 2, 3, SEP, 4, 5]
    assert sam.match([3, 4])[1] == 1  # only "4": "3 4" spans the separator
    state, _ = sam.match([2, 3])
    assert sam.continuation(state, 5) == []  # the first document ends there


def test_earlier_trades_match_length_for_a_longer_continuation():
    """The authors' to_anc: a long match near the end has little text after it; a suffix of it may occur earlier."""
    text = [7, 1, 2, 3, 4, 5, 6, 8, 9, 2, 3]
    sam = SuffixAutomaton(text)
    state, length = sam.match([9, 2, 3])
    assert length == 3 and sam.continuation(state, 4) == []  # "9 2 3" occurs only at the very end
    shorter = sam.earlier(state, 4)
    assert sam.length[shorter] < 3 and sam.continuation(shorter, 4) == [4, 5, 6, 8]
    assert sam.earlier(state, 0) == state
