"""Quality figures of lossy methods on hand-made examples, and their place in a run's records."""

import json
import math

import pytest
import torch

from core.kv_cache import lm_forward
from bench import quality


def test_token_agreement_counts_length_mismatch():
    assert quality.token_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.75
    assert quality.token_agreement([1, 2, 3], [1, 2, 3, 4]) == 0.75  # the missing position disagrees
    assert quality.token_agreement([1, 2, 3, 4, 5, 6], [1, 2, 3]) == 0.5
    assert quality.token_agreement([], []) == 1.0
    assert quality.token_agreement([], [1]) == 0.0


def test_prefix_agreement_stops_at_first_divergence():
    assert quality.prefix_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert quality.prefix_agreement([7, 2, 3, 4], [1, 2, 3, 4]) == 0.0
    assert quality.prefix_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert quality.prefix_agreement([1, 2, 3], [1, 2, 3]) == 1.0


def test_rouge_l():
    assert quality.rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    # LCS 2 of 2 candidate words and 3 reference words: P = 1, R = 2/3, F1 = 0.8.
    assert quality.rouge_l("the cat", "the cat sat") == pytest.approx(0.8)
    assert quality.rouge_l("dogs bark", "the cat sat") == 0.0
    assert quality.rouge_l("你好", "你好") == 1.0  # identical, though the scorer keeps no word of it


def test_final_number_and_reference_score():
    assert quality.final_number("3 apples and 4 pears make 7.") == 7.0
    assert quality.final_number("The total is $1,234.50 dollars") == 1234.5
    assert quality.final_number("no digits here") is None
    assert quality.reference_score("math_reasoning", "... so she pays 18 dollars.", "18") == ("exact_match", 1.0)
    assert quality.reference_score("math_reasoning", "18 then 19", "18") == ("exact_match", 0.0)
    assert quality.reference_score("math_reasoning", "I do not know", "18") == ("exact_match", 0.0)
    metric, score = quality.reference_score("summarization", "the cat", "the cat sat")
    assert metric == "rougeL" and score == pytest.approx(0.8)


def test_perplexity_matches_a_step_by_step_computation_and_is_not_counted(tiny_pair):
    from transformers import DynamicCache

    prompt, output = [5, 6, 7, 8], [9, 10, 11]
    target = tiny_pair.target
    cache, nll = DynamicCache(), 0.0
    with torch.inference_mode():
        logits = lm_forward(target.module, torch.tensor([prompt]), cache).logits[0, -1]
        for tok in output:
            nll -= float(torch.log_softmax(logits.float(), -1)[tok])
            logits = lm_forward(target.module, torch.tensor([[tok]]), cache).logits[0, -1]
    tiny_pair.reset_counts()
    assert quality.perplexity(tiny_pair, prompt, output) == pytest.approx(math.exp(nll / 3), rel=1e-4)
    assert tiny_pair.target.calls == 0
    assert math.isnan(quality.perplexity(tiny_pair, prompt, []))


def test_summarize_quality_averages_per_metric():
    recs = [{"quality": {"token_agreement": 1.0, "reference_metric": "exact_match", "reference_score": 1.0, "perplexity": 2.0}},
            {"quality": {"token_agreement": 0.5, "reference_metric": "rougeL", "reference_score": 0.2, "perplexity": 4.0}},
            {"quality": {"token_agreement": 0.0, "perplexity": 9.0}}]
    s = quality.summarize_quality(recs)
    assert s["token_agreement"] == 0.5 and s["exact_match"] == 1.0 and s["rougeL_vs_reference"] == 0.2
    assert s["perplexity"] == 4.0 and math.isnan(s["perplexity_baseline"])
    assert quality.summarize_quality([{"method": "ar"}]) == {}


def test_lossy_records_carry_quality(compose_cfg, tmp_path):
    """A sprinter run on the tiny pair: its records carry `quality`, ar's do not; the quality forward is not
    counted; the summary has quality columns for sprinter only."""
    from bench.runner import run
    from tests.methods.test_sprinter import TINY_RECIPE

    overrides = [f"method.verifier.{k}={v}" for k, v in TINY_RECIPE.items()]
    cfg = compose_cfg("pair=tiny", "method=sprinter", "max_new_tokens=12", "dataset.n_prompts=6", "warmup=0",
                      "method.max_run=4", *overrides)
    summary = run(cfg, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    spr = [r for r in records if r["method"] == "sprinter"]
    assert len(spr) == 6 and not any("quality" in r for r in records if r["method"] == "ar")
    for r in spr:
        assert r["lossless"] is False
        q = r["quality"]
        assert {"token_agreement", "prefix_agreement", "rougeL_vs_baseline", "perplexity", "perplexity_baseline"} <= q.keys()
        assert 0 <= q["token_agreement"] <= 1 and q["perplexity"] > 1
        assert r["target_calls"] == 1 + len(r["accept_lengths"])  # the perplexity forward is not counted
        assert r["calls"]["verifier"] == r["extra"]["unchecked_tokens"] + r["extra"]["runs_flagged"]
    math_recs = [r for r in spr if r["category"] == "math_reasoning"]
    assert math_recs and all(r["quality"]["reference_metric"] == "exact_match" for r in math_recs)
    rows = {row["method"]: row for row in summary}
    assert rows["sprinter"]["q_token_agreement"] is not None and rows["ar"].get("q_token_agreement") is None


def test_top2_margin_and_divergence_on_the_tiny_pair(tiny_pair):
    """The margin is the target's top-1 minus top-2 logit after prompt + common prefix, as a step-by-step
    decode with a KV cache sees it (to the kernels' ~1e-4); nothing is counted; the first difference and the
    dtype's ε are recorded."""
    from transformers import DynamicCache

    prompt, prefix = [5, 6, 7, 8], [9, 10, 11]
    cache = DynamicCache()
    with torch.inference_mode():
        logits = lm_forward(tiny_pair.target.module, torch.tensor([prompt]), cache).logits[0, -1]
        for tok in prefix:
            logits = lm_forward(tiny_pair.target.module, torch.tensor([[tok]]), cache).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    tiny_pair.reset_counts()
    margin = quality.top2_margin(tiny_pair, prompt + prefix)
    assert margin == pytest.approx(float(top[0] - top[1]), abs=1e-3) and margin >= 0
    assert tiny_pair.target.calls == 0

    base = {"prompt_ids": prompt, "output_ids": prefix + [12, 13]}
    rec = {"prompt_ids": prompt, "output_ids": prefix + [14, 13]}
    div = quality.divergence(tiny_pair, rec, base)
    assert div == {"position": 3, "margin": pytest.approx(margin), "tie": margin < 1e-3, "eps": 1e-3}
    assert quality.divergence(tiny_pair, base, dict(base)) is None
    assert tiny_pair.target.calls == 0


def test_tie_eps_and_first_difference():
    from core import metrics

    assert metrics.tie_eps(torch.float32) == 1e-3 and metrics.tie_eps(torch.bfloat16) == 0.25
    assert metrics.tie_eps("float16") == 0.25 and metrics.tie_eps(torch.float64) == 1e-3
    assert metrics.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_difference([1, 2], [1, 2, 3]) == 2  # a prefix: they part where the shorter ends
