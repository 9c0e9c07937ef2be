"""The one token tree (decoding/tree.py) and the tree verifier (decoding/verify.py): scoring in one forward,
keeping the accepted path's cache, and walking the tree losslessly, greedy and sampled."""

import pytest
import torch
from scipy.stats import chisquare
from transformers import DynamicCache

from core.errors import BenchError
from decoding.sampling import Sampling, probs_from_logits
from decoding.tree import Tree, keep_path, score_tree
from decoding.verify import verify_tree


def random_tree(paths, seed):
    shape = Tree.from_paths(paths)
    return shape.fill(torch.randint(0, 259, (len(shape),), generator=torch.Generator().manual_seed(seed)).tolist())


def test_tree_logits_equal_each_path_scored_alone(tiny_pair):
    """Every tree node's logits equal those of its root path scored as a plain sequence after the prefix."""
    target = tiny_pair.target
    prefix = torch.randint(0, 259, (1, 11), generator=torch.Generator().manual_seed(0))
    tree = random_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 2]], seed=0)
    with torch.no_grad():
        cache = DynamicCache()
        target(prefix, cache)
        logits, hidden = score_tree(target, cache, tree, hidden=True)
        for node in range(len(tree)):
            seq = torch.tensor([prefix[0].tolist() + [tree.tokens[v] for v in tree.path_to(node)]])
            plain = target.module(seq, output_hidden_states=True)
            torch.testing.assert_close(logits[node], plain.logits[0, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden[node], plain.hidden_states[-1][0, -1], atol=1e-4, rtol=1e-4)


def test_cache_after_acceptance_equals_cache_of_accepted_sequence(tiny_pair):
    target = tiny_pair.target
    prefix = torch.randint(0, 259, (1, 9), generator=torch.Generator().manual_seed(1))
    tree = random_tree([[0], [1], [2], [0, 0], [1, 0], [1, 1], [1, 1, 0]], seed=1)
    path = tree.path_to(len(tree) - 1)  # root -> [1] -> [1, 1] -> [1, 1, 0]: not a prefix of the node order
    with torch.no_grad():
        cache = DynamicCache()
        target(prefix, cache)
        score_tree(target, cache, tree)
        keep_path(cache, prefix.shape[1], path)
        plain = DynamicCache()
        target(torch.tensor([prefix[0].tolist() + [tree.tokens[v] for v in path]]), plain)
    assert cache.get_seq_length() == plain.get_seq_length() == prefix.shape[1] + len(path)
    for a, b in zip(cache.layers, plain.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


def test_candidates_merge_into_a_trie_and_shapes_prune_by_depth():
    tree = Tree(9)
    assert tree.add([1, 2, 3], "context") == 3
    assert tree.add([1, 2, 4], "model") == 1  # the shared prefix is stored once, its first source kept
    assert tree.add([1, 2], "statistics") == 0
    assert tree.tokens == [9, 1, 2, 3, 4] and tree.parent == [-1, 0, 1, 2, 2] and tree.source[3:] == ["context", "model"]
    assert not tree.is_chain and Tree.chain(9, [1, 2]).is_chain and Tree(9).is_chain and tree.max_depth == 3
    shape = Tree.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    assert shape.prune(1).paths == ((), (0,), (1,)) and shape.prune(1).children == [[1, 2], [], []]
    for bad, words in [([[0], [1, 0]], "no parent"), ([[0], [-1]], "ranks >= 0"), ([[0], [0]], "twice"), ("x", "list of lists")]:
        with pytest.raises(BenchError, match=words):
            Tree.from_paths(bad)


def test_greedy_walk_follows_the_targets_choices():
    tree = Tree.from_paths([[0], [1], [0, 0], [1, 0], [1, 1]]).fill([7, 3, 4, 5, 6, 8])  # nodes: (), (0), (1), ...
    logits = torch.zeros(6, 10)
    logits[0, 4] = logits[2, 8] = logits[5, 9] = 1  # target: 7 -> 4 (node 2) -> 8 (node 5) -> 9
    assert verify_tree(tree, logits, Sampling()) == ([0, 2, 5], 9)
    logits[0] = 0
    logits[0, 1] = 1  # no child carries 1: nothing accepted, the target's 1 follows
    assert verify_tree(tree, logits, Sampling()) == ([0], 1)


def first_token_counts(make_tree, p_logits, sampling, n, seed, draft_probs=None):
    """Histogram of the first committed token over ``n`` verifications of freshly drafted trees."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p_logits.shape[-1])
    for _ in range(n):
        tree = make_tree(gen)
        logits = p_logits.expand(len(tree), -1)  # every node: the same target distribution, enough here
        path, nxt = verify_tree(tree, logits, sampling, gen, draft_probs(tree) if draft_probs else None)
        counts[tree.tokens[path[1]] if len(path) > 1 else nxt] += 1
    return counts


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_deterministic_candidates_keep_the_target_distribution(temperature, top_p):
    """Recursive rejection sampling over a node's children (one-hot q): the committed token is exactly p."""
    sampling = Sampling(temperature, top_p)
    p_logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(0)) * 1.5
    p = probs_from_logits(p_logits[0], sampling)

    def make_tree(gen):  # three fixed candidates, each with a child (as Medusa's top-k under a root)
        return Tree.from_paths([[0], [1], [2], [0, 0], [1, 0]]).fill([5, 0, 2, 3, 1, 4])

    counts = first_token_counts(make_tree, p_logits, sampling, 12000, seed=1)
    keep = p > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep].numpy(), (p[keep] * counts.sum()).numpy()).pvalue > 1e-3
    # Power: committing the first candidate whenever p gives it any mass would be far off.
    assert counts[0] < 12000 * (float(p[0]) + 0.05)


def test_independently_drawn_siblings_keep_the_target_distribution():
    """SpecInfer's setting: siblings are i.i.d. draws from the draft's q; the committed token is exactly p."""
    sampling = Sampling(1.0, 1.0)
    g = torch.Generator().manual_seed(2)
    p_logits = torch.randn(1, 6, generator=g) * 1.5
    q = torch.softmax(torch.randn(6, generator=g) * 1.5, -1)

    def make_tree(gen):
        tree = Tree(5)
        for tok in torch.multinomial(q, 3, replacement=True, generator=gen).tolist():
            tree.add_child(0, tok, merge=False)  # duplicates stay separate draws
        return tree

    counts = first_token_counts(make_tree, p_logits, sampling, 12000, seed=3, draft_probs=lambda t: q.expand(len(t), -1))
    p = probs_from_logits(p_logits[0], sampling)
    assert chisquare(counts.numpy(), (p * counts.sum()).numpy()).pvalue > 1e-3


def test_side_rows_read_their_own_sequences_and_leave_the_tree_and_its_cache_alone(tiny_pair):
    """Side rows (Lookahead's window) scored in the tree's forward: each side row's logits equal its visible rows
    (the root, then the side rows it attends to, in order, each at its offset) scored as a plain sequence; the
    tree's rows equal the tree scored alone; after keep_path the cache is the accepted path's, side rows gone;
    the output head runs (and is counted) on the tree's rows and the kept side rows only."""
    from decoding.tree import SideRows

    target = tiny_pair.target
    prefix = torch.randint(0, 259, (1, 10), generator=torch.Generator().manual_seed(2))
    tree = random_tree([[0], [1], [0, 0]], seed=2)
    allowed = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    side = SideRows([5, 6, 7, 8], [1, 2, 2, 3], allowed, keep=[3, 0, 2])
    with torch.no_grad():
        alone, cache = DynamicCache(), DynamicCache()
        target(prefix, alone)
        target(prefix, cache)
        expected, _ = score_tree(target, alone, tree)
        before = target.stats()["flops"]
        logits, _ = score_tree(target, cache, tree, side=side)
        spent = target.stats()["flops"] - before
        torch.testing.assert_close(logits[: len(tree)], expected, atol=1e-4, rtol=1e-4)
        for row, k in enumerate(side.keep):
            visible = [j for j in range(4) if allowed[k, j]]
            assert [side.offsets[j] for j in visible] == list(range(1, len(visible) + 1))  # a plain sequence
            seen = [tree.tokens[0]] + [side.tokens[j] for j in visible]
            plain = target.module(torch.tensor([prefix[0].tolist() + seen])).logits[0, -1]
            torch.testing.assert_close(logits[len(tree) + row], plain, atol=1e-4, rtol=1e-4)
        path = [0, 1, 3]
        keep_path(cache, prefix.shape[1], path)
        keep_path(alone, prefix.shape[1], path)
    assert logits.shape[0] == len(tree) + 3
    for a, b in zip(cache.layers, alone.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
    one_row = 2.0 * target.head_weights
    all_rows = target.formula(len(tree) + 4, prefix.shape[1] + len(tree) + 4)
    assert spent == pytest.approx(all_rows - one_row)  # 8 rows read, 7 through the output head
