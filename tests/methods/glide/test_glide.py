"""GliDe with CaPE beyond the registry walk (``tests/methods/test_methods.py`` covers its defaults), on the tiny pair: the
teacher store's K/V extra, training's block mask against decoding's view of the target, the draft's cache under
CaPE, lossless output with CaPE on and off, one target forward per step, and bad input."""

import dataclasses
import json

import pytest
import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from core.errors import BenchError
from core.kv_cache import cache_of
from methods.glide._draft import GlideDraft, decode_visible, visible_keys
from methods.glide.glide import Glide
from tests.helpers import (
    assert_greedy_equal_to_ar,
    assert_sampling_is_the_targets,
    build,
    prompts_for,
    run,
)
from training import kv_store
from training.recipes import RECIPES
from training.teacher import Teacher


@pytest.fixture()
def pair(tiny_pair):
    """The tiny pair with a role table of its own, so the glide role does not leak into other tests."""
    return dataclasses.replace(tiny_pair, roles={})


@pytest.fixture()
def kv_builds(monkeypatch):
    """Counts the target's teacher-forced K/V passes (one per shard built)."""
    calls = {"n": 0}
    real = kv_store.target_kv

    def target_kv(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_store, "target_kv", target_kv)
    return calls


def smoke(cache, build=True):
    return Teacher(RECIPES["smoke"], cache, build)


# --------------------------------------------------------------------------------------------- the K/V extra


def test_the_kv_extra_is_the_targets_cache_built_once(tiny_pair, tmp_path, kv_builds):
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    kv = smoke(tmp_path).kv_store(target, tok, "train", -1)
    n = len(kv.store.shards)
    assert kv.layer == 2 and kv_builds["n"] == n and len(kv) == len(kv.store)
    rows = [0, 5, len(kv) - 1]  # text and answers rows (answers are right-padded: causal, so padding changes nothing)
    ids = kv.store.rows(rows, ("ids",))["ids"]
    with torch.no_grad():
        cache = cache_of(target(ids, use_cache=True))
    got = kv.rows(rows)
    for layer in (2, 0):
        if layer == 0:
            got = smoke(tmp_path).kv_store(target, tok, "train", -3).rows(rows)  # -3 of 3 layers: layer 0
        assert got["k"].shape == (3, 2, 64, 16)  # (rows, kv heads, seq_len, head_dim)
        torch.testing.assert_close(got["k"], cache.layers[layer].keys, atol=2e-3, rtol=2e-3)  # float16 on disk
        torch.testing.assert_close(got["v"], cache.layers[layer].values, atol=2e-3, rtol=2e-3)
    assert kv_builds["n"] == 2 * n  # layer 0 once; layer 2 was not built again
    again = smoke(tmp_path).kv_store(target, tok, "train", 2)  # another run's teacher: loaded from disk
    assert kv_builds["n"] == 2 * n and torch.equal(again.rows(rows)["k"], kv.rows(rows)["k"])


def test_a_damaged_kv_shard_is_one_sentence_or_rebuilt(tiny_pair, tmp_path, kv_builds):
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    kv = smoke(tmp_path).kv_store(target, tok, "train")
    (folder,) = [p for p in (tmp_path / "teacher" / f"{kv.store.folder.name}-kv").iterdir() if p.is_dir() and "-00001-" in p.name]
    path = folder / "k.npy"
    path.write_bytes(path.read_bytes()[:1000])  # a copy cut short, a disk that filled up
    built = kv_builds["n"]
    with pytest.raises(BenchError, match=r"target keys and values of layer 2, teacher store shard 1 at .* cannot be "
                                         r"used \(k.npy has 1000 bytes.*python -m bench train method"):
        smoke(tmp_path, build=False).kv_store(target, tok, "train")
    again = smoke(tmp_path).kv_store(target, tok, "train")
    assert kv_builds["n"] == built + 1  # shard 1 only
    assert torch.equal(again.rows([4])["v"], kv.rows([4])["v"])


@pytest.mark.parametrize("layer", [3, -4])
def test_a_bad_layer_is_one_sentence(tiny_pair, tmp_path, layer, kv_builds):
    with pytest.raises(BenchError, match=rf"^layer={layer} is not one of the target's 3 decoder layers \(0 .. 2, or "
                                         r"-1 .. -3 counted from the last\).$"):
        smoke(tmp_path).kv_store(tiny_pair.target.module, tiny_pair.tokenizer, "train", layer)
    assert kv_builds["n"] == 0 and not (tmp_path / "teacher").exists()  # said before anything is labelled
    method = Glide(Glide.settings({"recipe": {"layer": 3}}), dataclasses.replace(tiny_pair, roles={}))
    with pytest.raises(BenchError, match=r"^method.recipe.layer=3 is not one of the target's 3 decoder layers"):
        method.setup()


# --------------------------------------------------------------------------------------------- the draft


@pytest.mark.parametrize("phase", [0, 1, 3])
def test_training_sees_the_target_as_decoding_does(tiny_pair, phase):
    """Teacher-forced logits over a whole sequence under the block mask (blocks of 4, this phase) equal those
    computed as decoding computes them: the draft's own cache, and at each block start p the target's cache of
    positions < p only (the prompt read first, then a block's tokens one by one). Two blocks, so the second
    one's self-attention reads what the first one's cross-attention saw."""
    target = tiny_pair.target.module
    torch.manual_seed(0)
    draft = GlideDraft.from_target(target, torch.arange(40, 120), "random", layers=2).eval()
    ids = torch.randint(3, 250, (1, 23))
    T, block = ids.shape[1], 4
    with torch.no_grad():
        cache = cache_of(target(ids, use_cache=True)).layers[-1]
        emb, positions = target.get_input_embeddings()(ids), torch.arange(T)
        full = draft(emb, positions, [(cache.keys, cache.values)] * 2, visible_keys(positions, T, block, phase)[None])
        mine, fed = DynamicCache(), 0
        for p in range((block - phase) % block or block, T, block):  # the pending token's positions: block starts
            for end in range(p + 1, min(p + block, T) + 1):  # first what is unread up to p, then one token at a time
                rows = torch.arange(fed, end)
                visible = decode_visible(rows, p, block)[None] if fed < p else None
                kvs = [(cache.keys[..., :p, :], cache.values[..., :p, :])] * 2
                out = draft(emb[:, fed:end], rows, kvs, visible, mine)
                torch.testing.assert_close(out, full[:, fed:end], atol=1e-5, rtol=1e-5)
                fed = end
    assert fed == T


def test_a_target_without_rotary_attention_is_one_sentence():
    from transformers import GPT2Config

    with pytest.raises(BenchError, match=r"method=glide needs a target with rotary attention in Llama-style decoder "
                                         r"layers; this target's are GPT2Model's \(gpt2\)."):
        GlideDraft(GPT2Config(n_embd=32, n_layer=1, n_head=2), torch.arange(8))


# --------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("cape", [True, False])
def test_lossless_with_and_without_cape(pair, looping_prompt, cape):
    method = build(pair, "glide", cape=cape)
    assert_greedy_equal_to_ar(method, prompts_for(pair, 2) + [looping_prompt])
    assert_sampling_is_the_targets(method, looping_prompt)


@pytest.mark.parametrize("cape", [True, False])
def test_one_target_forward_per_step_and_the_glide_role_counted(pair, looping_prompt, cape):
    method = build(pair, "glide", cape=cape, gamma=3, recipe={"block": 3})
    pair.reset_counts()
    out = run(method, looping_prompt, 24)
    counts = pair.counts()
    steps = len(out.accept_lengths)
    assert counts["target"]["calls"] == steps + 1  # the prefill, then ONE forward per step
    # Per step: one draft call reads the pending token (the first: the prompt too), then one per chain token.
    assert steps - 1 <= counts["glide"]["calls"] <= 3 * steps and counts["glide"]["flops"] > 0  # the last: draft budget 0
    assert counts["glide"]["tokens"] >= len(looping_prompt) + 1
    assert max(out.drafted) == 3 and out.extra["cape"] is cape
    if cape:
        assert 1 <= out.extra["candidates_per_call"] <= 6 and 0 <= out.extra["expanded_per_call"] <= 3
    else:
        assert out.extra["candidates_per_call"] <= 3


def test_cape_by_the_authors_bins(pair, looping_prompt):
    """``cape_bins``: a position of confidence p gets bins[int(10 p)] candidates. A draft no position of which is
    sure of itself to 0.9 gets 3 at every position under [3] * 9 + [1, 1]; all ones is no expansion at all."""
    method = build(pair, "glide", cape_bins=[3] * 9 + [1, 1], gamma=3, recipe={"block": 3})
    assert [method.width(p) for p in (0.0, 0.05, 0.5, 0.89, 0.9, 1.0)] == [3, 3, 3, 3, 1, 1]
    out = run(method, looping_prompt, 24)
    assert 1 <= out.extra["expanded_per_call"] <= 3 and out.extra["candidates_per_call"] <= 9
    assert_greedy_equal_to_ar(method, [looping_prompt])
    plain = run(build(pair, "glide", cape_bins=[1] * 12, gamma=3, recipe={"block": 3}), looping_prompt, 24)
    assert plain.extra["expanded_per_call"] == 0 and plain.extra["candidates_per_call"] <= 3
    with pytest.raises(BenchError, match="cape_bins"):
        Glide.check_settings({"cape_bins": [1] * 10})
    with pytest.raises(BenchError, match=r"cape_bins \[1, 2, 2, .*\] grows with the confidence"):
        Glide.check_settings({"cape_bins": [1] + [2] * 10})
    with pytest.raises(BenchError, match="cape_bins is CaPE's rule; with cape=false nothing would read it"):
        Glide.check_settings({"cape_bins": [2] * 11, "cape": False})


def test_the_draft_cache_keeps_only_what_was_committed(pair, looping_prompt, monkeypatch):
    """CaPE at every position (threshold 1), so paths often leave the top-1 chain at a sibling: after decoding,
    the draft's cache equals one pass of the draft over the committed text (one block: its self-attention
    depends on the tokens alone)."""
    method = build(pair, "glide", cape_threshold=1.0, cape_k=2)
    left, states, accepted = [], set(), Glide.accepted

    def record(self, state, draft, path, hidden):
        left.append(any(v != c for v, c in zip(path, state.chain_nodes)))
        states.add(state)
        return accepted(self, state, draft, path, hidden)

    monkeypatch.setattr(Glide, "accepted", record)
    out = run(method, looping_prompt, 40)
    (state,) = states
    assert any(left) and sum(state.expanded) == sum(out.drafted)  # every drafted position expanded
    seq = looping_prompt + out.output_ids
    n = state.dcache.get_seq_length()
    assert len(looping_prompt) < n <= len(seq) - 1
    fresh, target = DynamicCache(), pair.target.module
    with torch.no_grad():
        kv = cache_of(target(torch.tensor([seq[:n]]), use_cache=True)).layers[-1]
        method.draft.module(method.embed(torch.tensor([seq[:n]])), torch.arange(n), [(kv.keys, kv.values)], None, fresh)
    torch.testing.assert_close(state.dcache.layers[0].keys, fresh.layers[0].keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.dcache.layers[0].values, fresh.layers[0].values, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------- the artifact, bad input


def test_the_trained_draft_is_cached_with_its_report(compose_cfg, tmp_path):
    from bench.models import load_pair

    pair = load_pair(compose_cfg("pair=tiny", f"cache_dir={tmp_path}"), n_drafts=0)
    with pytest.raises(BenchError, match=r"no cached GliDe draft at .*; run 'python -m bench train method "
                                         r"method=glide' with the same pair= and recipe= \(or train_if_missing=true\).$"):
        Glide(Glide.settings({}), pair).setup(train_if_missing=False)
    method = build(pair, "glide")
    report = method.report
    assert report["recipe"] == "smoke" and report["layer"] == 2 and report["train_tokens"] == 4096
    assert len(report["agreement_by_offset"]) == 4 and 0 <= report["agreement_after"] <= 1
    assert 0 <= report["answer_token_agreement"] <= 1
    (folder,) = [p for p in (tmp_path / "glide").iterdir() if p.is_dir()]
    (folder / "glide.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(BenchError, match=r"GliDe draft at .* cannot be used \(glide.pt has 16 bytes.*python -m bench "
                                         r"train method method=glide"):
        Glide(Glide.settings({}), pair).setup(train_if_missing=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    build(pair, "glide")  # building allowed: trained again, from the stores on disk
    assert json.loads((folder / "manifest.json").read_text())["key"] == manifest["key"]


@pytest.mark.parametrize("over, words", [
    ({"gamma": 5}, r"method=glide: gamma \(5\) must not exceed recipe.block \(4\)"),
    ({"cape_threshold": 1.5}, "cape_threshold=1.5 is not allowed"),
    ({"cape_k": 0}, "cape_k=0 is not allowed"),
    ({"cape": "yes"}, "cape='yes' is not allowed"),
    ({"recipe": {"layer": -2}}, "recipe.layer=-2 is not allowed"),
    ({"recipe": {"init": "zeros"}}, "recipe.init='zeros' is not allowed; it takes one of: target, random"),
    ({"recipe": {"block": 2}}, r"gamma \(4\) must not exceed recipe.block \(2\)"),
])
def test_bad_settings_raise_one_sentence(compose_cfg, over, words):
    from bench.validate import validate

    cfg = compose_cfg("method=glide", "pair=tiny")
    cfg.method = OmegaConf.merge(cfg.method, over)
    with pytest.raises(BenchError, match=words) as err:
        validate(cfg)
    assert len(str(err.value).splitlines()) == 1


def test_a_store_too_short_for_the_blocks_is_one_sentence(compose_cfg):
    from bench.validate import validate

    cfg = compose_cfg("method=glide", "pair=tiny", "recipe.store.seq_len=4")
    with pytest.raises(BenchError, match=r"^method=glide trains on blocks of method.recipe.block=4 positions, the first "
                                         r"of which sees none of the target; recipe.store.seq_len=4 must be longer.$"):
        validate(cfg)
