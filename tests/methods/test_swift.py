"""SWIFT beyond the registry walk (``tests/methods/test_methods.py`` covers its defaults), on the tiny pair (3 layers: only
layer 1 may be skipped): the skipping forward against a hand-made one, the draft's cache left as the committed
text, the online search running inside decoding and staying lossless, the cached search through the artifact
cache, FLOPs of the skipping role, and bad input."""

import dataclasses
import json

import pytest
import torch
from transformers import DynamicCache

from core.errors import BenchError
from core.kv_cache import lm_forward
from core.model_parts import decoder_layers, skipping
from methods._swift import SkippingLM, SkipSearch, SkipSet
from methods.swift import Swift
from tests.helpers import (
    assert_greedy_equal_to_ar,
    assert_sampling_is_the_targets,
    build,
    method_cfg,
    prompts_for,
    run,
)


@pytest.fixture()
def pair(tiny_pair):
    """The tiny pair with a role table of its own, so swift's roles do not leak into other tests, and counts from
    zero (the shared target's counter holds whatever the tests before decoded)."""
    fresh = dataclasses.replace(tiny_pair, roles={})
    fresh.reset_counts()
    return fresh


def test_skipping_drops_exactly_those_sublayers(pair):
    """With layer 1's MLP skipped, the model's hidden state equals a hand-run of its layers without that MLP;
    layer 1's attention skipped leaves its KV cache empty while the others grow."""
    model = pair.target.module
    ids = torch.tensor([pair.tokenizer("a skipped layer", add_special_tokens=False)["input_ids"]])
    with torch.no_grad(), skipping(model, [], [1]):
        got = model(ids, output_hidden_states=True).hidden_states[2]  # after layers 0 and 1
        full = model(ids, output_hidden_states=True).hidden_states[1]  # after layer 0 (layer 0 is not skipped)
    layer = decoder_layers(model)[1]
    with torch.no_grad():
        pos = torch.arange(ids.shape[1])[None]
        emb = model.model.rotary_emb(full, pos)
        attn, _ = layer.self_attn(layer.input_layernorm(full), position_embeddings=emb, attention_mask=None)
        want = full + attn
    assert torch.allclose(got, want, atol=1e-5)
    assert type(layer.mlp).__name__ != "Skipped"  # swapped back
    cache = DynamicCache()
    with torch.no_grad(), skipping(model, [1], []):
        lm_forward(model, ids, cache)
    assert [lay.get_seq_length() for lay in cache.layers] == [ids.shape[1], 0, ids.shape[1]]


def test_draft_leaves_the_cache_as_committed_and_output_equals_ar(pair):
    """Online search on a small window (so it runs within 24 tokens), wide trees: greedy equals ar; the
    search ran inside the decodes and its seconds are counted; the cache never keeps a drafted entry."""
    method = build(pair, "swift", context_window=4, bayes_interval=2)
    out = run(method, prompts_for(pair, 1)[0], 24)
    assert out.extra["search_iters"] > 0 and out.extra["search_s"] > 0
    assert_greedy_equal_to_ar(method, prompts_for(pair, 3), max_new=24)
    assert method.search.iters >= out.extra["search_iters"]  # the state carries across prompts
    assert out.extra["skipped"] >= 1 and out.extra["candidates_per_call"] >= out.extra["drafted_per_call"]
    # Counted: the draft and the search in their own roles, each forward fewer FLOPs than the target's.
    counts = method.pair.counts()
    assert counts["draft_skip"]["calls"] > 0 and counts["search"]["calls"] > 0
    per = {r: counts[r]["flops"] / counts[r]["tokens"] for r in ("target", "draft_skip")}
    assert per["draft_skip"] < per["target"]


def test_compiled_swift_searches_and_drafts_as_the_eager_one(pair, compiled):
    """compile=true: the draft's skipping forwards run uncompiled on the compiled target's static cache, the online
    search on an eager copy of the prompt's KV; the output, every step's accepted length, the search's scores and
    the skip set it ends on are the eager method's, and the verification forwards stay compiled."""
    from core.compiled import no_recompiles

    fast = compiled(pair)
    method, eager = (build(p, "swift", context_window=4, bayes_interval=2) for p in (fast, pair))
    with no_recompiles():
        for ids in prompts_for(pair, 2):
            got, want = run(method, ids, 24), run(eager, ids, 24)
            assert got.output_ids == want.output_ids and got.accept_lengths == want.accept_lengths
            assert got.extra["search_iters"] == want.extra["search_iters"] > 0
            assert got.extra["search_score"] == pytest.approx(want.extra["search_score"])
    assert method.draft_lm.skip == eager.draft_lm.skip
    counts = fast.counts()
    assert counts["draft_skip"]["uncompiled_calls"] == counts["draft_skip"]["calls"] > 0
    assert counts["target"]["uncompiled_calls"] < counts["target"]["calls"]


def test_sampling_with_drawn_siblings_follows_the_target(pair, looping_prompt):
    """Every drafted position gets 3 candidates (independent draws): the tree verifier keeps it exact."""
    method = build(pair, "swift", widths_sampled=[3, 3, 3, 3], search="off", attn_skip=[1])
    assert_sampling_is_the_targets(method, looping_prompt)


def test_search_keeps_the_best_and_stops(pair):
    """The search keeps a candidate only when it scores higher, and stops at patience."""
    cfg = method_cfg("swift", patience=3, bayes_interval=2, max_iters=50)
    search = SkipSearch(5, cfg, SkipSet.alternating(5))
    scores = iter([0.5, 0.4, 0.6, 0.1, 0.2, 0.3, 0.0, 0.9])
    kept = [search.step(lambda s: next(scores), torch.device("cpu")) for _ in range(7)]
    assert kept == [True, False, True, False, False, False, False]
    assert search.best_score == 0.6 and search.done and "patience" in search.stopped
    assert search.best.size == max(1, int(2 * 3 * 0.45))  # 2 of the 6 sub-layers of layers 1..3


def test_cached_search_is_built_once_and_reused(pair):
    method = build(pair, "swift", search="cached", max_iters=6, calibration=2, context_window=4)
    report = method.built
    assert report["iterations"] == 6 and report["windows"] == 2 and report["search_s"] > 0
    again = build(pair, "swift", search="cached", max_iters=6, calibration=2, context_window=4)
    assert again.built == report and again.draft_lm.skip == method.draft_lm.skip
    out = run(again, prompts_for(pair, 1)[0], 12)
    assert out.extra["search_build_s"] == report["search_s"] and out.extra["search_iters"] == 0
    with pytest.raises(BenchError, match="no cached swift skip set"):
        Swift(method_cfg("swift", search="cached", max_iters=7, calibration=2, context_window=4), pair).setup(
            train_if_missing=False)


@pytest.mark.parametrize("overrides, match", [
    ({"search": "off", "attn_skip": [0, 1, 2], "mlp_skip": [0, 1, 2]}, "first and the last are always kept"),
    ({"search": "off", "attn_skip": [], "mlp_skip": []}, "skips nothing"),
])
def test_bad_skip_sets_are_refused(pair, overrides, match):
    with pytest.raises(BenchError, match=match):
        build(pair, "swift", **overrides)


def test_an_explicit_set_needs_search_off():
    from methods.registry import get_method

    with pytest.raises(BenchError, match="method.search=off"):
        get_method("swift").check_settings({"attn_skip": [1]})


def test_skip_flops_formula(pair):
    lm = SkippingLM(pair.target, "x")
    full = lm.formula(1, 10)
    lm.use(SkipSet((1,), (1,)))
    layer = decoder_layers(pair.target.module)[1]
    saved = 2 * sum(p.numel() for m in (layer.self_attn, layer.mlp) for p in m.parameters() if p.dim() == 2)
    n_layer, d = lm.full.n_layer, lm.full.d_attn
    assert full - lm.formula(1, 10) == pytest.approx(saved + 4 * d * 10 * 1)
    assert n_layer == 3 and json.dumps(SkipSet((1,), ()).as_dict())


def test_gpt2_layers_are_skipped_too(pair):
    """GPT-2 keeps its layers in transformer.h and its attention in attn (core/model_parts.py): a random GPT-2 target
    drafts for itself, online search included, and stays greedy-equal to ar."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from core.counting import CountedLM

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=pair.target.module.config.vocab_size, n_embd=64, n_layer=4, n_head=4,
                        n_positions=1024, eos_token_id=pair.tokenizer.eos_token_id)
    gpt2 = dataclasses.replace(pair, target=CountedLM(GPT2LMHeadModel(config).eval(), "target"), roles={})
    method = build(gpt2, "swift", context_window=4)
    assert_greedy_equal_to_ar(method, prompts_for(gpt2, 2), max_new=24)
    assert method.search.iters > 0 and method.draft_lm.skip.size >= 1
