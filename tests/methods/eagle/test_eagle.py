"""EAGLE-2 beyond the registry walk (``tests/methods/test_methods.py`` covers its defaults): the chain mode's lossless
sampling, the draft cache holding true features only, the dynamic tree's expand-and-rerank, and bad input."""

import copy
import json

import pytest
import torch
from transformers import DynamicCache

from core.errors import BenchError
from methods.eagle.eagle import Eagle
from tests.helpers import (
    assert_greedy_equal_to_ar,
    assert_sampling_is_the_targets,
    build,
    decode,
    noisy_copy,
    prompts_for,
    run,
    run_keeping_state,
    with_drafts,
)


@pytest.mark.parametrize("overrides", [{"draft": "chain", "gamma": 4}, {"top_k": 1, "total_tokens": 4},
                                       {"top_k": 3, "depth": 5, "total_tokens": 12}])
def test_chain_and_other_trees_are_lossless(tiny_pair, looping_prompt, overrides):
    """Greedy: equal to ar whatever is drafted. Sampling: the chain's tokens are drawn from the draft's own q
    (speculative sampling), a wider tree's are a deterministic top-k (recursive rejection sampling)."""
    method = build(tiny_pair, "eagle", **overrides)
    assert_greedy_equal_to_ar(method, prompts_for(tiny_pair, 2) + [looping_prompt])
    if overrides.get("top_k") != 1:
        assert_sampling_is_the_targets(method, looping_prompt)


def test_the_tree_forward_equals_a_plain_pass_along_each_path(tiny_pair, looping_prompt, monkeypatch):
    """The draft scores a whole level of its tree in one forward (tree mask, positions by depth): each node's
    distribution equals the one a plain causal pass of the draft along that node's path gives."""
    method = build(tiny_pair, "eagle", top_k=3, depth=4, total_tokens=7)
    seen, grow, tree = {}, Eagle.grow, Eagle.tree

    def record_tree(self, state, feat, logits, depth):  # the first step's tree only (a generator, as Eagle.tree)
        if not seen:
            seen.update(cache=copy.deepcopy(state.dcache), feat=feat.clone(), levels=[], active=True)
        draft = yield from tree(self, state, feat, logits, depth)
        seen["active"] = False
        return draft

    def record_grow(self, t, score, parents, logp, k):
        if seen.get("active"):
            seen["tree"] = t
            seen["levels"].append((list(parents), logp.clone()))
        return grow(self, t, score, parents, logp, k)

    monkeypatch.setattr(Eagle, "tree", record_tree)
    monkeypatch.setattr(Eagle, "grow", record_grow)
    run(method, looping_prompt, 12)
    t, checked = seen["tree"], 0
    with torch.inference_mode():
        for parents, logp in seen["levels"][1:]:  # level 0 is the catch-up's, read over the committed text
            for row, v in enumerate(parents):
                cache, feat = copy.deepcopy(seen["cache"]), seen["feat"]
                for u in t.path_to(v)[1:]:  # the path's tokens, each with the guess before it, one at a time
                    out, logits = method.draft(feat[None, None], method.embed(torch.tensor([[t.tokens[u]]])), cache,
                                               rows=1)
                    feat = out[0, -1]
                torch.testing.assert_close(torch.log_softmax(logits[0, -1].float(), -1), logp[row], atol=1e-4,
                                           rtol=1e-4)
                checked += 1
    assert checked == 9  # three levels of three expanded nodes


def test_the_draft_cache_holds_the_targets_true_features_only(tiny_pair, looping_prompt):
    """After many steps (guessed features dropped, true ones read), the draft's cache of the committed positions
    equals one pass of the draft over the target's features of the whole text."""
    method = build(tiny_pair, "eagle")
    out, state = run_keeping_state(method, looping_prompt, 20)
    seq = looping_prompt + out.output_ids
    read = state.read  # what the last step had read
    with torch.no_grad():
        feats = tiny_pair.target.module(torch.tensor([seq[:read]]), output_hidden_states=True).hidden_states[-1]
        fresh = DynamicCache()
        method.draft.module(feats, method.embed(torch.tensor([seq[1 : read + 1]])), fresh)
    mine, ref = state.dcache.layers[0], fresh.layers[0]
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

    def record_tree(self, state, feat, logits, depth):  # a generator, as Eagle.tree
        proposal = yield from tree(self, state, feat, logits, depth)
        kept.append(proposal.tree)
        return proposal

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
        paths = sorted(tuple(t.tokens[u] for u in t.path_to(v)[1:]) for v in best)  # token paths from the root
        assert len(out) == 7 and sorted(tuple(out.tokens[u] for u in out.path_to(v)[1:]) for v in range(1, 7)) == paths


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
    assert 0 <= method.report["answer_token_agreement"] <= 1  # on the held-out answers' tokens alone
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
