"""Every metric the harness reports, each defined once, here (the README's metric table says the same).

Where a denominator is zero the metric is NaN, never an exception.
"""

from __future__ import annotations

import math
import statistics

# Near-tie threshold ε on the target's top-1 minus top-2 logit, by the pair's dtype. On CPU, forwards of 4 or
# more rows (verification) take the packed kernels and ar's 1-row forwards F.linear; the two sum in different
# orders, so fp32 logits of the same position differ by ~1e-4 here, and a margin below 1e-3 can flip the greedy
# argmax between ar and a lossless method without any bug. bf16 keeps 8 significant bits: at logits of magnitude
# ~20 one rounding step is ~0.08, and both logits round, so 0.25; fp16 (3 bits finer) takes the same bound
# untuned rather than a guess.
TIE_EPS = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.25}


def tie_eps(dtype) -> float:
    """ε of :data:`TIE_EPS` for a torch dtype (or its name, e.g. ``"bfloat16"``); float32's for any other."""
    return TIE_EPS.get(str(dtype).removeprefix("torch."), TIE_EPS["float32"])


def ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter's length when it is a prefix of the other),
    None when they are equal: where a greedy output leaves the baseline's."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def record_metrics(new_tokens: int, wall_s: float, ttft_s: float, accept_lengths: list[int], counts: dict) -> dict:
    """Per-prompt metrics from what the harness measured and the counting wrappers saw."""
    target_calls = counts.get("target", {}).get("calls", 0)
    draft_calls = sum(c["calls"] for role, c in counts.items() if role.startswith("draft"))
    flops = {role: c["flops"] for role, c in counts.items()}
    flops["total"] = sum(flops.values())
    return {
        "wall_s": wall_s,  # seconds from the start of the prefill to the last token, device synchronised
        "ttft_s": ttft_s,  # time to first token: prefill + first token
        "tokens_per_s": ratio(new_tokens, wall_s),  # new tokens / wall time
        "decode_tokens_per_s": ratio(new_tokens - 1, wall_s - ttft_s),  # tokens after the first / time after it
        "mean_accepted": ratio(sum(accept_lengths), len(accept_lengths)),  # tokens per target call after prefill (AR = 1)
        "target_calls": target_calls,  # target forward passes, prefill included
        "draft_calls": draft_calls,  # forward passes of every draft model, prefills included
        "target_calls_per_token": ratio(target_calls, new_tokens),
        "calls": {role: c["calls"] for role, c in counts.items()},  # forward passes per role
        "scored_tokens": {role: c["tokens"] for role, c in counts.items()},  # positions scored per role
        "flops": flops,  # analytic forward FLOPs per role and in total (core/flops.py)
        "flops_per_token": ratio(flops["total"], new_tokens),
        # compile=true (core/compiled.py): rows run only to fill a bucket, the FLOPs they and the static cache's masked
        # columns cost beyond the real rows' (not in ``flops``), and forwards larger than every bucket, run uncompiled.
        "padded_tokens": {role: c.get("padded_tokens", 0) for role, c in counts.items()},
        "padded_flops": {role: c.get("padded_flops", 0.0) for role, c in counts.items()},
        "uncompiled_calls": {role: c.get("uncompiled_calls", 0) for role, c in counts.items()},
    }


def acceptance_by_position(accept_lengths: list[int], drafted: list[int]) -> list[float]:
    """P(draft token i is accepted | tokens 0..i-1 were accepted and i was proposed), for i = 0, 1, ...

    A step that drafted ``k`` tokens and committed ``a`` (= accepted + 1) reached positions
    ``0..min(a-1, k-1)``; positions below ``a - 1`` were accepted.
    """
    width = max(drafted, default=0)
    reached, kept = [0] * width, [0] * width
    for a, k in zip(accept_lengths, drafted, strict=True):
        accepted = a - 1
        for i in range(min(accepted + 1, k)):
            reached[i] += 1
            kept[i] += i < accepted
    return [ratio(kept[i], reached[i]) for i in range(width)]


def alpha_estimate(accept_lengths: list[int], drafted: list[int]) -> float:
    """Per-token acceptance rate α (Leviathan et al. 2023, Sec. 3.1) as the maximum-likelihood estimate
    under their i.i.d. assumption: accepted tokens / (accepted tokens + steps that ended in a rejection)."""
    accepted = sum(a - 1 for a in accept_lengths)
    rejections = sum(1 for a, k in zip(accept_lengths, drafted, strict=True) if k > 0 and a - 1 < k)
    return ratio(accepted, accepted + rejections)


def analytic_speedup(alpha: float, gamma: float, c: float) -> float:
    """Expected walltime improvement of speculative decoding, Leviathan et al. (2023), Theorem 3.8:
    (1 - α^(γ+1)) / ((1 - α)(γc + 1)), with c the cost of a draft forward relative to a target forward."""
    if any(math.isnan(x) for x in (alpha, gamma, c)):
        return math.nan
    expected_tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return expected_tokens / (gamma * c + 1)


def present(values) -> list[float]:
    """The values that are there: None and NaN (undefined metrics) left out."""
    return [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def median(values) -> float:
    vals = present(values)
    return statistics.median(vals) if vals else math.nan


def quantile(values, q: float) -> float:
    """The q-quantile of the values present, interpolating linearly between order statistics (numpy's
    default, so ``quantile(v, 0.5) == median(v)``); NaN when none is."""
    import numpy as np

    vals = present(values)
    return float(np.quantile(vals, q)) if vals else math.nan
