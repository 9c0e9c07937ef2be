"""The analytic FLOPs formula against torch's own FlopCounterMode, on real model code."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from core.counting import CountedLM


def _measured(lm, ids, cache, **kw):
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        lm(ids, cache, **kw)
    return counter.get_total_flops()


def _models():
    # Eager attention: its matmuls are visible to FlopCounterMode (the CPU SDPA kernel is not counted by it);
    # the arithmetic is the same whichever kernel runs.
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager"))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, attn_implementation="eager"))
    return {"llama": llama, "gpt2": gpt2}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("prompt_len,new", [(17, 1), (9, 5)])
def test_formula_matches_flop_counter(name, prompt_len, new):
    model = _models()[name].eval()
    lm = CountedLM(model, "target")
    cache = DynamicCache()
    ids = torch.randint(0, 300, (1, prompt_len))
    lm.reset()
    measured_prefill = _measured(lm, ids, cache)
    assert lm.flops == pytest.approx(measured_prefill, rel=0.02)
    lm.reset()
    measured_step = _measured(lm, torch.randint(0, 300, (1, new)), cache)
    assert lm.flops == pytest.approx(measured_step, rel=0.02)


def test_logits_to_keep_is_accounted():
    model = _models()["llama"].eval()
    lm = CountedLM(model, "target")
    ids = torch.randint(0, 300, (1, 12))
    measured = _measured(lm, ids, DynamicCache(), logits_to_keep=1)
    lm.reset()
    lm(ids, DynamicCache(), logits_to_keep=1)
    assert lm.flops == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_prefix_layer_formula_matches_flop_counter(name):
    """Hydra++'s prefix layer (one decoder layer over hidden states, with its own cache) is counted by the
    same formula: its prefill and a later multi-token step agree with torch's count."""
    from methods.heads._heads import CountedPrefix, PrefixLayer

    layer = CountedPrefix(PrefixLayer.from_target(_models()[name]).eval())
    cache = DynamicCache()
    for new in (9, 3):
        hidden = torch.randn(1, new, 64)
        layer.reset()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            layer(hidden, cache)
        assert layer.calls == 1 and layer.flops == pytest.approx(counter.get_total_flops(), rel=0.02)
