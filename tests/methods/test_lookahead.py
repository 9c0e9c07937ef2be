"""Lookahead decoding (methods/lookahead.py): the window's attention pattern (each token reads its diagonal), the
levels filled then advanced one column per step, the pool's n-grams and its LRU rule, the prompt's n-grams, the
settings' rules. Greedy equality with ar and the sampling distribution are checked for every method by
tests/methods/test_methods.py."""

import pytest
import torch
from transformers import DynamicCache

from core.errors import BenchError
from decoding.tree import Tree, score_tree
from methods.lookahead import remember, window_rows, window_shape
from tests.helpers import assert_greedy_equal_to_ar, build, method_cfg, prompts_for, run, run_keeping_state


def test_each_window_token_reads_its_diagonal_as_a_plain_sequence(tiny_pair):
    """Level l, column i (offset l + i) sees the pending token, level 0's first i tokens and column i of levels
    1 .. l: its logits equal that sequence's scored plainly after the prefix."""
    target = tiny_pair.target
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 259, (1, 9), generator=gen).tolist()[0]
    m, top = 4, 3
    levels = [torch.randint(0, 259, (m - 1,), generator=gen).tolist()]
    levels += [torch.randint(0, 259, (m,), generator=gen).tolist() for _ in range(top)]
    side = window_rows(levels)
    side.keep = list(range(len(side.tokens)))  # every row's logits, for the test
    root = 17
    with torch.no_grad():
        cache = DynamicCache()
        target(torch.tensor([prefix]), cache)
        logits, _ = score_tree(target, cache, Tree(root), side=side)
        for level, tokens in enumerate(levels):
            for i in range(len(tokens)):
                if level == 0:
                    diagonal = levels[0][: i + 1]
                else:
                    diagonal = levels[0][:i] + [levels[lower][i] for lower in range(1, level + 1)]
                row = (i if level == 0 else m - 1 + (level - 1) * m + i)
                assert side.offsets[row] == len(diagonal)
                plain = target.module(torch.tensor([prefix + [root] + diagonal])).logits[0, -1]
                torch.testing.assert_close(logits[1 + row], plain, atol=1e-4, rtol=1e-4)


def test_only_the_top_levels_logits_are_kept():
    offsets, allowed, keep = window_shape(3, 2)  # level 0: 2 tokens, levels 1 and 2: 3 each
    assert offsets == [1, 2, 1, 2, 3, 2, 3, 4] and keep == [5, 6, 7]
    assert window_shape(5, 0)[2] == [0, 1, 2, 3]  # the first step: level 0 alone, all of it
    assert allowed.sum(1).tolist() == [1, 2, 1, 2, 3, 2, 3, 4]  # each row sees as many tokens as its offset


def test_the_window_fills_then_advances_one_column_per_step_and_feeds_the_pool(tiny_pair, looping_prompt):
    """N = 4, W = 3: level 0 starts with W + N - 3 = 4 prompt tokens; N - 2 = 2 steps fill levels 1 and 2; from
    then on each step gives the pool W n-grams (a column's diagonal and its new token) and drops the oldest level."""
    method = build(tiny_pair, "lookahead", level=4, window=3, guess=8, pool_from_prompt=False)
    seen = []
    real = type(method).side_scored

    def spy(state, proposal, logits):
        before = [list(level) for level in state.levels]
        real(method, state, proposal, logits)
        pool = {k: list(v) for k, v in state.pool.items()}
        seen.append((before, state.levels, pool, proposal.tree.tokens[0], logits.argmax(-1).tolist()))

    method.side_scored = spy
    ids = looping_prompt[:20]
    run(method, ids, 10)
    sizes = [[len(level) for level in before] for before, *_ in seen]
    assert sizes[:4] == [[4], [3, 4], [2, 3, 3], [2, 3, 3]]
    assert all(t in ids for t in seen[0][0][0])  # level 0 is drawn from the prompt
    assert seen[1][2] == {}  # nothing gathered while filling
    for before, after, pool, root, new in seen[2:]:
        assert after == [before[1][1:], before[2], new]  # one column, whatever was accepted
        for i, key in enumerate([root] + before[0]):
            assert (before[1][i], before[2][i], new[i]) in pool[key]


def test_the_pool_keeps_the_most_recent_guess_ngrams_per_key():
    pool = {}
    for gram in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        remember(pool, 9, gram, 2)
    assert pool == {9: [(1, 2), (5, 6)]}  # (1, 2) seen again moved last; (3, 4) the least recent, dropped


def test_the_prompts_ngrams_are_verified_from_the_first_step(tiny_pair, looping_prompt):
    """pool_from_prompt: each N-gram of the prompt is in the pool at the start, and each committed token's after;
    on a prompt that loops, the first step already accepts tokens (without it, the pool is empty then)."""
    ids = looping_prompt  # it ends inside the target's own loop
    out, state = run_keeping_state(build(tiny_pair, "lookahead", level=3, window=2, guess=4,
                                         pool_from_prompt=True), ids, 12)
    seq = ids + out.output_ids
    for end in range(3, len(seq) - 1):
        gram = seq[end - 3: end]
        assert tuple(gram[1:]) in state.pool[gram[0]] or len(state.pool[gram[0]]) == 4
    assert out.accept_lengths[0] > 1
    plain = run(build(tiny_pair, "lookahead", level=3, window=2, guess=4, pool_from_prompt=False), ids, 12)
    assert plain.accept_lengths[0] == 1 and plain.output_ids == out.output_ids


def test_the_window_alone_finds_the_loop(tiny_pair, looping_prompt):
    """Without the prompt's n-grams, the Jacobi window's own n-grams get accepted on a looping text (the method
    has power), and the output is ar's."""
    method = build(tiny_pair, "lookahead", level=4, window=4, guess=4, pool_from_prompt=False)
    assert_greedy_equal_to_ar(method, [looping_prompt], max_new=40)
    out = run(method, looping_prompt, 40)
    assert max(out.accept_lengths) > 1


def test_spec_benchs_settings_decode_like_ar(tiny_pair):
    method = build(tiny_pair, "lookahead", level=5, window=7, guess=7, pool_from_prompt=False)
    assert_greedy_equal_to_ar(method, prompts_for(tiny_pair, 2))


@pytest.mark.parametrize("settings, message", [
    ({"level": 2}, "level"),
    ({"window": 0}, "window"),
    ({"guess": 0}, "guess"),
])
def test_bad_settings_are_one_sentence(settings, message):
    with pytest.raises(BenchError, match=message):
        method_cfg("lookahead", **settings)
