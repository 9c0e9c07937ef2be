"""core.kv_cache: the cache reaches the model under the installed release's name, every call site goes through it,
and a model whose cached forward is not the same as reading the tokens whole is refused in one sentence."""

import ast
import inspect

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from core import kv_cache
from core.kv_cache import CACHE_ARG, cache_of, check_cache_used, lm_forward
from tests.helpers import ROOT, refusal_of

PACKAGES = ("core", "decoding", "training", "methods", "bench", "scripts")


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=50)
    return AutoModelForCausalLM.from_config(config).eval()


class DropsTheCache(nn.Module):
    """What a release that names the cache otherwise does: the keyword is swallowed, nothing is cached."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, use_cache=False, **kwargs):
        kwargs.pop(CACHE_ARG, None)
        return self.inner(input_ids=input_ids, use_cache=False, **kwargs)


class FillsButDoesNotRead(DropsTheCache):
    """A forward that extends the cache it is given but computes the new tokens as if nothing came before."""

    def forward(self, input_ids, use_cache=False, **kwargs):
        cache = kwargs.pop(CACHE_ARG, None)
        if cache is not None:
            self.inner(input_ids=input_ids, use_cache=True, **{CACHE_ARG: cache}, **kwargs)
        return self.inner(input_ids=input_ids, use_cache=False, **kwargs)


def test_the_cache_argument_is_the_installed_forwards():
    assert CACHE_ARG in inspect.signature(LlamaForCausalLM.forward).parameters
    assert f'"transformers>={kv_cache.OLDEST},' in (ROOT / "pyproject.toml").read_text()  # the oldest declared


def test_a_cached_forward_extends_the_cache_and_equals_the_whole_sequence():
    model, ids = tiny_llama(), torch.tensor([[3, 9, 4, 7, 1, 8, 2]])
    cache = DynamicCache()
    with torch.no_grad():
        whole = lm_forward(model, ids).logits
        first = lm_forward(model, ids[:, :5], cache)
        assert cache.get_seq_length() == 5 and cache_of(first) is cache
        last = lm_forward(model, ids[:, 5:], cache).logits
    assert cache.get_seq_length() == 7
    torch.testing.assert_close(last, whole[:, 5:], atol=1e-5, rtol=1e-5)


def test_a_working_model_passes_the_guard():
    check_cache_used(tiny_llama(), "the target")


@pytest.mark.parametrize("broken", [DropsTheCache, FillsButDoesNotRead])
def test_a_model_that_ignores_the_cache_is_refused_naming_the_release(broken):
    said = refusal_of(check_cache_used, broken(tiny_llama()), "the target")
    assert said.startswith("the target ignores the KV cache") and transformers.__version__ in said
    assert ("holds 0" in said) == (broken is DropsTheCache)


def test_loading_a_pair_refuses_a_release_that_names_the_cache_otherwise(compose_cfg, monkeypatch):
    """The defect this guard exists for: the harness passing the cache under a name the installed forward does not
    take (as `cache=` on transformers < 5.24). Before, every method agreed with `ar` on the same wrong tokens."""
    from bench.models import load_pair

    monkeypatch.setattr(kv_cache, "CACHE_ARG", "a_name_this_release_does_not_take")
    said = refusal_of(load_pair, compose_cfg("pair=tiny"))
    assert said.startswith("the target ignores the KV cache the harness hands it (after reading 6 tokens its KV "
                           "cache holds 0)")


def test_ar_is_the_argmax_of_cache_free_forwards(tiny_pair):
    """`ar` judges every method; here it is judged by the plainest decoding there is: the whole sequence read
    again, without any cache, for each new token."""
    from tests.helpers import cache_free_greedy, decode, prompts_for

    prompt = prompts_for(tiny_pair, 1)[0]
    assert decode(tiny_pair, "ar", prompt, max_new=12).output_ids == cache_free_greedy(tiny_pair, prompt, 12)


def _cache_keywords(tree) -> list[int]:
    """Lines that spell the cache's keyword for a transformers forward themselves (``use_cache=``,
    ``past_key_values``) or read an output's ``.past_key_values``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("use_cache", "past_key_values"):
            lines.append(node.value.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "past_key_values":
            lines.append(node.lineno)
    return lines


def test_only_kv_cache_names_the_cache_to_transformers():
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "kv_cache.py":
                lines = _cache_keywords(ast.parse(path.read_text()))
                if lines:
                    found[str(path.relative_to(ROOT))] = lines
    assert found == {}, "call core.kv_cache.lm_forward / cache_kwargs instead"
