"""core.gqa_attention: masked multi-row forwards of GQA models give sdpa's logits with no copy of keys and values."""

import copy

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_module
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from core.gqa_attention import NAME, grouped_sdpa_forward, switch_on
from core.kv_cache import lm_forward
from decoding.tree import Tree, additive_mask

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=100)


def tiny(family: str, **over):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**TINY, **over})).eval()


def verification_logits(model) -> list[torch.Tensor]:
    """Every kind of forward a decode makes: a prefill, ``ar``'s one-row step, a chain of 5 after the cache (the
    causal mask materialised), a token tree (the harness's 4-D mask) and one row with a 4-D mask."""
    cache, out = DynamicCache(), []
    with torch.inference_mode():
        out.append(lm_forward(model, torch.arange(10)[None], cache).logits)
        out.append(lm_forward(model, torch.tensor([[3]]), cache).logits)
        out.append(lm_forward(model, torch.arange(20, 25)[None], cache).logits)
        past, tree = cache.get_seq_length(), Tree(1)
        for path in ([2, 3], [4], [5, 6, 7]):
            tree.add(path)
        out.append(lm_forward(model, torch.tensor([tree.tokens]), cache,
                              attention_mask=additive_mask(tree.ancestry(), past, torch.float32, "cpu"),
                              position_ids=(past + torch.tensor(tree.depth))[None]).logits)
        past = cache.get_seq_length()
        out.append(lm_forward(model, torch.tensor([[7]]), cache,
                              attention_mask=additive_mask(torch.ones(1, 1, dtype=torch.bool), past, torch.float32,
                                                           "cpu")).logits)
    return out


@pytest.fixture
def copies(monkeypatch):
    """How many times transformers' sdpa attention copies keys or values (``repeat_kv``)."""
    count = {"repeat_kv": 0}
    real = sdpa_module.repeat_kv

    def counted(hidden, n_rep):
        count["repeat_kv"] += 1
        return real(hidden, n_rep)

    monkeypatch.setattr(sdpa_module, "repeat_kv", counted)
    return count


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_grouped_attention_gives_sdpa_logits_without_the_copy(family, copies):
    model = tiny(family)
    grouped = copy.deepcopy(model)
    assert switch_on(grouped) and grouped.config._attn_implementation == NAME
    expected = verification_logits(model)
    assert copies["repeat_kv"] > 0  # sdpa copies for the masked multi-row forwards (if this fails, it stopped)
    copies["repeat_kv"] = 0
    got = verification_logits(grouped)
    assert copies["repeat_kv"] == 0
    for a, b in zip(expected, got, strict=True):  # bit for bit here; kernels may block rows differently elsewhere
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_heads", [1, 8])
def test_the_function_with_a_batch_and_a_mask_per_head(mask_heads):
    """Batch 2, 8 query heads on 2 key/value heads, a random boolean mask (each row keeps one key), one per head or
    shared: transformers' sdpa output, in its layout (B, q, H, d)."""
    torch.manual_seed(0)
    module = type("Attn", (), {"num_key_value_groups": 4, "is_causal": True, "training": False})()
    query = torch.randn(2, 3, 8, 16).transpose(1, 2)
    key, value = torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
    mask = torch.rand(2, mask_heads, 3, 11) > 0.5
    mask[..., 0] = True
    got, _ = grouped_sdpa_forward(module, query, key, value, mask, scaling=0.25)
    expected, _ = sdpa_module.sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert got.shape == (2, 3, 8, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_switch_on_leaves_other_models_alone():
    plain = tiny("llama", num_key_value_heads=4)  # no grouped heads: nothing copied, nothing to change
    assert not switch_on(plain) and plain.config._attn_implementation == "sdpa"
    eager = tiny("llama", attn_implementation="eager")
    assert not switch_on(eager) and eager.config._attn_implementation == "eager"
