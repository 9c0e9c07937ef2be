"""The authors' published GliDe draft (``method=glide method.weights=DIR``), on the tiny pair.

A checkpoint is written here in the authors' layout (``config.json`` with ``large_hidden_size`` /
``large_num_attention_heads`` + ``pytorch_model.bin`` or ``model.safetensors``: a small Llama of its own whose
layers also hold ``cross_attn.{q,o}_proj``), with random weights; the loaded draft computes what the file's tensors
and the paper's equations say, decoding with it equals ``ar`` greedily and follows the target when sampling, and
every mismatch is one sentence.
"""

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from core.checkpoints import Checkpoint
from core.errors import BenchError
from core.kv_cache import cache_of
from methods.glide._published import FILES, WHAT, published_glide, read_layers
from tests.helpers import (
    assert_greedy_equal_to_ar,
    assert_published_follows_the_target,
    build,
    one_layer_pair,
    prompts_for,
    refusal_of,
)
from tests.methods.eagle.test_published import rms, rotate


@pytest.fixture()
def pair(tiny_pair):
    return dataclasses.replace(tiny_pair, roles={})


def glide_file(folder, target, layers=1, h=32, heads=2, kv_heads=1, inter=48, name="pytorch_model.bin", seed=0,
               drop=(), config_over=None, extra=None, tie=False):
    """The authors' files for ``target``: a Llama config of a draft ``h`` wide (``heads`` heads, ``kv_heads`` key
    and value heads) with the target's attention sizes, and its state dict (``model.*`` and ``lm_head``)."""
    c = target.config
    H, V = c.num_attention_heads * (c.hidden_size // c.num_attention_heads), c.vocab_size
    d = h // heads
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen) * scale

    tensors = {"model.embed_tokens.weight": r(V, h, scale=1.0), "model.norm.weight": 1 + r(h)}
    if not tie:
        tensors["lm_head.weight"] = r(V, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        kv = kv_heads * d
        tensors.update({p + "self_attn.q_proj.weight": r(heads * d, h), p + "self_attn.o_proj.weight": r(h, heads * d),
                        p + "self_attn.k_proj.weight": r(kv, h), p + "self_attn.v_proj.weight": r(kv, h),
                        p + "cross_attn.q_proj.weight": r(H, h), p + "cross_attn.o_proj.weight": r(h, H),
                        p + "mlp.gate_proj.weight": r(inter, h), p + "mlp.up_proj.weight": r(inter, h),
                        p + "mlp.down_proj.weight": r(h, inter), p + "input_layernorm.weight": 1 + r(h),
                        p + "post_attention_layernorm.weight": 1 + r(h)})
    for key in drop:
        del tensors[key]
    tensors.update(extra or {})
    config = {"architectures": ["smallLlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": layers, "rms_norm_eps": 1e-6, "vocab_size": V, "hidden_act": "silu",
              "max_position_embeddings": 2048, "torch_dtype": "float16", "tie_word_embeddings": tie,
              "large_hidden_size": H, "large_num_attention_heads": c.num_attention_heads, "large_head_dim": H //
              c.num_attention_heads, "block_size": 5, "use_remap": False, **(config_over or {})}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if name.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, str(folder / name))
    else:
        torch.save(tensors, folder / name)
    return folder, tensors


def attend(q, k, v, mask=None):
    """Scaled dot-product attention of ``q (heads, n, d)`` over ``k``, ``v`` ``(kv_heads, m, d)`` (GQA: query head
    h reads key head h // (heads / kv_heads)), ``mask (n, m)`` additive."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return (scores + (0 if mask is None else mask)).softmax(-1) @ v


def glide_by_hand(f, ids, layers_kv, config, theta):
    """The authors' draft over the n tokens ``ids`` at positions 0 .. n-1, from the file's tensors: its own embedding;
    per block, causal self-attention after the input norm, cross-attention (no norm) from queries rotated at their
    positions onto the target's cached keys and values ``layers_kv[i]`` ``(kv_heads, m, d)`` (all of them), the MLP
    after the post-attention norm; the final norm and its head. Returns the logits ``(n, V)``."""
    h, heads, kvh = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d, big_heads = h // heads, config["large_num_attention_heads"]
    x = f["model.embed_tokens.weight"][ids]
    n = x.shape[0]
    pos = torch.arange(n)
    causal = torch.full((n, n), float("-inf")).triu(1)
    for i, (tk, tv) in enumerate(layers_kv):
        p = f"model.layers.{i}."
        a = rms(x, f[p + "input_layernorm.weight"])
        own = config.get("rope_theta", 10000.0)
        q = rotate((a @ f[p + "self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1), pos, own)
        k = rotate((a @ f[p + "self_attn.k_proj.weight"].T).view(n, kvh, d).transpose(0, 1), pos, own)
        v = (a @ f[p + "self_attn.v_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
        x = x + attend(q, k, v, causal).transpose(0, 1).reshape(n, -1) @ f[p + "self_attn.o_proj.weight"].T
        cq = (x @ f[p + "cross_attn.q_proj.weight"].T).view(n, big_heads, -1).transpose(0, 1)
        glimpse = attend(rotate(cq, pos, theta), tk, tv).transpose(0, 1).reshape(n, -1)
        x = x + glimpse @ f[p + "cross_attn.o_proj.weight"].T
        m = rms(x, f[p + "post_attention_layernorm.weight"])
        x = x + (nn.functional.silu(m @ f[p + "mlp.gate_proj.weight"].T) * (m @ f[p + "mlp.up_proj.weight"].T)
                 ) @ f[p + "mlp.down_proj.weight"].T
    return rms(x, f["model.norm.weight"]) @ f["lm_head.weight"].T


@pytest.mark.parametrize("layers", [1, 2])
def test_the_draft_computes_glides_equations_from_the_file(pair, tmp_path, layers):
    """Block i of n reads the target's layer L - n + i (the authors' choice), its queries seeing all of the cache;
    the draft's own heads are narrower and rotate at another base than the target's, whose rotary its glimpse uses."""
    target = pair.target.module
    folder, f = glide_file(tmp_path / "g", target, layers=layers, heads=4, kv_heads=2,
                           config_over={"rope_theta": 500.0})
    draft = published_glide(Checkpoint(folder, FILES, WHAT), target)
    L = len(target.model.layers)
    assert read_layers(L, layers) == list(range(L - layers, L))
    context, ids = torch.randint(0, target.config.vocab_size, (1, 9)), torch.randint(0, target.config.vocab_size, (6,))
    with torch.no_grad():
        cache = cache_of(target(context, use_cache=True))
        kvs = [(cache.layers[i].keys, cache.layers[i].values) for i in read_layers(L, layers)]
        got = draft.head(draft(draft.embed_tokens(ids)[None], torch.arange(6), kvs))[0]
    config = json.loads((folder / "config.json").read_text())
    want = glide_by_hand(f, ids, [(k[0], v[0]) for k, v in kvs], config, target.config.rope_parameters["rope_theta"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(draft.vocab_map, torch.arange(target.config.vocab_size))


@pytest.mark.parametrize("name", FILES)
def test_decoding_with_published_weights_equals_ar(pair, tmp_path, name):
    folder, _ = glide_file(tmp_path / name, pair.target.module, layers=2, name=name)
    method = build(pair, "glide", weights=str(folder), gamma=6)  # more than recipe.block: the authors' draft may
    assert method.report["file"] == name and method.published
    assert not type(method).trains(pair.spec, method.cfg)
    assert method.embed is method.draft.module.embed_tokens  # the draft's own table
    assert method.draft.module.read_layers == [1, 2]
    assert_greedy_equal_to_ar(method, prompts_for(pair, 2), max_new=16)
    chain = build(pair, "glide", weights=str(folder), cape=False, gamma=3)
    assert_greedy_equal_to_ar(chain, prompts_for(pair, 1), max_new=20)
    assert pair.counts()["glide"]["calls"] > 0


def test_the_converted_draft_is_cached(pair, tmp_path, monkeypatch):
    from methods.glide import _published as _glide_published

    folder, _ = glide_file(tmp_path / "g", pair.target.module, tie=True)
    first = build(pair, "glide", weights=str(folder))
    monkeypatch.setattr(_glide_published, "published_glide", lambda *args: pytest.fail("converted again"))
    again = build(pair, "glide", weights=str(folder))  # the cached blob alone
    assert again.report["sha256"] == first.report["sha256"]
    mine, theirs = first.draft.module.state_dict(), again.draft.module.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(first.draft.module.head.weight, first.draft.module.embed_tokens.weight)  # tied, saved once


@pytest.fixture()
def one_layer(tiny_pair, tmp_path):
    """A one-layer target, and a GliDe file that is that very layer (its embedding, attention, MLP, norms and head)
    plus a small random glimpse of the target's cache: its proposals are right most of the time and wrong some of
    it, so the sampling test has power. Returns the pair and the folder."""
    pair = one_layer_pair(tiny_pair)
    model = pair.target.module
    cut = model.config
    H = cut.hidden_size
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.model.state_dict().items()}
    tensors["lm_head.weight"] = model.lm_head.weight.detach().clone()
    gen = torch.Generator().manual_seed(1)
    tensors["model.layers.0.cross_attn.q_proj.weight"] = torch.randn(H, H, generator=gen) * 0.2
    tensors["model.layers.0.cross_attn.o_proj.weight"] = torch.randn(H, H, generator=gen) * 0.05
    folder = tmp_path / "one-layer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": H, "intermediate_size": cut.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cut.num_attention_heads, "num_key_value_heads": cut.num_key_value_heads,
        "vocab_size": cut.vocab_size, "rms_norm_eps": cut.rms_norm_eps, "large_hidden_size": H,
        "large_num_attention_heads": cut.num_attention_heads}))
    torch.save(tensors, folder / "pytorch_model.bin")
    return pair, folder


def test_the_published_draft_rereads_what_the_target_accepted(one_layer, monkeypatch):
    """As the authors' loop: after each verification the draft's cache is cut back to the pending token, and the
    next step's first read is that token, the accepted ones and the new pending one, against the target's cache
    of all but the last."""
    from methods.glide.glide import Glide
    from tests.helpers import decode, repeating_prompt, run

    pair, folder = one_layer  # a draft the target often agrees with: steps accept tokens
    method = build(pair, "glide", weights=str(folder))
    reads, kept = [], []
    real_read, real_accepted = Glide.read, Glide.accepted

    def read(self, state, tokens):
        reads.append((state.dcache.get_seq_length(), len(tokens), state.cache.get_seq_length(), len(state.seq)))
        return real_read(self, state, tokens)

    def accepted(self, state, draft, path, hidden):
        real_accepted(self, state, draft, path, hidden)
        kept.append((state.dcache.get_seq_length(), state.past))

    monkeypatch.setattr(Glide, "read", read)
    monkeypatch.setattr(Glide, "accepted", accepted)
    ids = repeating_prompt(pair)
    ids += decode(pair, "ar", ids, max_new=30).output_ids  # a loop the target keeps to: drafts get accepted
    out = run(method, ids, 24)
    assert len(out.output_ids) > 10
    # (The last step may have had no budget left to draft, so nothing read: its cache stops short of the pending.)
    assert kept and all(length == past for length, past in kept[:-1]) and kept[-1][0] <= kept[-1][1]
    firsts = [r for r in reads if r[0] + r[1] == r[3]]  # a step's first read: up to the pending token
    assert len(firsts) >= len(kept) - 1 and all(start + n == p + 1 for start, n, p, _ in firsts)
    assert any(n > 2 for _, n, _, _ in firsts[1:])  # accepted tokens read again with the pending ones


@pytest.mark.parametrize("cape", [True, False])
def test_sampling_with_published_weights_follows_the_target(one_layer, cape):
    assert_published_follows_the_target(*one_layer, "glide", cape=cape)


def refusal(pair, folder) -> str:
    return refusal_of(lambda: published_glide(Checkpoint(folder, FILES, WHAT), pair.target.module))


def test_mismatches_are_one_sentence(pair, tmp_path):
    target = pair.target.module
    c = target.config
    folder, _ = glide_file(tmp_path / "wide", target, config_over={"large_hidden_size": 2 * c.hidden_size})
    assert f"large_hidden_size: {2 * c.hidden_size}, but this target's is {c.hidden_size}" in refusal(pair, folder)
    folder, _ = glide_file(tmp_path / "heads", target, config_over={"large_num_attention_heads": 1})
    assert "large_num_attention_heads: 1, but this target's is" in refusal(pair, folder)
    folder, _ = glide_file(tmp_path / "vocab", target, config_over={"vocab_size": 7})
    assert "vocab_size: 7, but this target's is" in refusal(pair, folder)
    folder, _ = glide_file(tmp_path / "nocross", target, drop=("model.layers.0.cross_attn.o_proj.weight",))
    assert "has no tensor 'model.layers.0.cross_attn.o_proj.weight'" in refusal(pair, folder)
    folder, _ = glide_file(tmp_path / "extra", target, extra={"model.layers.0.cross_attn.k_proj.weight": torch.ones(1)})
    assert "holds 'model.layers.0.cross_attn.k_proj.weight'" in refusal(pair, folder)
    folder, _ = glide_file(tmp_path / "ffn", target, config_over={"intermediate_size": 64})
    assert "'model.layers.0.mlp.gate_proj.weight' has shape" in refusal(pair, folder)
    folder, _ = glide_file(tmp_path / "deep", target, config_over={"num_hidden_layers": 9})
    assert "num_hidden_layers: 9; a GliDe draft reads one target layer per block, and this target has 3" in refusal(
        pair, folder)
    folder, _ = glide_file(tmp_path / "qwen", target, config_over={"model_type": "qwen2"})
    assert "model_type: qwen2" in refusal(pair, folder)
    folder, _ = glide_file(tmp_path / "nolarge", target, config_over={"large_hidden_size": None})
    assert "'large_hidden_size' is None, not an integer." in refusal(pair, folder)
    folder, _ = glide_file(tmp_path / "dims", target, config_over={"head_dim": 99, "attention_bias": True})
    assert published_glide(Checkpoint(folder, FILES, WHAT), target) is not None  # their layers read neither
    folder, _ = glide_file(tmp_path / "default", target)
    config = json.loads((folder / "config.json").read_text())
    del config["large_num_attention_heads"]  # the authors' default, 32 (Vicuna-7B's), is read
    (folder / "config.json").write_text(json.dumps(config))
    assert ("leaves out, so the authors' code reads large_num_attention_heads: 32, but this target's is "
            f"{c.num_attention_heads}") in refusal(pair, folder)
    (tmp_path / "noconfig").mkdir()
    torch.save({}, tmp_path / "noconfig" / "pytorch_model.bin")
    assert "has no config.json" in refusal(pair, tmp_path / "noconfig")


def test_a_published_draft_skips_training_and_the_block_check(pair, tmp_path):
    from methods.registry import get_method

    cls = get_method("glide")
    settings = cls.check_settings({"weights": "/models/glide", "gamma": 6})
    assert not cls.trains(pair.spec, settings)
    with pytest.raises(BenchError, match=r"gamma \(6\) must not exceed recipe.block \(4\)"):
        cls.check_settings({"gamma": 6})
