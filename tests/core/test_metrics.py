"""core/metrics.py, function by function, against values worked out by hand (or by numpy / statistics)."""

import math
import statistics

import numpy as np
import pytest
import torch

from core import metrics


# Release-independent (no transformers model is loaded or called here): CI's oldest-transformers leg skips it.
pytestmark = pytest.mark.newest_only


@pytest.mark.parametrize("dtype, eps", [
    (torch.float32, 1e-3), (torch.bfloat16, 0.25), (torch.float16, 0.25),
    ("float32", 1e-3), ("bfloat16", 0.25), ("float16", 0.25),
    (torch.float64, 1e-3), ("int8", 1e-3),  # any other dtype: float32's
])
def test_tie_eps_by_dtype_or_its_name(dtype, eps):
    assert metrics.tie_eps(dtype) == eps


@pytest.mark.parametrize("num, den, want", [(3, 4, 0.75), (0, 5, 0.0), (-1, 2, -0.5), (1.5, 0.5, 3.0)])
def test_ratio(num, den, want):
    assert metrics.ratio(num, den) == want


@pytest.mark.parametrize("num, den", [(1, 0), (0, 0), (2.5, 0.0), (-1, -0.0)])
def test_ratio_is_nan_on_a_zero_denominator(num, den):
    assert math.isnan(metrics.ratio(num, den))


@pytest.mark.parametrize("a, b, want", [
    ([1, 2, 3], [1, 2, 3], None),
    ([], [], None),
    ([1, 2, 3], [1, 5, 3], 1),
    ([7], [8], 0),
    ([1, 2], [1, 2, 3], 2),  # a prefix: the shorter's length
    ([1, 2, 3], [1, 2], 2),
    ([], [4], 0),
    ([1, 2, 3], [1, 9, 4], 1),  # the first difference, not a later one
])
def test_first_difference(a, b, want):
    assert metrics.first_difference(a, b) == want


def _counts():
    return {
        "target": {"calls": 4, "tokens": 20, "flops": 100.0, "padded_tokens": 3, "padded_flops": 7.5, "uncompiled_calls": 1},
        "draft": {"calls": 6, "tokens": 6, "flops": 10.0},
        "draft_small": {"calls": 2, "tokens": 2, "flops": 5.0},  # every role named draft* counts as a draft
        "head": {"calls": 3, "tokens": 9, "flops": 5.0},
    }


def test_record_metrics_by_hand():
    """10 tokens in 2 s with the first at 0.5 s; three steps committing 3, 2 and 4 tokens."""
    m = metrics.record_metrics(10, 2.0, 0.5, [3, 2, 4], _counts())
    assert m == {
        "wall_s": 2.0,
        "ttft_s": 0.5,
        "tokens_per_s": 5.0,
        "decode_tokens_per_s": pytest.approx(9 / 1.5),
        "mean_accepted": 3.0,
        "target_calls": 4,
        "draft_calls": 8,
        "target_calls_per_token": 0.4,
        "calls": {"target": 4, "draft": 6, "draft_small": 2, "head": 3},
        "scored_tokens": {"target": 20, "draft": 6, "draft_small": 2, "head": 9},
        "flops": {"target": 100.0, "draft": 10.0, "draft_small": 5.0, "head": 5.0, "total": 120.0},
        "flops_per_token": 12.0,
        # compile=true's padding, beside the real rows' figures (a role that reports none: 0)
        "padded_tokens": {"target": 3, "draft": 0, "draft_small": 0, "head": 0},
        "padded_flops": {"target": 7.5, "draft": 0.0, "draft_small": 0.0, "head": 0.0},
        "uncompiled_calls": {"target": 1, "draft": 0, "draft_small": 0, "head": 0},
    }


def test_record_metrics_zero_denominators_are_nan():
    """No tokens, no time, no steps, no roles: every ratio is NaN and nothing raises."""
    m = metrics.record_metrics(0, 0.0, 0.0, [], {})
    for key in ("tokens_per_s", "decode_tokens_per_s", "mean_accepted", "target_calls_per_token", "flops_per_token"):
        assert math.isnan(m[key]), key
    assert (m["target_calls"], m["draft_calls"], m["calls"], m["flops"]) == (0, 0, {}, {"total": 0})


def test_record_metrics_without_a_draft():
    m = metrics.record_metrics(5, 1.0, 0.2, [1] * 4, {"target": {"calls": 5, "tokens": 12, "flops": 50.0}})
    assert (m["draft_calls"], m["mean_accepted"], m["target_calls_per_token"]) == (0, 1.0, 1.0)
    assert m["flops"] == {"target": 50.0, "total": 50.0}


def test_acceptance_by_position_by_hand():
    """Steps (committed, drafted): (3, 4) reaches positions 0-2 and keeps 0-1; (1, 2) reaches 0 and keeps none;
    (5, 4) reaches and keeps 0-3. Reached 3, 2, 2, 1; kept 2, 2, 1, 1."""
    got = metrics.acceptance_by_position([3, 1, 5], [4, 2, 4])
    assert got == pytest.approx([2 / 3, 1.0, 0.5, 1.0])


def test_acceptance_by_position_unreached_positions_are_nan():
    got = metrics.acceptance_by_position([1], [3])
    assert got[0] == 0.0 and len(got) == 3 and all(math.isnan(x) for x in got[1:])


@pytest.mark.parametrize("accepted, drafted", [([], []), ([1, 1], [0, 0])])
def test_acceptance_by_position_nothing_drafted_is_empty(accepted, drafted):
    assert metrics.acceptance_by_position(accepted, drafted) == []


@pytest.mark.parametrize("fn", [metrics.acceptance_by_position, metrics.alpha_estimate])
def test_per_step_lists_of_different_lengths_are_refused(fn):
    with pytest.raises(ValueError):
        fn([2, 3], [4])


def test_alpha_estimate_by_hand():
    """Accepted 2 + 0 + 4 = 6; the first two steps ended in a rejection, the third accepted all 4 it drafted."""
    assert metrics.alpha_estimate([3, 1, 5], [4, 2, 4]) == 6 / 8


def test_alpha_estimate_all_accepted_is_one_and_none_accepted_is_zero():
    assert metrics.alpha_estimate([5, 5], [4, 4]) == 1.0
    assert metrics.alpha_estimate([1, 1, 1], [4, 2, 1]) == 0.0


def test_alpha_estimate_matches_a_geometric_sample():
    """Under Leviathan et al.'s i.i.d. model the estimate recovers α from many steps."""
    rng = np.random.default_rng(0)
    alpha, gamma = 0.7, 5
    accepted = [int(min(rng.geometric(1 - alpha) - 1, gamma)) for _ in range(20000)]
    assert metrics.alpha_estimate([a + 1 for a in accepted], [gamma] * len(accepted)) == pytest.approx(alpha, abs=0.01)


@pytest.mark.parametrize("accepted, drafted", [([], []), ([1, 1], [0, 0])])
def test_alpha_estimate_nothing_drafted_is_nan(accepted, drafted):
    assert math.isnan(metrics.alpha_estimate(accepted, drafted))


def _theorem_3_8(alpha, gamma, c):
    """Leviathan et al. (2023), Theorem 3.8, as printed: (1 - α^(γ+1)) / ((1 - α)(γc + 1))."""
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


@pytest.mark.parametrize("alpha, gamma, c, by_hand", [
    (0.8, 4, 0.1, (1 - 0.32768) / 0.2 / 1.4),  # 0.67232 / 0.2 = 3.3616; / 1.4 = 2.4011...
    (0.5, 2, 0.0, 1.75),  # (1 - 1/8) / (1/2), free draft
    (0.0, 3, 0.5, 0.4),  # nothing accepted: one token per (3 * 0.5 + 1) target-equivalents
    (0.6, 1, 0.05, 1.6 / 1.05),
])
def test_analytic_speedup_is_theorem_3_8(alpha, gamma, c, by_hand):
    assert metrics.analytic_speedup(alpha, gamma, c) == pytest.approx(by_hand)
    assert metrics.analytic_speedup(alpha, gamma, c) == pytest.approx(_theorem_3_8(alpha, gamma, c))


def test_analytic_speedup_limits():
    # α → 1: every drafted token accepted, γ + 1 tokens per step (the formula's 0/0 taken as its limit).
    assert metrics.analytic_speedup(1.0, 4, 0.1) == pytest.approx(5 / 1.4)
    assert metrics.analytic_speedup(1 - 1e-9, 4, 0.1) == pytest.approx(5 / 1.4, rel=1e-6)
    # γ = 0: plain decoding, whatever α and c.
    for alpha, c in [(0.3, 0.2), (0.9, 1.0), (1.0, 0.5)]:
        assert metrics.analytic_speedup(alpha, 0, c) == pytest.approx(1.0)
    # c → 0 with α → 1: the upper bound γ + 1.
    assert metrics.analytic_speedup(1.0, 7, 0.0) == 8.0
    # A draft as costly as the target never pays: below 1 for every α < 1.
    assert all(metrics.analytic_speedup(a, 3, 1.0) < 1 for a in (0.0, 0.5, 0.99))


@pytest.mark.parametrize("args", [(math.nan, 4, 0.1), (0.8, math.nan, 0.1), (0.8, 4, math.nan)])
def test_analytic_speedup_of_nan_is_nan(args):
    assert math.isnan(metrics.analytic_speedup(*args))


def test_present_leaves_out_none_and_nan():
    assert metrics.present([1.0, None, math.nan, 2, 0.0, np.float64("nan"), -3.5]) == [1.0, 2, 0.0, -3.5]
    assert metrics.present(x for x in [None, 4]) == [4]
    assert metrics.present([]) == []


@pytest.mark.parametrize("values", [[3, 1, 2], [4, 1, 3, 2], [2.5], [1, 1, 9, 10, -2]])
def test_median_matches_statistics(values):
    assert metrics.median(values) == statistics.median(values)


def test_median_ignores_missing_values():
    assert metrics.median([3, None, 1, math.nan, 2]) == 2
    assert metrics.median([4, 1, math.nan, 3, 2]) == 2.5


@pytest.mark.parametrize("values", [[], [None], [math.nan, None]])
def test_median_and_quantile_of_nothing_are_nan(values):
    assert math.isnan(metrics.median(values))
    assert math.isnan(metrics.quantile(values, 0.5))


def test_quantile_by_hand():
    """Linear interpolation between order statistics: q = 0.25 of 1..4 sits at index 0.75, so 1.75."""
    v = [4, 2, 1, 3]
    assert metrics.quantile(v, 0.25) == 1.75
    assert metrics.quantile(v, 0.75) == 3.25
    assert (metrics.quantile(v, 0.0), metrics.quantile(v, 1.0)) == (1.0, 4.0)
    assert isinstance(metrics.quantile(v, 0.5), float)


@pytest.mark.parametrize("q", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_quantile_matches_numpy_and_median(q):
    v = [0.3, 5.0, 2.2, None, 9.1, math.nan, 4.4, 1.0]
    clean = [0.3, 5.0, 2.2, 9.1, 4.4, 1.0]
    assert metrics.quantile(v, q) == pytest.approx(float(np.quantile(clean, q)))
    assert metrics.quantile(v, 0.5) == metrics.median(v)
