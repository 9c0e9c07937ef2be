"""The authors' published EAGLE draft layer (``method=eagle method.weights=DIR``), on the tiny pair.

A checkpoint is written here in EAGLE's layout (``config.json`` + ``pytorch_model.bin``: the embedding copy,
``fc`` over [embedding; feature], a first layer without input norm, no final norm), with random weights; the
loaded layer computes what the file's tensors and the paper's equations say, decoding with it equals ``ar``
greedily and follows the target when sampling, and every mismatch is one sentence.
"""

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from core.checkpoints import Checkpoint
from core.errors import BenchError
from methods.eagle._published import FILES, WHAT, eagle_layer
from tests.helpers import (
    assert_greedy_equal_to_ar,
    assert_published_follows_the_target,
    build,
    one_layer_pair,
    prompts_for,
    refusal_of,
)


@pytest.fixture()
def pair(tiny_pair):
    return dataclasses.replace(tiny_pair, roles={})


def eagle_file(folder, target, bias=True, layers=1, name="pytorch_model.bin", seed=0, drop=(), config_over=None,
               extra=None):
    """EAGLE's published files for ``target``'s sizes: a Llama config of the draft and its state dict."""
    c = target.config
    H, V, I = c.hidden_size, c.vocab_size, c.intermediate_size
    d = H // c.num_attention_heads
    kv = c.num_key_value_heads * d
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen) * scale

    tensors = {"embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(), "fc.weight": r(H, 2 * H)}
    if bias:
        tensors["fc.bias"] = r(H)
    for i in range(layers):
        p = f"layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": r(H, H), p + "self_attn.k_proj.weight": r(kv, H),
                        p + "self_attn.v_proj.weight": r(kv, H), p + "self_attn.o_proj.weight": r(H, H),
                        p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                        p + "mlp.down_proj.weight": r(H, I), p + "post_attention_layernorm.weight": 1 + r(H)})
        if i > 0:
            tensors[p + "input_layernorm.weight"] = 1 + r(H)
    for key in drop:
        del tensors[key]
    tensors.update(extra or {})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "num_hidden_layers": layers, "rms_norm_eps": 1e-6, "vocab_size": V, "hidden_act": "silu",
              "max_position_embeddings": 2048, "torch_dtype": "float16", **({} if bias else {"bias": False}),
              **(config_over or {})}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if name.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, str(folder / name))
    else:
        torch.save(tensors, folder / name)
    return folder, tensors


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, theta=10000.0):
    """Llama's rotary embedding (the half-split convention) of ``x (heads, n, d)`` at positions ``pos (n,)``."""
    d = x.shape[-1]
    freqs = pos[:, None].float() * (1.0 / theta ** (torch.arange(0, d, 2).float() / d))[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def eagle_by_hand(f, feats, emb, target):
    """EAGLE's layer over n positions from the file's tensors: fc([e; f]), causal self-attention (no input norm
    in the first layer), the MLP after the post-attention norm, no final norm; then the target's head."""
    c = target.config
    heads, kvh = c.num_attention_heads, c.num_key_value_heads
    d = c.hidden_size // heads
    x = torch.cat([emb, feats], -1) @ f["fc.weight"].T + f["fc.bias"]  # (n, H)
    n = x.shape[0]
    q = (x @ f["layers.0.self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
    k = (x @ f["layers.0.self_attn.k_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
    v = (x @ f["layers.0.self_attn.v_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
    pos = torch.arange(n)
    q, k = rotate(q, pos), rotate(k, pos)
    k, v = k.repeat_interleave(heads // kvh, 0), v.repeat_interleave(heads // kvh, 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d) + torch.full((n, n), float("-inf")).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1) @ f["layers.0.self_attn.o_proj.weight"].T
    h = x + attn
    m = rms(h, f["layers.0.post_attention_layernorm.weight"])
    h = h + (nn.functional.silu(m @ f["layers.0.mlp.gate_proj.weight"].T) * (m @ f["layers.0.mlp.up_proj.weight"].T)
             ) @ f["layers.0.mlp.down_proj.weight"].T
    return h, h @ target.get_output_embeddings().weight.detach().T


def test_the_layer_computes_eagles_equations_from_the_file(pair, tmp_path):
    target = pair.target.module
    folder, f = eagle_file(tmp_path / "e", target)
    draft = eagle_layer(Checkpoint(folder, FILES, WHAT), target)
    feats, ids = torch.randn(5, target.config.hidden_size), torch.randint(0, target.config.vocab_size, (5,))
    emb = f["embed_tokens.weight"][ids]
    want, logits = eagle_by_hand(f, feats, emb, target)
    got = draft(feats[None], draft.embed(ids)[None])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(draft.head(got), logits, rtol=1e-4, atol=1e-3)
    assert torch.equal(draft.vocab_map, torch.arange(target.config.vocab_size))


@pytest.mark.parametrize("name", FILES)
def test_decoding_with_published_weights_equals_ar(pair, tmp_path, name):
    folder, _ = eagle_file(tmp_path / name, pair.target.module, bias=name.endswith(".bin"), layers=2, name=name)
    method = build(pair, "eagle", weights=str(folder))
    assert method.report["file"] == name and method.draft.module.published
    assert not type(method).trains(pair.spec, method.cfg)
    assert method.embed is method.draft.module.embed  # the file's own copy of the embedding
    assert_greedy_equal_to_ar(method, prompts_for(pair, 2), max_new=16)
    chain = build(pair, "eagle", weights=str(folder), draft="chain", gamma=2)
    assert_greedy_equal_to_ar(chain, prompts_for(pair, 1), max_new=20)
    assert pair.counts()["eagle"]["calls"] > 0


@pytest.fixture()
def one_layer(tiny_pair, tmp_path):
    """A one-layer target whose token embeddings have unit RMS, and an EAGLE file that is that very layer
    (``fc`` selects the embedding; no input norm then changes nothing): the draft is right most of the time and
    wrong some of it (it lacks the first token's key, and it skips the target's final norm), so the sampling test
    has power. Returns the pair and the folder."""
    pair = one_layer_pair(tiny_pair)
    model = pair.target.module
    cut = model.config
    H = cut.hidden_size
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(emb / emb.pow(2).mean(-1, keepdim=True).sqrt())
    tensors = {"embed_tokens.weight": emb.detach().clone(), "fc.bias": torch.zeros(H),
               "fc.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], 1)}  # [embedding; feature] -> embedding
    tensors.update({f"layers.0.{k}": v.detach().clone() for k, v in model.model.layers[0].state_dict().items()
                    if "input_layernorm" not in k})
    folder = tmp_path / "one-layer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": H, "intermediate_size": cut.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cut.num_attention_heads, "num_key_value_heads": cut.num_key_value_heads,
        "vocab_size": cut.vocab_size, "rms_norm_eps": cut.rms_norm_eps}))
    torch.save(tensors, folder / "pytorch_model.bin")
    return pair, folder


@pytest.mark.parametrize("draft", ["tree", "static"])  # EAGLE-2's dynamic tree, EAGLE-1's static one
def test_sampling_with_published_weights_follows_the_target(one_layer, draft):
    assert_published_follows_the_target(*one_layer, "eagle", draft=draft)


def refusal(pair, folder) -> str:
    return refusal_of(lambda: eagle_layer(Checkpoint(folder, FILES, WHAT), pair.target.module))


def test_mismatches_are_one_sentence(pair, tmp_path):
    target = pair.target.module
    H = target.config.hidden_size
    folder, _ = eagle_file(tmp_path / "nofc", target, drop=("fc.bias",))
    assert "has no tensor 'fc.bias'" in refusal(pair, folder)  # config says bias (absent: true), the file has none
    folder, _ = eagle_file(tmp_path / "norm", target, extra={"norm.weight": torch.ones(H)})
    assert "holds 'norm.weight'" in refusal(pair, folder)  # EAGLE-1/2 have no final norm
    folder, _ = eagle_file(tmp_path / "hidden", target, config_over={"hidden_size": 2 * H})
    assert "hidden_size: 128, but the target's is 64" in refusal(pair, folder)
    folder, _ = eagle_file(tmp_path / "ffn", target, config_over={"intermediate_size": 2 * target.config.intermediate_size})
    assert "'layers.0.mlp.gate_proj.weight' has shape" in refusal(pair, folder)
    folder, _ = eagle_file(tmp_path / "qwen", target, config_over={"model_type": "qwen2"})
    assert "model_type: qwen2" in refusal(pair, folder)
    (tmp_path / "noconfig").mkdir()
    torch.save({}, tmp_path / "noconfig" / "pytorch_model.bin")
    assert "has no config.json" in refusal(pair, tmp_path / "noconfig")


def test_koala_does_not_take_eagles_weights():
    from methods.registry import get_method

    with pytest.raises(BenchError, match="KOALA trains its own draft"):
        get_method("koala").check_settings({"eagle": {"weights": "/x"}})


def test_eagle1s_static_tree_is_filled_from_the_drafts_ranks(one_layer):
    """EAGLE-1's tree: 26 tokens scored per call, 5 deep, its first level the draft's own top 4 after the pending
    token (as EAGLE-2's dynamic tree's first level, whose top_k children of the root are the same ranks)."""
    from tests.helpers import repeating_prompt, run

    pair, folder = one_layer
    method = build(pair, "eagle", weights=str(folder), draft="static")
    assert len(method.static) == 26 and method.static.max_depth == 5
    out = run(method, repeating_prompt(pair), 12)
    assert out.extra["tree_tokens_per_call"] == 26 and out.extra["draft"] == "static"
    ids = repeating_prompt(pair)
    dynamic = build(pair, "eagle", weights=str(folder), top_k=4, depth=1, total_tokens=5)
    assert first_draft(method, ids).tree.tokens[1:5] == first_draft(dynamic, ids).tree.tokens[1:5]
    with pytest.raises(BenchError, match="static_tree 'eagle9' is not a known tree"):
        method.check_settings({"static_tree": "eagle9"})


def first_draft(method, ids):
    """The first proposal of a decode of ``ids``."""
    from tests.helpers import run

    drafts = []

    def propose(state):  # a generator of the draft's forwards, as the method's own
        drafts.append((yield from type(method).propose(method, state)))
        return drafts[-1]

    method.propose = propose
    try:
        run(method, ids, 3)
    finally:
        del method.propose
    return drafts[0]
