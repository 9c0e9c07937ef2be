"""Greedy equality: every lossless method reproduces `ar` token for token (tiny pairs here; the real
default pair in test_real_model.py)."""

import copy

import pytest

from core.counting import CountedLM
from tests.helpers import decode, prompts_for


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_sd_equals_ar_greedy_tiny(tiny_pair, gamma):
    for ids in prompts_for(tiny_pair, 3):
        ar = decode(tiny_pair, "ar", ids, max_new=40)
        sd = decode(tiny_pair, "sd", ids, max_new=40, gamma=gamma)
        assert sd.output_ids == ar.output_ids
        assert len(sd.output_ids) == 40
        assert sum(sd.accept_lengths) + 1 == len(sd.output_ids)  # prefill gives the first token


def test_sd_equals_ar_with_adaptive_gamma(tiny_pair):
    ids = prompts_for(tiny_pair, 1)[0]
    ar = decode(tiny_pair, "ar", ids, max_new=33)
    sd = decode(tiny_pair, "sd", ids, max_new=33, gamma=2, adaptive=True, gamma_min=1, gamma_max=8)
    assert sd.output_ids == ar.output_ids


@pytest.mark.parametrize("confidence", [0.3, 1.0])
def test_sd_with_a_confidence_stop_equals_ar_greedy(tiny_pair, confidence):
    for ids in prompts_for(tiny_pair, 2):
        ar = decode(tiny_pair, "ar", ids, max_new=40)
        sd = decode(tiny_pair, "sd", ids, max_new=40, gamma=4, confidence=confidence)
        assert sd.output_ids == ar.output_ids
        assert all(1 <= k <= 4 for k in sd.drafted[:-1]) and len(sd.drafted) == len(sd.accept_lengths)
        if confidence == 1.0:  # no draft token reaches probability 1: every draft stops after one token
            assert set(sd.drafted) <= {0, 1}


def test_sd_sampling_with_a_confidence_stop(tiny_pair):
    ids = prompts_for(tiny_pair, 1)[0]
    a = decode(tiny_pair, "sd", ids, max_new=20, temperature=0.8, seed=3, gamma=4, confidence=0.05)
    b = decode(tiny_pair, "sd", ids, max_new=20, temperature=0.8, seed=3, gamma=4, confidence=0.05)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 20
    assert all(k <= 4 for k in a.drafted)


def test_sd_with_perfect_draft_takes_every_token(tiny_pair):
    """A draft identical to the target is always accepted: gamma + 1 tokens per target call."""
    pair = copy.copy(tiny_pair)
    pair.drafts = [CountedLM(tiny_pair.target.module, "draft")]
    ids = prompts_for(tiny_pair, 1)[0]
    ar = decode(pair, "ar", ids, max_new=31)
    sd = decode(pair, "sd", ids, max_new=31, gamma=4)
    assert sd.output_ids == ar.output_ids
    assert sd.accept_lengths == [5] * 6  # 1 (prefill) + 6 * 5 = 31


def test_sd_sampling_runs_and_is_reproducible(tiny_pair):
    ids = prompts_for(tiny_pair, 1)[0]
    a = decode(tiny_pair, "sd", ids, max_new=20, temperature=0.8, top_p=0.9, seed=7, gamma=3)
    b = decode(tiny_pair, "sd", ids, max_new=20, temperature=0.8, top_p=0.9, seed=7, gamma=3)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 20


def test_caches_are_rolled_back_not_recomputed(tiny_pair):
    """The target scores each position about once: prompt + new tokens + the rejected drafts, never more."""
    ids = prompts_for(tiny_pair, 1)[0]
    tiny_pair.reset_counts()
    out = decode(tiny_pair, "sd", ids, max_new=40, gamma=3)
    scored = tiny_pair.target.tokens
    rejected = sum(k - (a - 1) for a, k in zip(out.accept_lengths, out.drafted))
    assert scored == len(ids) + len(out.output_ids) - 1 + rejected


def test_sd_sampling_with_one_token_of_budget_left(tiny_pair):
    """When only the target's own token fits in the budget, SD drafts nothing and samples from the target."""
    ids = prompts_for(tiny_pair, 1)[0]
    for seed in (1, 5):
        out = decode(tiny_pair, "sd", ids, max_new=12, temperature=1.0, seed=seed, gamma=3)
        assert len(out.output_ids) == 12


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_matches_baseline_is_recorded_for_greedy_runs_only(compose_cfg, tmp_path, temperature):
    import json

    from bench.runner import run

    cfg = compose_cfg("pair=tiny", "method=sd", "max_new_tokens=10", "dataset.n_prompts=2", "warmup=0",
                      f"temperature={temperature}")
    run(cfg, tmp_path)
    sd = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    sd = [r for r in sd if r["method"] == "sd"]
    assert len(sd) == 2
    assert all(r["matches_baseline"] is (True if temperature == 0 else None) for r in sd)
