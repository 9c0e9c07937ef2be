"""Token Recycling (methods/recycling.py): the tree filled from the adjacency matrix, every scored node's row
recycled from the same forward, per-prompt or carried matrices, the settings' rules. Greedy equality with ar
and the sampling distribution are checked for every method by tests/methods/test_methods.py."""

import pytest
import torch

from core.errors import BenchError
from methods.recycling import TEMPLATE_2_2_2
from tests.helpers import build, method_cfg, prompts_for, run, run_keeping_state


def test_the_papers_template_has_80_nodes_six_deep():
    from decoding.tree import Tree

    shape = Tree.from_paths(TEMPLATE_2_2_2)
    assert len(shape) == 81 and shape.max_depth == 6  # 80 nodes and the root
    assert max(max(p) for p in TEMPLATE_2_2_2) == 7  # ranks 0..7: the paper's k = 8


def test_the_tree_is_filled_breadth_first_from_the_matrix(tiny_pair):
    """Node (r1, ..., rd) holds M[token of (r1, ..., r(d-1)), rd], the root the pending token."""
    method = build(tiny_pair, "recycling", tree=[[0], [1], [0, 0], [0, 2], [1, 1], [0, 0, 3]], topk=4)
    gen = torch.Generator().manual_seed(0)
    matrix = torch.randint(0, 50, (64, 4), generator=gen)
    tokens = method.fill(matrix, 7, method.shape)
    by_path = dict(zip(method.shape.paths, tokens))
    assert by_path[()] == 7
    for path, token in by_path.items():
        if path:
            assert token == int(matrix[by_path[path[:-1]], path[-1]]), path


def test_every_scored_node_recycles_its_top_k_into_its_tokens_row(tiny_pair, looping_prompt):
    """After a step, the row of each token the target scored is that node's top-k from the same forward (the
    last node's when a token appears twice); rows of tokens not scored stay as they were."""
    method = build(tiny_pair, "recycling", topk=4, tree=[[0], [1], [2], [3], [0, 0], [1, 0]])
    seen = []
    real_verify = type(method).verify

    def spy(state, proposal, logits):
        before = state.matrix.clone()
        out = real_verify(method, state, proposal, logits)
        seen.append((before, state.matrix.clone(), list(proposal.tree.tokens), logits.clone()))
        return out

    method.verify = spy
    run(method, looping_prompt[:20], 8)
    assert seen
    for before, after, tokens, logits in seen:
        last = {t: v for v, t in enumerate(tokens)}
        for t, v in last.items():
            assert torch.equal(after[t], logits[v].topk(4).indices), (t, v)
        untouched = torch.ones(len(after), dtype=torch.bool)
        untouched[list(last)] = False
        assert torch.equal(after[untouched], before[untouched])


def test_each_prompt_starts_from_an_empty_matrix_unless_carried(tiny_pair):
    """Per prompt (the default): a prompt decodes the same whatever ran before it. carry: true keeps one matrix,
    so the same prompt run again starts from what the first run recycled and accepts more."""
    a, b = prompts_for(tiny_pair, 2)
    fresh = build(tiny_pair, "recycling")
    alone = run(fresh, a, 32)
    run(fresh, b, 32)
    again = run(fresh, a, 32)
    assert again.accept_lengths == alone.accept_lengths and again.output_ids == alone.output_ids
    assert alone.extra["matrix"] == "per prompt"

    carried = build(tiny_pair, "recycling", carry=True)
    first, state = run_keeping_state(carried, a, 32)
    assert carried.carried is state.matrix and first.accept_lengths == alone.accept_lengths  # empty at the start
    second, state = run_keeping_state(carried, a, 32)
    assert state.matrix is carried.carried and second.extra["matrix"] == "carried"
    assert second.output_ids == first.output_ids  # lossless either way
    mean = [sum(out.accept_lengths) / len(out.accept_lengths) for out in (first, second)]
    assert mean[1] > mean[0]


@pytest.mark.parametrize("settings, message", [
    ({"tree": "9.9.9"}, "tree '9.9.9' is not a known template"),
    ({"topk": 4, "tree": "2.2.2"}, "uses rank 7 but the matrix keeps only topk=4"),
    ({"topk": 1}, "uses rank 1 but the matrix keeps only topk=1"),
    ({"tree": [[0], [0, 5]], "topk": 5}, "uses rank 5 but the matrix keeps only topk=5"),
])
def test_bad_settings_are_one_sentence(settings, message):
    with pytest.raises(BenchError, match=message):
        method_cfg("recycling", **settings)


def test_a_token_on_several_nodes_keeps_the_last_nodes_row(tiny_pair):
    """The update is deterministic: a token scored at several nodes gets the last node's top-k (as the authors'
    dict update leaves it)."""
    from types import SimpleNamespace

    from decoding.sampling import Sampling
    from methods.base import Proposal

    method = build(tiny_pair, "recycling", topk=2, tree=[[0], [1], [0, 0]])
    vocab = 64
    tree = method.shape.fill([5, 9, 9, 9])  # token 9 at nodes 1, 2 (depth 1) and 3 (depth 2)
    logits = torch.zeros(4, vocab)
    for node, best in enumerate(([9, 3], [1, 2], [4, 6], [7, 8])):
        logits[node, best] = torch.tensor([2.0, 1.0])
    state = SimpleNamespace(matrix=torch.zeros(vocab, 2, dtype=torch.long), sampling=Sampling(), generator=None)
    path, nxt = method.verify(state, Proposal(tree), logits)
    assert state.matrix[5].tolist() == [9, 3] and state.matrix[9].tolist() == [7, 8]
    assert path == [0, 1] and nxt == 1  # and the greedy verification as usual: 9 accepted, then the target's 1


def test_the_prompts_own_top_k_fills_the_matrix_first(tiny_pair, looping_prompt):
    """from_prompt (the default): the prefill's top-k at every prompt position is its token's row before the first
    step (the last position's, for a token the prompt repeats); from_prompt: false starts from an empty matrix."""
    ids = looping_prompt[:24]
    small = [[0], [1], [0, 0]]
    _, state = run_keeping_state(build(tiny_pair, "recycling", topk=4, tree=small), ids, 1)  # the prefill only
    with torch.no_grad():
        logits = tiny_pair.target.module(torch.tensor([ids])).logits[0]
    last = {t: i for i, t in enumerate(ids)}
    assert len(last) < len(ids)  # the prompt repeats tokens: the rule for them is exercised
    for t, i in last.items():
        assert torch.equal(state.matrix[t], logits[i].topk(4).indices), (t, i)
    _, state = run_keeping_state(build(tiny_pair, "recycling", topk=4, tree=small, from_prompt=False), ids, 1)
    assert not state.matrix.any()
