"""EAGLE-3 beyond the registry walk (``tests/methods/test_methods.py`` covers its defaults): the three feature
layers, the draft's forward against the paper's equations, the training-time test against drafting, training,
decoding (tree and chain) equal to ``ar``, counting, the cached draft's names, and bad input."""

import math

import pytest
import torch
from torch.nn import functional as F
from transformers import DynamicCache

from core.layer_taps import LayerTaps
from core.model_parts import decoder_layers
from methods.eagle._draft3 import (
    CountedEagle3,
    Eagle3Draft,
    eagle3_loss,
    feature_layers,
    unroll,
)
from tests.helpers import (
    assert_greedy_equal_to_ar,
    build,
    method_cfg,
    prompts_for,
    run,
)

# The authors' state dict (their cnets.Model, less the base model's embedding it reads): a published draft maps
# onto this module name for name.
AUTHORS_KEYS = {
    "d2t", "t2d", "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight",
}


@pytest.fixture(scope="module")
def random_draft(tiny_pair):
    """A draft of the tiny target with random weights at a scale where every term matters."""
    torch.manual_seed(0)
    draft = Eagle3Draft(tiny_pair.target.module.config, torch.tensor([0, 3, 10, 65, 101, 200]))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    return draft.eval()


def test_the_feature_layers_are_the_authors(tiny_pair):
    """Before decoder layers 2, n // 2 and n - 3 (the authors' rule: 2, 16, 29 of Llama's 32); where those are not
    three layers, the bottom, middle and top. The hooks read exactly transformers' ``hidden_states[i]``."""
    assert feature_layers(32) == (2, 16, 29) and feature_layers(30) == (2, 15, 27) and feature_layers(7) == (2, 3, 4)
    assert feature_layers(3) == (0, 1, 2) and feature_layers(4) == (0, 2, 3) and feature_layers(6) == (0, 3, 5)
    target = tiny_pair.target.module
    assert build(tiny_pair, "eagle3").layers == (0, 1, 2)
    ids = torch.tensor([prompts_for(tiny_pair, 1)[0]])
    before = [len(layer._forward_pre_hooks) for layer in decoder_layers(target)]  # a compiled model's own may be on
    with torch.no_grad(), LayerTaps(target, (0, 1, 2)) as taps:
        states = target(ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(taps.fused(), torch.cat([states[0], states[1], states[2]], -1))
    assert [len(layer._forward_pre_hooks) for layer in decoder_layers(target)] == before  # removed on exit


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_the_forward_is_the_papers_equations(random_draft):
    """At one position t: g = fc([l; m; h]), x = [RMS(e_{t+1}); RMS(g)], grouped-query attention with rotary over
    positions <= t, u = g + o_proj(attn), o = u + MLP(RMS(u)), logits = lm_head(RMS(o)): written out here from
    the module's tensors alone."""
    d, c = random_draft, random_draft.config
    H, heads, kv, hd, eps = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    T, t = 7, 5
    torch.manual_seed(1)
    fused, emb = torch.randn(1, T, 3 * H), torch.randn(1, T, H)
    with torch.no_grad():
        out = d(fused, emb)
        logits = d.logits(out)
    sd = {k: v for k, v in d.state_dict().items()}
    g = fused[0, : t + 1] @ sd["fc.weight"].T  # (t + 1, H): every position up to t
    x = torch.cat([rms(emb[0, : t + 1], sd["midlayer.input_layernorm.weight"], eps),
                   rms(g, sd["midlayer.hidden_norm.weight"], eps)], -1)
    q = (x[t] @ sd["midlayer.self_attn.q_proj.weight"].T).view(heads, hd)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(t + 1, kv, hd)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(t + 1, kv, hd)
    theta = c.rope_parameters["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)

    def rotate(vec, pos):  # the first and second halves of each head rotate as pairs (Llama's layout)
        ang = pos * inv
        a, b = vec[..., : hd // 2], vec[..., hd // 2 :]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)

    q = rotate(q, float(t))
    k = torch.stack([rotate(k[s], float(s)) for s in range(t + 1)])
    heads_out = []
    for h in range(heads):
        grp = h // (heads // kv)  # the key/value head this query head shares
        w = torch.softmax(k[:, grp] @ q[h] / math.sqrt(hd), 0)
        heads_out.append(w @ v[:, grp])
    u = g[t] + torch.cat(heads_out) @ sd["midlayer.self_attn.o_proj.weight"].T
    z = rms(u, sd["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(z @ sd["midlayer.mlp.gate_proj.weight"].T) * (z @ sd["midlayer.mlp.up_proj.weight"].T)) @ sd[
        "midlayer.mlp.down_proj.weight"].T
    o = u + mlp
    torch.testing.assert_close(out[0, t], o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[0, t], rms(o, sd["norm.weight"], eps) @ sd["lm_head.weight"].T, atol=1e-4,
                               rtol=1e-4)
    # The draft's own output (H wide) is read as is, the target's fused features (3H) through fc.
    with torch.no_grad():
        torch.testing.assert_close(d(out, emb), d(out, emb, DynamicCache()))
    assert set(d.state_dict()) == AUTHORS_KEYS
    assert torch.equal(d.vocab_map, torch.tensor([0, 3, 10, 65, 101, 200]))
    assert int(d.t2d.sum()) == 6 and torch.equal(d.d2t + torch.arange(6), d.vocab_map)


def test_the_training_time_test_is_drafting(random_draft):
    """Step j of the unrolled training pass at position t is what drafting computes: read the target's features
    of positions 0..t (a KV cache), then feed the draft its own output with each next token, one at a time."""
    d, H = random_draft, random_draft.hidden
    torch.manual_seed(2)
    T = 9
    fused, ids = torch.randn(2, T, 3 * H), torch.randint(0, 259, (2, T))
    embed = torch.nn.Embedding(259, H)
    with torch.no_grad():
        steps = unroll(d, fused, ids, embed, 4)
        for row, t in ((0, 0), (1, 4)):
            cache = DynamicCache()
            out = d(fused[row : row + 1, : t + 1], embed(ids[row : row + 1, 1 : t + 2]), cache)[:, -1:]
            torch.testing.assert_close(out[0, 0], steps[0][row, t], atol=1e-5, rtol=1e-5)
            for j in range(1, 4):
                out = d(out, embed(ids[row : row + 1, t + 1 + j : t + 2 + j]), cache)
                torch.testing.assert_close(out[0, 0], steps[j][row, t], atol=1e-5, rtol=1e-5)


def test_training_lowers_the_loss_and_reports(tiny_pair, random_draft):
    """The smoke recipe's training (seconds) reports held-out agreement per unrolled step, better after than
    before; and a few steps on one batch lower the training-time-test loss."""
    method = build(tiny_pair, "eagle3")
    r = method.report
    assert r["feature_layers"] == [0, 1, 2] and r["ttt_steps"] == 4 and len(r["agreement_after"]) == 4
    assert r["agreement_after"][0] > r["agreement_before"][0] and r["recipe"] == "smoke"
    target = tiny_pair.target.module
    store = tiny_pair.teacher.store(target, tiny_pair.tokenizer, "train")
    batch = store.rows(range(4), ("ids", "idx", "mask", "hidden"))
    with torch.no_grad(), LayerTaps(target, (0, 1, 2)) as taps:
        target(batch["ids"])
        batch["fused"] = taps.fused().clone()
    draft = Eagle3Draft.from_target(target, torch.arange(259))
    recipe, embed = method_cfg("eagle3").recipe, target.get_input_embeddings()
    rows = target.get_output_embeddings().weight.detach()
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = eagle3_loss(draft, batch, embed, rows, recipe)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("overrides", [{"draft": "chain", "gamma": 3}, {"top_k": 3, "depth": 5, "total_tokens": 12},
                                       {"draft": "static"}])
def test_chain_wider_and_static_trees_are_greedy_equal_to_ar(tiny_pair, looping_prompt, overrides):
    """(The default tree, and its sampling, are walked by tests/methods/test_methods.py.) The hooks go with the
    decode."""
    method = build(tiny_pair, "eagle3", **overrides)
    layers = decoder_layers(tiny_pair.target.module)
    before = [len(layer._forward_pre_hooks) for layer in layers]  # a compiled model's own may be on
    assert_greedy_equal_to_ar(method, prompts_for(tiny_pair, 1) + [looping_prompt], max_new=24)
    assert [len(layer._forward_pre_hooks) for layer in layers] == before


def test_the_draft_cache_holds_the_fused_true_features(tiny_pair, looping_prompt):
    """After many steps the draft's cache of the committed positions equals one pass over the target's three
    layers' features of the whole text (guesses dropped, true features read)."""
    from tests.helpers import run_keeping_state

    method = build(tiny_pair, "eagle3")
    out, state = run_keeping_state(method, looping_prompt, 20)
    seq, read = looping_prompt + out.output_ids, state.read
    target = tiny_pair.target.module
    with torch.no_grad(), LayerTaps(target, method.layers) as taps:
        target(torch.tensor([seq[:read]]))
        fresh = DynamicCache()
        method.draft.module(taps.fused(), method.embed(torch.tensor([seq[1 : read + 1]])), fresh)
    assert sum(a > 1 for a in out.accept_lengths) >= 1
    mine, ref = state.dcache.layers[0], fresh.layers[0]
    torch.testing.assert_close(mine.keys[..., :read, :], ref.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mine.values[..., :read, :], ref.values, atol=1e-4, rtol=1e-4)


def test_fc_is_counted_only_on_the_targets_features(random_draft):
    counted = CountedEagle3(random_draft)
    H, fc = random_draft.hidden, random_draft.fc.weight.numel()
    with torch.no_grad():
        counted(torch.randn(1, 3, 3 * H), torch.randn(1, 3, H), DynamicCache(), rows=1)
        fused = counted.flops
        counted.reset()
        counted(torch.randn(1, 3, H), torch.randn(1, 3, H), DynamicCache(), rows=1)
    assert fused - counted.flops == pytest.approx(2.0 * fc * 3)
    assert counted.calls == 1 and counted.tokens == 3


def test_bad_input_is_one_sentence(compose_cfg, capsys):
    from bench.__main__ import main

    assert main(["run", "pair=tiny", "method=eagle3", "recipe.store.hidden=false"]) == 2
    assert "method=eagle3 reads the target's hidden states" in capsys.readouterr().err
    assert main(["run", "pair=tiny", "method=eagle3", "method.recipe.ttt_steps=0"]) == 2
    assert "method.recipe.ttt_steps" in capsys.readouterr().err
    assert main(["run", "pair=tiny", "method=eagle3", "method.draft=graph"]) == 2
    assert "method.draft='graph' is not allowed; it takes one of: tree, chain" in capsys.readouterr().err


def test_the_cached_draft_loads_without_training(tiny_pair):
    from methods.eagle.eagle3 import Eagle3

    trained = build(tiny_pair, "eagle3")
    loaded = Eagle3(Eagle3.settings({}), tiny_pair)
    loaded.setup(train_if_missing=False)
    ids = prompts_for(tiny_pair, 1)[0]
    assert run(loaded, ids, 12).output_ids == run(trained, ids, 12).output_ids
    assert loaded.report == trained.report
