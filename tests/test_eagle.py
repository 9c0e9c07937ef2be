"""EAGLE-2 beyond the registry walk (``tests/test_methods.py`` covers its defaults): the chain mode's lossless
sampling, the draft cache holding true features only, the dynamic tree's expand-and-rerank, and bad input."""

import json

import pytest
import torch
from transformers import DynamicCache

from bench.errors import BenchError
from methods.eagle import Eagle
from tests.helpers import (
    assert_greedy_equal_to_ar,
    assert_sampling_is_the_targets,
    build,
    decode,
    noisy_copy,
    prompts_for,
    repeating_prompt,
    run,
    with_drafts,
)


@pytest.fixture(scope="module")
def looping_prompt(tiny_pair):
    ids = repeating_prompt(tiny_pair)
    return ids + decode(tiny_pair, "ar", ids, max_new=30).output_ids


@pytest.mark.parametrize("overrides", [{"draft": "chain", "gamma": 4}, {"top_k": 1, "total_tokens": 4},
                                       {"top_k": 3, "depth": 5, "total_tokens": 12}])
def test_chain_and_other_trees_are_lossless(tiny_pair, looping_prompt, overrides):
    method = build(tiny_pair, "eagle", **overrides)
    assert_greedy_equal_to_ar(method, prompts_for(tiny_pair, 2) + [looping_prompt])
    if overrides.get("draft") == "chain":  # sampled from the draft's own q, verified by speculative sampling
        assert_sampling_is_the_targets(method, looping_prompt)


def test_the_draft_cache_holds_the_targets_true_features_only(tiny_pair, looping_prompt):
    """After many steps (guessed features dropped, true ones read), the draft's cache of the committed positions
    equals one pass of the draft over the target's features of the whole text."""
    method = build(tiny_pair, "eagle")
    out = run(method, looping_prompt, 20)
    seq = looping_prompt + out.output_ids
    read = method.read  # what the last step had read
    with torch.no_grad():
        feats = tiny_pair.target.module(torch.tensor([seq[:read]]), output_hidden_states=True).hidden_states[-1]
        fresh = DynamicCache()
        method.draft.module(feats, method.embed(torch.tensor([seq[1 : read + 1]])), fresh)
    mine, ref = method.cache.layers[0], fresh.layers[0]
    assert sum(a > 1 for a in out.accept_lengths) >= 2  # guesses were accepted and read again as true features
    torch.testing.assert_close(mine.keys[..., :read, :], ref.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mine.values[..., :read, :], ref.values, atol=1e-4, rtol=1e-4)


def test_the_dynamic_tree_expands_and_reranks_by_cumulative_probability(tiny_pair, looping_prompt, monkeypatch):
    """Each level expands the top_k nodes of the newest level by cumulative draft log-probability; the target
    scores the best total_tokens of all drafted nodes (a tree: every kept node's parent is kept)."""
    method = build(tiny_pair, "eagle", top_k=3, depth=4, total_tokens=7)
    drafted, kept = [], []
    grow, tree = Eagle.grow, Eagle.tree

    def record_grow(self, t, score, parents, logp, k):
        if parents == [0]:
            drafted.append((t, score, []))
        drafted[-1][2].append(list(parents))
        return grow(self, t, score, parents, logp, k)

    def record_tree(self, st, feat, logits, depth):
        draft = tree(self, st, feat, logits, depth)
        kept.append(draft.tree)
        return draft

    monkeypatch.setattr(Eagle, "grow", record_grow)
    monkeypatch.setattr(Eagle, "tree", record_tree)
    run(method, looping_prompt, 24)
    full = [(d, out) for d, out in zip(drafted, kept) if len(d[2]) == 4]  # not cut short by the token budget
    assert len(full) >= 3
    for (t, score, expanded), out in full:
        assert len(t) == 1 + 3 + 3 * 9 and [len(e) for e in expanded] == [1, 3, 3, 3]
        for before, parents in zip(expanded, expanded[1:]):  # the top 3 of the level the previous one opened
            level = [v for v in range(len(t)) if t.parent[v] in before]
            assert sorted(parents) == sorted(sorted(level, key=lambda v: -score[v])[:3])
        best = sorted(range(1, len(t)), key=lambda v: (-score[v], v))[:6]
        assert len(out) == 7 and sorted(out.tokens[1:]) == sorted(t.tokens[v] for v in best)
        assert all(t.parent[v] in best or t.parent[v] == 0 for v in best)


def test_bad_input_is_one_sentence(compose_cfg, capsys):
    from bench.__main__ import main

    assert main(["run", "pair=tiny", "method=eagle", "recipe.store.hidden=false"]) == 2
    assert "method=eagle reads the target's hidden states" in capsys.readouterr().err
    assert main(["run", "pair=tiny", "method=eagle", "method.draft=graph"]) == 2
    assert "method.draft='graph' is not allowed; it takes one of: tree, chain" in capsys.readouterr().err


def test_a_draft_layer_built_for_another_target_is_refused(compose_cfg, tmp_path):
    from bench.models import load_pair

    pair = load_pair(compose_cfg("pair=tiny", f"cache_dir={tmp_path}"))
    method = build(pair, "eagle")
    assert method.report["agreement_after"] >= 0 and method.report["recipe"] == "smoke"
    (folder,) = [p for p in (tmp_path / "eagle").iterdir() if p.is_dir()]
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["key"]["target"]["weights"] = "0" * 16  # files copied in from another target's cache
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BenchError, match=r"EAGLE draft layer at .* was built for something else \(its "
                                         r"target.weights differs\)"):
        Eagle(Eagle.settings({}), pair).setup(train_if_missing=False)


def test_it_runs_on_a_pair_whose_draft_is_good(tiny_pair):
    """The draft pair's models are not EAGLE's (it trains its own layer): a pair with other drafts decodes the
    same."""
    pair = with_drafts(tiny_pair, noisy_copy(tiny_pair.target.module))
    ids = prompts_for(pair, 1)[0]
    assert run(build(pair, "eagle"), ids, 16).output_ids == decode(pair, "ar", ids, max_new=16).output_ids
