"""The input-length axis (issue 41, item 7): ``dataset=long_input`` cuts packaged Wikipedia text to a set number of the
pair's tokens, then asks a question; the length names the dataset, so a sweep over lengths keeps them apart; a
prompt and budget past the target's context is one sentence."""

import pytest

from bench.data import encode, load_prompts
from bench.results import read_records
from core.errors import BenchError


def test_a_long_input_is_its_length_in_the_pairs_tokens_then_the_question(compose_cfg, tiny_pair):
    cfg = compose_cfg("pair=tiny", "dataset=long_input", "dataset.input_tokens=300")
    assert cfg.dataset.name == "long_input-300"
    prompts = load_prompts(cfg.dataset, cfg.seed)
    assert len(prompts) == 4 and len({p.prompt_id for p in prompts}) == 4
    tok = tiny_pair.tokenizer
    question = tok(cfg.dataset.question, add_special_tokens=False)["input_ids"]
    for p in prompts:
        ids = encode(p, tok)
        assert 300 + len(question) <= len(ids) <= 300 + len(question) + 16  # the text, the question, the template
        assert tok.decode(ids).rstrip().endswith(cfg.dataset.question)
    other = load_prompts(compose_cfg("pair=tiny", "dataset=long_input", "dataset.input_tokens=40").dataset, cfg.seed)
    assert len(encode(other[0], tok)) < 40 + len(question) + 17


def test_lengths_and_batch_sizes_in_one_run_each_lossless(compose_cfg, tmp_path):
    from bench.runner import run

    run(compose_cfg("pair=tiny", "method=pld", "dataset=long_input", "dataset.input_tokens=200", "dataset.n_prompts=3",
                    "batch_size=2", "max_new_tokens=8", "warmup=0"), tmp_path)
    records = read_records(tmp_path / "records.jsonl")
    assert len(records) == 6 and {r["dataset"] for r in records} == {"long_input-200"}
    assert all(r["input_tokens"] == len(r["prompt_ids"]) > 200 and r["matches_baseline"] is not False for r in records)


def test_a_prompt_past_the_targets_context_is_one_sentence(compose_cfg, tmp_path):
    from bench.runner import run

    cfg = compose_cfg("pair=tiny", "method=ar", "dataset=long_input", "dataset.input_tokens=4090",
                      "dataset.n_prompts=1", "max_new_tokens=16", "warmup=0")
    with pytest.raises(BenchError, match=r"passes the target's context of 4096 positions"):
        run(cfg, tmp_path)
    assert not (tmp_path / "records.jsonl").exists()


def test_a_prompt_past_a_sliding_window_is_one_sentence(compose_cfg, tmp_path):
    """The harness's own attention masks (trees, the static cache) attend over every cached position, so a run whose
    sequences pass a model's sliding window would decode other tokens than the model's: refused before any decode."""
    from transformers import MistralConfig, Qwen2Config

    from bench.runner import run, sliding_window

    cfg = compose_cfg("pair=tiny_mistral", "pair.target.config.sliding_window=64", "method=ar", "dataset=long_input",
                      "dataset.input_tokens=60", "dataset.n_prompts=1", "max_new_tokens=16", "warmup=0")
    with pytest.raises(BenchError, match=r"passes the target's sliding attention window of 64 positions, which the "):
        run(cfg, tmp_path)
    assert not (tmp_path / "records.jsonl").exists()
    assert sliding_window(MistralConfig(sliding_window=None)) is None
    assert sliding_window(Qwen2Config(use_sliding_window=False, sliding_window=64)) is None
    assert sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=64)) == 64
