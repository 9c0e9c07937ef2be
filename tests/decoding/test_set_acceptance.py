"""decoding.set_acceptance: a synthetic target keeps each drafted token with the set probability, chain or tree,
and every verifier reads its choice from the rewritten logits."""

import json

import pytest
import torch
from scipy.stats import binomtest

from decoding.sampling import Sampling
from decoding.set_acceptance import SetAcceptance
from decoding.tree import Tree
from decoding.verify import verify_chain, verify_tree

GREEDY = Sampling(0.0, 1.0)
VOCAB = 50


def chain_accepted(coin: SetAcceptance, depth: int, seed: int) -> int:
    """Accepted length of one chain of ``depth`` drafted tokens, verified greedily on rewritten random logits."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (depth,), generator=g)
    tree = Tree.chain(0, tokens.tolist())
    logits = coin.rewrite(tree, torch.randn(depth + 1, VOCAB, generator=g))
    n, _ = verify_chain(tokens, None, logits, GREEDY)
    return n


@pytest.mark.parametrize("rate", [0.3, 0.7])
def test_a_chain_keeps_each_token_with_the_set_probability(rate):
    coin, tried, kept = SetAcceptance(rate, seed=1), [0] * 4, [0] * 4
    for seed in range(1500):
        n = chain_accepted(coin, 4, seed)
        for i in range(min(n + 1, 4)):  # position i was tried when the i before it were kept
            tried[i] += 1
            kept[i] += i < n
    for i in range(4):
        assert binomtest(kept[i], tried[i], rate).pvalue > 1e-3, (i, kept[i], tried[i])


@pytest.mark.parametrize("rate,expected", [(0.0, 0), (1.0, 5)])
def test_never_and_always(rate, expected):
    coin = SetAcceptance(rate)
    assert all(chain_accepted(coin, 5, seed) == expected for seed in range(20))


def test_a_tree_tries_its_children_in_order():
    """Three children at the root: one is kept with probability 1 - (1 - a)^3, the first child a of the time."""
    rate, trials, first, any_ = 0.4, 3000, 0, 0
    coin = SetAcceptance(rate, seed=2)
    for seed in range(trials):
        tree = Tree(0)
        for token in (5, 6, 7):
            tree.add_child(0, token)
        logits = coin.rewrite(tree, torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(seed)))
        path, nxt = verify_tree(tree, logits, GREEDY)
        any_ += len(path) > 1
        first += path[1:] == [1]
        if len(path) == 1:  # none kept: the target's own best other token
            assert nxt not in (5, 6, 7)
    assert binomtest(any_, trials, 1 - (1 - rate) ** 3).pvalue > 1e-3
    assert binomtest(first, trials, rate).pvalue > 1e-3


def test_rows_cut_by_logits_to_keep_are_the_last_nodes():
    tree = Tree.chain(0, [3, 4, 5])
    logits = torch.zeros(2, VOCAB)  # the rows of nodes 2 and 3 only
    out = SetAcceptance(1.0).rewrite(tree, logits)
    assert out[0].argmax() == 5 and torch.equal(out[1], logits[1])  # node 3 has no child: left as computed
    assert torch.equal(logits, torch.zeros(2, VOCAB))  # the input is not changed


def test_a_synthetic_run_accepts_everything_or_nothing(compose_cfg, tmp_path):
    from bench.runner import run

    for rate in (0.0, 1.0):
        out = tmp_path / str(rate)
        run(compose_cfg("method=sd", "pair=synthetic", "pair.shape=tiny", f"pair.acceptance={rate}", "max_new_tokens=24",
                        "dataset.n_prompts=1", "warmup=0"), out)
        recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        sd = next(r for r in recs if r["method"] == "sd")
        assert sd["synthetic"] and sd["acceptance_set"] == rate and sd["matches_baseline"] is None
        assert sd["new_tokens"] == 24  # no EOS on a synthetic pair: the whole budget
        steps = list(zip(sd["accept_lengths"], sd["drafted"]))
        if rate == 0.0:
            assert all(a == 1 for a, _ in steps)
        else:
            assert all(a == d + 1 for a, d in steps[:-1])


@pytest.mark.parametrize("args,said", [
    (["method=medusa", "method.weights=FasterDecoding/medusa-vicuna-7b-v1.3"],
     "method.weights=FasterDecoding/medusa-vicuna-7b-v1.3 reads published weights trained for a real target, which "
     "pair=synthetic-tiny-a0.7 (random weights) is not;"),
    (["method=samd", "method.aux=eagle", "method.eagle.weights=yuhuili/EAGLE-Vicuna-7B-v1.3"],
     "method.eagle.weights=yuhuili/EAGLE-Vicuna-7B-v1.3 reads published weights"),
    (["method=rest", "method.datastore=answers"], "method.datastore=answers retrieves the target's answers from its "
     "teacher store, which pair=synthetic-tiny-a0.7 (random weights) never labels;"),
    (["method=sd", "temperature=0.7"], "sets the target's greedy choice by its acceptance; run it with temperature=0."),
    (["method=sd", "pair.shape=gpt-9"], "unknown shape 'gpt-9'; the shapes are smollm2-135m,"),
])
def test_what_a_synthetic_pair_cannot_run_is_one_sentence(args, said, capsys):
    from bench.__main__ import main

    assert main(["run", "pair=synthetic", "pair.shape=tiny", *args]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_acceptance_on_a_real_pair_is_one_sentence(capsys):
    from bench.__main__ import main

    assert main(["run", "pair=tiny", "pair.acceptance=0.5"]) == 2
    assert "acceptance and shape are settings of a synthetic pair" in capsys.readouterr().err


@pytest.mark.parametrize("what", [["method", "method=medusa"], ["store"], ["draft"]])
def test_training_on_a_synthetic_pair_is_one_sentence(what, capsys):
    from bench.__main__ import main

    assert main(["train", *what, "pair=synthetic", "pair.shape=tiny"]) == 2
    err = capsys.readouterr().err
    assert f"has random weights, which teach nothing: 'train {what[0]}' trains nothing there" in err, err
    assert len(err.strip().splitlines()) == 1
