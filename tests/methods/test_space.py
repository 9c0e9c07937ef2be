"""SPACE beyond the registry walk (``tests/methods/test_methods.py`` covers its defaults), on the tiny pair: the auto-correct
layout scores exactly as plain sequential forwards, greedy equality for several k, one target forward per step
with only committed text left in the KV cache, training that leaves the target untouched, the cached artifact,
and bad input."""

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from core.errors import BenchError
from core.swapped_embeddings import swapped_embeddings
from decoding.tree import score_tree
from methods._space import group_logits, row_cache, train_space
from methods.space import MASK, Space, layout
from tests.helpers import assert_greedy_equal_to_ar, build, prompts_for, run
from training.recipes import RECIPES
from training.teacher import Teacher


@pytest.fixture()
def pair(tiny_pair):
    """The tiny pair with a role table of its own."""
    return dataclasses.replace(tiny_pair, roles={})


def untrained(pair, masks):
    """SPACE with random mask embeddings (no training): what the layout tests need."""
    method = Space(Space.settings({"masks": masks}), pair)
    gen = torch.Generator().manual_seed(masks)
    method.embeddings = torch.randn(masks, pair.target.module.config.hidden_size, generator=gen) * 0.1
    return method


def plain(method, ids):
    """Logits ``(len(ids), vocab)`` of one causal forward over ``ids`` (MASK entries: mask embeddings, in order)."""
    inputs = method.masked(ids)
    with torch.no_grad(), swapped_embeddings(method.pair.target, *inputs["swap"]):
        return method.pair.target.module(input_ids=inputs["input_ids"]).logits[0]


# --------------------------------------------------------------------------------------------- the layout


def test_the_layout_is_the_papers():
    tree, chain, groups = layout(7, [11, 12], 2)
    #          pending, G0 (2 masks), c0, G1, c1, G2
    assert tree.tokens == [7, MASK, MASK, 11, MASK, MASK, 12, MASK, MASK]
    assert chain == [0, 3, 6] and groups == [[1, 2], [4, 5], [7, 8]]
    assert tree.depth == [0, 1, 2, 1, 2, 3, 2, 3, 4]  # positions: past + depth
    anc = tree.ancestry()
    assert anc[5].nonzero().flatten().tolist() == [0, 3, 4, 5]  # group 1 sees pending, c0 and its own masks
    assert anc[6].nonzero().flatten().tolist() == [0, 3, 6]  # a candidate never sees a mask
    assert len(layout(7, [1, 2, 3, 4, 5], 5)[0]) == 36  # (k + 1)^2


@pytest.mark.parametrize("masks", [1, 3])
def test_one_forward_over_the_layout_scores_as_sequential_forwards(pair, masks):
    method = untrained(pair, masks)
    prompt = prompts_for(pair, 1)[0]
    pending, cands = prompt[-1], [5, 17, 33][:masks]
    tree, chain, groups = layout(pending, cands, masks)
    cache = DynamicCache()
    with torch.no_grad():
        pair.target(torch.tensor([prompt[:-1]]), cache)
        with swapped_embeddings(pair.target, *method.masked(tree.tokens)["swap"]):
            logits, _ = score_tree(pair.target, cache, tree.fill([0 if t == MASK else t for t in tree.tokens]))
    seq = plain(method, prompt + cands)
    torch.testing.assert_close(logits[chain], seq[len(prompt) - 1 :], atol=1e-4, rtol=1e-4)
    for j, group in enumerate(groups):  # the group after c_0 .. c_{j-1}: the context, then k masks, causally
        ref = plain(method, prompt + cands[:j] + [MASK] * masks)[-masks:]
        torch.testing.assert_close(logits[group], ref, atol=1e-4, rtol=1e-4)


def test_training_groups_score_as_decoding_does(pair):
    """Training's many groups over one row's cache give each group's logits of a plain forward."""
    method = untrained(pair, 3)
    ids = torch.tensor([prompts_for(pair, 1)[0][:20]])
    cuts = torch.tensor([[1, 6, 17]])
    with torch.no_grad():
        got = group_logits(pair.target.module, row_cache(pair.target.module, ids), cuts, method.embeddings)
    for i, n in enumerate(cuts[0].tolist()):
        ref = plain(method, ids[0, :n].tolist() + [MASK] * 3)[-3:]
        torch.testing.assert_close(got[0, i], ref, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("masks", [1, 2, 4])
def test_greedy_equals_ar(pair, masks):
    assert_greedy_equal_to_ar(build(pair, "space", masks=masks), prompts_for(pair, 2), max_new=24)


def test_one_target_forward_per_step_and_only_committed_text_cached(pair, looping_prompt, monkeypatch):
    method = build(pair, "space", masks=3)
    seen, real = [], Space.step

    def step(self, state, candidates):
        seen.append((state.cache.get_seq_length(), len(state.seq) - 1))  # the cache: committed text minus the pending token
        return real(self, state, candidates)

    monkeypatch.setattr(Space, "step", step)
    pair.target.reset()
    out = run(method, looping_prompt, 20)
    assert pair.target.calls == 1 + len(out.accept_lengths)  # the prefill (with the first masks), then one per step
    assert all(cached == committed for cached, committed in seen)
    assert out.extra["tokens_per_call"] <= 16 and len(out.extra["acceptance_by_mask"]) == 3


# --------------------------------------------------------------------------------------------- training


def test_training_leaves_the_target_unchanged(tiny_pair, tmp_path):
    target = tiny_pair.target.module
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    flags = {n: p.requires_grad for n, p in target.named_parameters()}
    recipe = OmegaConf.create(Space.settings({}).recipe)
    emb, report = train_space(target, tiny_pair.tokenizer, 2, recipe, Teacher(RECIPES["smoke"], tmp_path))
    for n, p in target.named_parameters():
        assert torch.equal(p, before[n]) and p.requires_grad == flags[n] and p.grad is None, n
    assert emb().shape == (2, target.config.hidden_size)
    assert len(report["agreement_after"]) == 2 and all(0 <= a <= 1 for a in report["agreement_after"])
    assert len(report["answer_token_agreement"]) == 2 and all(0 <= a <= 1 for a in report["answer_token_agreement"])
    assert report["recipe"] == "smoke" and report["train_tokens"] > 0


def test_the_trained_embeddings_are_cached_with_their_report(compose_cfg, tmp_path):
    from bench.models import load_pair

    pair = load_pair(compose_cfg("pair=tiny", f"cache_dir={tmp_path}"), n_drafts=0)
    with pytest.raises(BenchError, match=r"no cached SPACE mask embeddings at .*; run 'python -m bench train method "
                                         r"method=space' with the same pair=, recipe= and method.masks= \(or train_if_missing=true\).$"):
        Space(Space.settings({}), pair).setup(train_if_missing=False)
    method = build(pair, "space", masks=2)
    assert len(method.report["agreement_before"]) == 2 and method.report["masks"] == 2
    again = Space(Space.settings({"masks": 2}), pair)
    again.setup(train_if_missing=False)  # found in the cache: not trained again
    assert torch.equal(again.embeddings, method.embeddings)


# --------------------------------------------------------------------------------------------- bad input


# Bad values of every space setting (type, range, NaN) are refused in one sentence by tests/bench/test_schema.py's walk.


def test_a_store_too_short_for_a_group_is_one_sentence(compose_cfg):
    from bench.validate import validate

    cfg = compose_cfg("method=space", "pair=tiny", "recipe.store.seq_len=5")
    with pytest.raises(BenchError, match=r"^method=space trains groups of method.masks=5 masks after at least one token "
                                         r"of context; recipe.store.seq_len=5 must be at least 6.$"):
        validate(cfg)


def test_the_shortest_store_allowed_holds_a_group():
    """At the bound (seq_len = k + 1) every full row has one valid cut, at 1; a shorter row has none."""
    from methods._space import random_cuts

    mask = torch.tensor([[True] * 6, [True] * 5 + [False]])
    cuts, valid = random_cuts(mask, 5, 3)
    assert valid.tolist() == [[True] * 3, [False] * 3] and (cuts[0] == 1).all()


def test_a_masks_label_counts_as_an_answer_token_where_the_store_says_so():
    from methods._space import answer_at

    answer = torch.tensor([[False, False, False, True, True, False]])
    assert answer_at(answer, torch.tensor([[2, 3]]), 2).tolist() == [[[False, True], [True, True]]]
