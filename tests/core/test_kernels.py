"""core.kernels: the row-count-dependent CPU linear gives F.linear's numbers and changes nothing else."""

import copy

import pytest
import torch
from torch import nn

from core.flops import matmul_weights
from core.kernels import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not available")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (4, 24), (1, 7, 24), (2, 5, 24), (16, 24)])
def test_packed_linear_equals_plain_linear(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(24, 40, bias=bias)
    ref = copy.deepcopy(lin)
    assert pack_linears(lin) == 1 and isinstance(lin, PackedLinear)
    x = torch.randn(shape)
    with torch.no_grad():
        out = lin(x)
        assert out.shape == (*shape[:-1], 40)
        torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)
    # Only forwards of at least MIN_ROWS rows are packed (until the kernels are timed): the one-row path stays plain.
    assert (lin._packed is not None) == lin.uses_packed(x.numel() // 24)


def test_parameters_tying_state_dict_and_flops_are_unchanged():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    params, keys, weights = list(model.parameters()), list(model.state_dict()), matmul_weights(model)
    x = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        before = model(x).logits
    assert pack_linears(model) == 2 * 7 + 1  # 7 per layer (q, k, v, o, gate, up, down) + the head
    assert all(a is b for a, b in zip(params, model.parameters())) and list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert matmul_weights(model) == weights
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, before, rtol=1e-4, atol=1e-4)
    copy.deepcopy(model)  # the opaque packed weights are dropped from copies, not copied


def test_a_changed_weight_is_repacked():
    lin = nn.Linear(8, 8)
    pack_linears(lin)
    x = torch.randn(6, 8)
    with torch.no_grad():
        lin(x)
        lin.weight.mul_(2.0)  # in place: the packed copy is stale now
        torch.testing.assert_close(lin(x), nn.functional.linear(x, lin.weight, lin.bias))
        lin.weight = nn.Parameter(torch.randn(8, 8))  # replaced
        torch.testing.assert_close(lin(x), nn.functional.linear(x, lin.weight, lin.bias))


def test_autograd_takes_the_plain_path():
    torch.manual_seed(0)
    lin, ref = nn.Linear(8, 4), None
    ref = copy.deepcopy(lin)
    pack_linears(lin)
    x = torch.randn(6, 8)
    lin(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    assert lin._packed is None


def test_load_pair_packs_cpu_fp32_models_unless_switched_off(compose_cfg):
    from bench.models import load_pair

    on = load_pair(compose_cfg("pair=tiny"))
    assert isinstance(on.target.module.lm_head, PackedLinear) and isinstance(on.draft.module.lm_head, PackedLinear)
    off = load_pair(compose_cfg("pair=tiny", "packed_linear=false"))
    assert type(off.target.module.lm_head) is nn.Linear


def test_each_forward_size_takes_the_kernel_timed_faster_for_it(monkeypatch):
    """choose_kernels times forwards of each timed size both ways and keeps the faster per size: plain decoding and
    verification are never taxed by a kernel this machine runs slower for their size. The clock is faked so that
    the packed weights win at 2 and 8 rows and lose at 1, 3 and 4; an untimed size takes the next larger timed one's
    choice, a size beyond the largest takes the largest's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import core.kernels

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    pack_linears(model)
    real = core.kernels.clocked
    packed_wins = {2, 8}

    def fake(device, fn, model_, ids, *args, **kwargs):
        out, _ = real(device, fn, model_, ids, *args, **kwargs)
        packed = model.lm_head.uses_packed(1)
        return out, (0.01 if packed == (ids.shape[1] in packed_wins) else 0.02)

    monkeypatch.setattr(core.kernels, "clocked", fake)
    got = core.kernels.choose_kernels(model, rows=(1, 2, 3, 4, 8), reps=3, past=5)
    assert got["by_rows"] == {1: "plain", 2: "packed", 3: "plain", 4: "plain", 8: "packed"}
    assert got["plain_ms"][2] == 20.0 and got["packed_ms"][2] == 10.0
    lin = model.lm_head
    assert [lin.uses_packed(r) for r in range(1, 11)] == [False, True, False, False, True, True, True, True, True, True]
    x = torch.randn(1, 2, cfg.hidden_size)
    with torch.inference_mode():
        lin(x)
    assert lin._packed is not None  # 2 rows went to the packed weights
    assert core.kernels.choose_kernels(nn.Linear(3, 3)) is None  # nothing packed: nothing to choose


def test_load_pair_records_each_models_kernels(compose_cfg):
    from bench.models import load_pair

    pair = load_pair(compose_cfg("pair=tiny"))
    assert set(pair.kernels) == {"target", "draft"}
    for role, lm in (("target", pair.target), ("draft", pair.draft)):
        for rows, chosen in pair.kernels[role]["by_rows"].items():
            assert lm.module.lm_head.uses_packed(rows) == (chosen == "packed")
    assert load_pair(compose_cfg("pair=tiny", "packed_linear=false")).kernels == {}
