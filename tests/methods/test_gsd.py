"""GSD beyond the registry walk (``tests/methods/test_methods.py`` covers its defaults): the graph's merge rule and its
unrolling into the tree the target scores, the draft's level reads against plain scoring, the method on the tiny
pair with and without merging (lossless, merges happen, reused nodes are scored, the draft's cache kept right)."""

import dataclasses

import pytest
import torch

from decoding.sampling import Sampling
from methods.gsd import Graph
from tests.helpers import (
    assert_cache_is_a_plain_pass,
    assert_greedy_equal_to_ar,
    assert_sampling_is_the_targets,
    build,
    forwards_run,
    noisy_copy,
    prompts_for,
    run,
    run_keeping_state,
    with_drafts,
)

# Verification math and loop logic beyond the registry walk: the method's model calls (its draft's and the target's
# forwards) are those tests/methods/test_methods.py makes for it under both transformers releases; CI's oldest leg
# skips these.
pytestmark = pytest.mark.newest_only


@pytest.fixture(scope="module")
def good_pair(tiny_pair):
    """The tiny pair whose draft is a noisy copy of the target: drafts are often, not always, accepted."""
    return with_drafts(tiny_pair, noisy_copy(tiny_pair.target.module))


def small_graph(repeat: int) -> Graph:
    """root 9 -> a 1 -> b 2 -> c 3, and root -> d 5 -> e 2 (e: the same token as b)."""
    g = Graph(9, repeat)
    a = g.add(0, 1, 0.9)
    d = g.add(0, 5, 0.5)
    b = g.add(a, 2, 0.8)
    g.add(b, 3, 0.7)
    g.add(d, 2, 0.6)  # repeats b's token; b's preceding token is 1, e's would be 5
    return g


# --------------------------------------------------------------------------------------------- the graph


def test_a_token_alone_merges_with_repeat_0_but_not_with_repeat_1_or_off():
    merged = small_graph(0)
    assert len(merged) == 5 and merged.links[2] == [3] and merged.merges == 1  # d links to b
    for repeat in (1, -1):
        g = small_graph(repeat)
        assert len(g) == 6 and g.merges == 0 and not any(g.links)


def test_the_preceding_tokens_must_match_for_repeat_1():
    g = Graph(9, 1)
    a, d = g.add(0, 1, 0.9), g.add(0, 5, 0.5)
    b = g.add(a, 2, 0.8)
    x = g.add(d, 7, 0.5)
    assert g.add(b, 4, 0.5) is not None
    assert g.add(x, 2, 0.5) is not None  # 2 after 7: b's 2 follows 1
    y = g.add(d, 1, 0.4)  # d -> 1: the same token as a, whose preceding token (the root's 9) differs from d's 5
    assert y is not None
    assert g.add(y, 2, 0.3) is None and g.links[y] == [b]  # 1 -> 2 recurs: y links to b, b's subtree reused
    assert g.merge_target(b, 2) is None  # b itself holds 2: a node never links to its own path


def test_unrolling_copies_a_linked_subgraph_under_the_linking_node():
    g = small_graph(0)  # d links to b, whose child is c
    tree, origin, own = g.unroll(max_nodes=100, max_depth=10)
    assert tree.tokens == [9, 1, 5, 2, 2, 3, 3]
    assert tree.parent == [-1, 0, 0, 1, 2, 3, 4] and tree.depth == [0, 1, 1, 2, 2, 3, 3]
    assert origin == [0, 1, 2, 3, 3, 4, 4] and own == [True, True, True, True, False, True, False]
    capped, _, _ = g.unroll(max_nodes=4, max_depth=10)
    assert len(capped) == 4
    shallow, _, _ = g.unroll(max_nodes=100, max_depth=2)
    assert shallow.max_depth == 2 and len(shallow) == 5


def test_a_cycle_of_links_unrolls_within_the_bounds():
    g = Graph(0, 0)
    a, b = g.add(0, 1, 0.9), g.add(0, 2, 0.9)
    a2 = g.add(a, 3, 0.9)
    b2 = g.add(b, 4, 0.9)
    assert g.add(a2, 4, 0.9) is None and g.add(b2, 3, 0.9) is None  # a2 -> b2 and b2 -> a2: a cycle
    tree, _, _ = g.unroll(max_nodes=100, max_depth=12)
    assert len(tree) == 1 + 2 + 2 * 11 and tree.max_depth == 12  # two nodes at every depth from 1 to 12
    tree, _, _ = g.unroll(max_nodes=9, max_depth=100)
    assert len(tree) == 9


# --------------------------------------------------------------------------------------------- drafting


def test_each_drafted_node_holds_the_drafts_top_tokens_after_its_own_path(good_pair, looping_prompt):
    """The draft reads a level in one forward under a tree mask: each expanded node's candidates (children and
    links) must be the draft's top tokens after that node's real path, scored as a plain sequence."""
    method = build(good_pair, "gsd", repeat=0, sibling_ratio=0.0, leaf_prob=0.0, top_k=3, max_depth=3)
    ids = torch.tensor([looping_prompt])
    state = method.State(method, ids, 40, Sampling(0.0), None, lambda n: None)
    with torch.no_grad():
        good_pair.target(ids, state.cache, logits_to_keep=1)
        forwards_run(method.start(state))
        state.commit([looping_prompt[-1]], drafted=None)
        forwards_run(method.propose(state))
        g = state.graph
        assert g.merges > 0 and len(state.read) > 3
        for v in [0, *state.read]:
            path = g.tree.path_to(v)
            seq = state.seq + [g.tree.tokens[u] for u in path[1:]]
            top = good_pair.draft.module(torch.tensor([seq])).logits[0, -1].topk(3).indices.tolist()
            proposed = [g.tree.tokens[c] for c in g.tree.children[v]] + [g.tree.tokens[n] for n in g.links[v]]
            assert sorted(proposed) == sorted(top), v


MERGING = {"sibling_ratio": 0.0, "top_k": 3, "leaf_prob": 0.0, "max_depth": 3, "max_nodes": 40}  # wide: merges happen


@pytest.mark.parametrize("repeat", [0, 1, -1])
def test_lossless_with_and_without_merging(good_pair, tiny_pair, looping_prompt, repeat):
    for pair in (tiny_pair, good_pair):
        method = build(pair, "gsd", repeat=repeat, **MERGING)
        assert_greedy_equal_to_ar(method, prompts_for(pair, 2) + [looping_prompt])
        merges = run(method, looping_prompt, 32).extra["merges_per_step"]
        assert (merges > 0) if repeat >= 0 else (merges == 0)
    # The sampler's check decodes a few tokens (a depth-1 tree, no links): that the unrolled tree, links and
    # all, is verified exactly is verify_tree's exactness for deterministic candidates on any tree (test_tree.py).
    assert_sampling_is_the_targets(build(good_pair, "gsd", repeat=repeat, leaf_prob=0.05), looping_prompt)


def test_merges_are_scored_and_the_draft_cache_kept_right(good_pair, looping_prompt):
    """With merging on a repetitive prompt (greedy) the target scores reused copies (more tree nodes than graph
    nodes), a step is accepted through a link (so the draft re-reads what it computed in another context), one target forward per step, and afterwards the draft's cache equals one
    plain pass of the draft over the committed text."""
    pair = dataclasses.replace(good_pair, roles={})
    method = build(pair, "gsd", repeat=0, **MERGING)
    pair.reset_counts()
    out, state = run_keeping_state(method, looping_prompt, 40)
    counts = pair.counts()
    assert out.output_ids == run(build(pair, "ar"), looping_prompt, 40).output_ids
    e = out.extra
    assert e["merges_per_step"] > 0 and e["reused_nodes_per_step"] > 0
    assert e["steps_accepted_through_a_link"] > 0
    assert counts["target"]["calls"] == len(out.accept_lengths) + 1
    assert counts["draft"]["calls"] == 1 + state.tally["draft_forwards"]  # the prefill, then the levels
    assert_cache_is_a_plain_pass(pair.draft.module, state.dcache, looping_prompt, looping_prompt + out.output_ids)


def test_a_perfect_draft_has_its_chain_accepted(tiny_pair, looping_prompt):
    pair = with_drafts(tiny_pair, tiny_pair.target.module)
    out = run(build(pair, "gsd", max_depth=4, leaf_prob=0.0, repeat=-1), looping_prompt, 31)
    assert out.accept_lengths[:-1] == [5] * (len(out.accept_lengths) - 1)


# Bad values of every gsd setting (type, range, NaN) are refused in one sentence by tests/bench/test_schema.py's walk.
