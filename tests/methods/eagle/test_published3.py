"""The authors' published EAGLE-3 draft (``method=eagle3 method.weights=DIR``), on the tiny pair: a checkpoint
written in their layout (their state-dict names, ``d2t`` / ``t2d``, ``draft_vocab_size``) loads tensor for tensor,
decodes equal to ``ar``, and every mismatch is one sentence. A draft half as wide as its target
(``target_hidden_size``: its own token embedding, ``fc`` 3H_t -> H) computes the paper's equations from its file's
tensors, decodes equal to ``ar`` and comes back from its converted cache the same."""

import dataclasses
import json
import math

import pytest
import torch
from torch.nn import functional as F
from transformers import DynamicCache

import methods.eagle._published3 as published
from core.checkpoints import Checkpoint
from methods.eagle._draft3 import Eagle3Draft
from methods.eagle._published3 import FILES, WHAT, eagle3_draft, load_published_eagle3
from tests.helpers import assert_greedy_equal_to_ar, build, prompts_for, refusal_of


@pytest.fixture()
def pair(tiny_pair):
    return dataclasses.replace(tiny_pair, roles={})


def eagle3_file(folder, target, vocab_map=None, drop=(), extra=None, config_over=None, seed=0):
    """EAGLE-3's published files for ``target``: the draft's state dict under the authors' names (no ``d2t`` /
    ``t2d`` when the draft vocabulary is the whole one, as the authors' loader deletes them) and its config."""
    c = target.config
    vocab_map = torch.arange(c.vocab_size) if vocab_map is None else vocab_map
    torch.manual_seed(seed)
    draft = Eagle3Draft(c, vocab_map)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    tensors = {k: v.clone() for k, v in draft.state_dict().items()}
    if len(vocab_map) == c.vocab_size:
        del tensors["d2t"], tensors["t2d"]
    for key in drop:
        del tensors[key]
    tensors.update(extra or {})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
              "draft_vocab_size": len(vocab_map), "rms_norm_eps": 1e-6, **(config_over or {})}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(tensors, folder / "pytorch_model.bin")
    return folder, draft.eval()


def test_a_published_draft_loads_tensor_for_tensor_and_decodes_as_ar(pair, tmp_path):
    vocab_map = torch.tensor(sorted(torch.randperm(pair.target.module.config.vocab_size)[:100].tolist()))
    folder, written = eagle3_file(tmp_path / "e3", pair.target.module, vocab_map)
    method = build(pair, "eagle3", weights=str(folder))
    loaded = method.draft.module
    assert torch.equal(loaded.vocab_map, vocab_map) and torch.equal(loaded.t2d, written.t2d)
    for name, value in written.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name].float(), value.float())
    assert not type(method).trains(pair.spec, method.cfg) and method.report["file"] == "pytorch_model.bin"
    assert_greedy_equal_to_ar(method, prompts_for(pair, 2), max_new=16)


def test_the_whole_vocabulary_needs_no_d2t(pair, tmp_path):
    folder, _ = eagle3_file(tmp_path / "full", pair.target.module)
    draft = eagle3_draft(Checkpoint(folder, FILES, WHAT), pair.target.module)
    assert torch.equal(draft.vocab_map, torch.arange(pair.target.module.config.vocab_size))


def refusal(pair, folder) -> str:
    return refusal_of(lambda: eagle3_draft(Checkpoint(folder, FILES, WHAT), pair.target.module))


def test_the_layer_is_built_from_the_drafts_own_config(pair, tmp_path):
    """As wide as the target too, the layer's rotary and norm epsilon are its config's (the authors' EConfig), not
    the target's: a Llama-3.1 draft's config cannot say the target's llama3 scaling."""
    target = pair.target.module
    folder, _ = eagle3_file(tmp_path / "own", target, config_over={"rope_theta": 5000.0, "rms_norm_eps": 1e-5})
    draft = eagle3_draft(Checkpoint(folder, FILES, WHAT), target)
    assert draft.config.rope_parameters == {"rope_type": "default", "rope_theta": 5000.0}
    assert draft.config.rms_norm_eps == 1e-5 and draft.embed_tokens is None  # the target's embedding is read
    folder, _ = eagle3_file(tmp_path / "plain", target)  # no rope_theta: EConfig's 10000
    assert eagle3_draft(Checkpoint(folder, FILES, WHAT), target).config.rope_parameters["rope_theta"] == 10000.0


def test_mismatches_are_one_sentence(pair, tmp_path):
    target = pair.target.module
    V, H = target.config.vocab_size, target.config.hidden_size
    part = torch.arange(0, V, 2)
    bad_t2d = torch.zeros(V, dtype=torch.bool)
    folder, _ = eagle3_file(tmp_path / "t2d", target, part, extra={"t2d": bad_t2d})
    assert "'d2t' and 't2d' do not describe the same draft vocabulary" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "nod2t", target, part, drop=("d2t",))
    assert "has no tensor 'd2t'" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "extra", target, extra={"layers.0.mlp.up_proj.weight": torch.zeros(2)})
    assert "holds 'layers.0.mlp.up_proj.weight'" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "emb", target, extra={"embed_tokens.weight": torch.zeros(V, H)})
    assert "is not this target's token embedding" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "wide", target, config_over={"target_hidden_size": 2 * H})
    assert f"target_hidden_size: {2 * H}, but this target's is {H}" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "kv", target, config_over={"num_key_value_heads": 1})
    assert "'midlayer.self_attn.k_proj.weight' has shape" in refusal(pair, folder)  # the config's heads are read
    folder, _ = eagle3_file(tmp_path / "own", target, extra={"embed_tokens.weight": target.get_input_embeddings().weight.detach()})
    assert eagle3_draft(Checkpoint(folder, FILES, WHAT), target) is not None  # the target's own embedding: fine


# ------------------------------------------------------------------------------- a draft narrower than its target


def narrow_file(folder, target, vocab_map=None, drop=(), config_over=None, seed=0):
    """A published EAGLE-3 draft half as wide as ``target`` (its ``target_hidden_size``), its tensors drawn from the
    authors' shapes alone (``cnets.Model`` with ``target_hidden_size``: ``embed_tokens (V, H)``, ``fc (H, 3H_t)``,
    heads H / num_attention_heads wide, q/k/v reading 2H): a head_dim (8), norm epsilon (large enough to matter)
    and rotary settings (base 5000, linear factor 2) of its own. Returns the folder, the file's tensors and its
    config."""
    c = target.config
    Ht, V = c.hidden_size, c.vocab_size
    H, heads, kv, inter = Ht // 2, 4, 2, 48
    d = H // heads
    vocab_map = torch.arange(V) if vocab_map is None else vocab_map
    shapes = {"embed_tokens.weight": (V, H), "fc.weight": (H, 3 * Ht), "midlayer.hidden_norm.weight": (H,),
              "midlayer.input_layernorm.weight": (H,), "midlayer.self_attn.q_proj.weight": (heads * d, 2 * H),
              "midlayer.self_attn.k_proj.weight": (kv * d, 2 * H), "midlayer.self_attn.v_proj.weight": (kv * d, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, heads * d), "midlayer.mlp.gate_proj.weight": (inter, H),
              "midlayer.mlp.up_proj.weight": (inter, H), "midlayer.mlp.down_proj.weight": (H, inter),
              "midlayer.post_attention_layernorm.weight": (H,), "norm.weight": (H,),
              "lm_head.weight": (len(vocab_map), H)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=gen) * 0.3 for name, shape in shapes.items()}
    if len(vocab_map) < V:
        tensors["d2t"] = vocab_map - torch.arange(len(vocab_map))
        tensors["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, vocab_map, True)
    for key in drop:
        del tensors[key]
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "target_hidden_size": Ht, "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv, "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": len(vocab_map),
              "rms_norm_eps": 1e-2, "rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 2.0},
              **(config_over or {})}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(tensors, folder / "pytorch_model.bin")
    return folder, tensors, config


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def reference(f: dict, config: dict, fused: torch.Tensor, ids: torch.Tensor, t: int):
    """The draft's output ``(H,)`` and logits ``(V',)`` at position ``t`` of ``fused (T, 3H_t)`` (the target's three
    layers) and ``ids (T,)`` (the token after each position), from the file's tensors ``f`` and ``config`` alone:
    e = embed_tokens[x_{t+1}] (the file's), g = fc([l; m; h]), x = [RMS(e); RMS(g)], grouped-query attention over
    positions <= t with rotary at position / factor, u = g + o_proj(attn), o = u + MLP(RMS(u)),
    logits = lm_head(RMS(o))."""
    heads, kv, eps = config["num_attention_heads"], config["num_key_value_heads"], config["rms_norm_eps"]
    hd = config["hidden_size"] // heads  # the authors' cnets.py: hidden_size / num_attention_heads
    g = fused[: t + 1] @ f["fc.weight"].T
    e = f["embed_tokens.weight"][ids[: t + 1]]
    x = torch.cat([rms(e, f["midlayer.input_layernorm.weight"], eps), rms(g, f["midlayer.hidden_norm.weight"], eps)],
                  -1)
    q = (x[t] @ f["midlayer.self_attn.q_proj.weight"].T).view(heads, hd)
    k = (x @ f["midlayer.self_attn.k_proj.weight"].T).view(t + 1, kv, hd)
    v = (x @ f["midlayer.self_attn.v_proj.weight"].T).view(t + 1, kv, hd)
    inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)  # cnets.py's linear rotary: base 10000, always

    def rotate(vec, pos):  # linear scaling: position / factor; halves of each head rotate as pairs (Llama's layout)
        ang = pos / config["rope_scaling"]["factor"] * inv
        a, b = vec[..., : hd // 2], vec[..., hd // 2 :]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)

    q = rotate(q, float(t))
    k = torch.stack([rotate(k[s], float(s)) for s in range(t + 1)])
    outs = []
    for h in range(heads):
        grp = h // (heads // kv)
        w = torch.softmax(k[:, grp] @ q[h] / math.sqrt(hd), 0)
        outs.append(w @ v[:, grp])
    u = g[t] + torch.cat(outs) @ f["midlayer.self_attn.o_proj.weight"].T
    z = rms(u, f["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(z @ f["midlayer.mlp.gate_proj.weight"].T) * (z @ f["midlayer.mlp.up_proj.weight"].T)) @ f[
        "midlayer.mlp.down_proj.weight"].T
    o = u + mlp
    return o, rms(o, f["norm.weight"], eps) @ f["lm_head.weight"].T


def test_a_narrower_draft_is_the_papers_equations_over_its_files_tensors(pair, tmp_path):
    target = pair.target.module
    Ht, V = target.config.hidden_size, target.config.vocab_size
    vocab_map = torch.arange(0, V, 3)
    folder, f, config = narrow_file(tmp_path / "e3-narrow-eq", target, vocab_map)
    draft = eagle3_draft(Checkpoint(folder, FILES, WHAT), target)
    assert draft.hidden == Ht // 2 and draft.target_hidden == Ht and draft.config.head_dim == 8
    assert torch.equal(draft.vocab_map, vocab_map)
    T, t = 7, 5
    torch.manual_seed(1)
    fused, ids = torch.randn(1, T, 3 * Ht), torch.randint(0, V, (1, T))
    with torch.no_grad():
        out = draft(fused, draft.embed_tokens(ids))
        logits = draft.logits(out)
        o, ref = reference(f, config, fused[0], ids[0], t)
        torch.testing.assert_close(out[0, t], o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[0, t], ref, atol=1e-4, rtol=1e-4)
        # Its own outputs (H wide) are read as is, and a KV cache gives what the whole sequence does.
        cache = DynamicCache()
        first = draft(fused[:, :t], draft.embed_tokens(ids[:, :t]), cache)
        torch.testing.assert_close(draft(fused[:, t:], draft.embed_tokens(ids[:, t:]), cache), out[:, t:])
        torch.testing.assert_close(first, out[:, :t])
        assert draft(out, draft.embed_tokens(ids)).shape == out.shape


def test_a_narrower_draft_decodes_as_ar_with_its_own_embedding(pair, tmp_path):
    target = pair.target.module
    vocab_map = torch.tensor(sorted(torch.randperm(target.config.vocab_size)[:100].tolist()))
    folder, f, _ = narrow_file(tmp_path / "e3-narrow-decode", target, vocab_map, seed=3)
    method = build(pair, "eagle3", weights=str(folder))
    draft = method.draft.module
    assert method.embed is draft.embed_tokens  # not the target's
    torch.testing.assert_close(draft.embed_tokens.weight.float(), f["embed_tokens.weight"])
    assert_greedy_equal_to_ar(method, prompts_for(pair, 2), max_new=16)


def test_a_narrower_draft_comes_back_from_its_cache_the_same(pair, tmp_path, monkeypatch):
    target = pair.target.module
    folder, _, _ = narrow_file(tmp_path / "e3-narrow-cache", target, torch.arange(0, target.config.vocab_size, 2))
    read = eagle3_draft(Checkpoint(folder, FILES, WHAT), target)
    first, _ = load_published_eagle3(str(folder), target, pair.cache)  # converted, written, read back
    monkeypatch.setattr(published, "eagle3_draft", lambda *args: pytest.fail("converted again"))
    second, report = load_published_eagle3(str(folder), target, pair.cache)  # the cached blob alone
    assert report["file"] == "pytorch_model.bin"
    torch.manual_seed(2)
    fused, ids = torch.randn(1, 5, 3 * target.config.hidden_size), torch.randint(0, target.config.vocab_size, (1, 5))
    for draft in (first, second):
        assert draft.config.to_dict() == read.config.to_dict()
        assert draft.state_dict().keys() == read.state_dict().keys()
        assert all(torch.equal(value, read.state_dict()[name]) for name, value in draft.state_dict().items())
        with torch.no_grad():
            torch.testing.assert_close(draft.logits(draft(fused, draft.embed_tokens(ids))),
                                       read.logits(read(fused, read.embed_tokens(ids))))
    monkeypatch.setattr(published, "READER", published.READER + 1)  # a newer reading of the layout
    with pytest.raises(pytest.fail.Exception, match="converted again"):
        load_published_eagle3(str(folder), target, pair.cache)  # does not take what an older one converted


def test_a_narrower_drafts_mismatches_are_one_sentence(pair, tmp_path):
    target = pair.target.module
    Ht = target.config.hidden_size
    folder, _, _ = narrow_file(tmp_path / "noemb", target, drop=("embed_tokens.weight",))
    assert (f"has no 'embed_tokens.weight': a draft {Ht // 2} wide (hidden_size) for a target {Ht} wide"
            in refusal(pair, folder))
    folder, _, _ = narrow_file(tmp_path / "other", target, config_over={"target_hidden_size": 2 * Ht})
    assert f"target_hidden_size: {2 * Ht}, but this target's is {Ht}" in refusal(pair, folder)
    folder, _, _ = narrow_file(tmp_path / "hd", target, config_over={"head_dim": 16})
    assert "head_dim: 16, but the authors' draft layer has heads of hidden_size / num_attention_heads = 8" in refusal(
        pair, folder)
    dynamic = {"rope_scaling": {"type": "dynamic", "factor": 2.0}}
    folder, _, _ = narrow_file(tmp_path / "ntk", target, config_over=dynamic)
    assert 'rope_scaling: {"type": "dynamic", "factor": 2.0}' in refusal(pair, folder)
    folder, _, config = narrow_file(tmp_path / "nott", target)
    del config["target_hidden_size"]  # then the authors' fc reads 3 x hidden_size: made for a narrower target
    (folder / "config.json").write_text(json.dumps(config))
    assert f"hidden_size: {Ht // 2}, but this target's is {Ht}" in refusal(pair, folder)
