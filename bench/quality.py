"""Output quality of lossy methods (``lossless = False``), shared by all of them.

A lossless method's greedy output equals the baseline's by construction (``matches_baseline`` checks it);
a lossy one trades quality for speed, so each of its records carries ``quality``: agreement with the
plain autoregressive output of the same prompt in the same run, a score against the dataset's reference
where there is one, and the perplexity of its output under the target. Every figure is defined here,
once; the README's metric table says the same.

Any greedy record (lossless or not) whose tokens differ from the baseline's carries ``divergence``: where
they part and how near a tie the target's own choice was there, so a kernel rounding flip is told from a
real mismatch.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

import torch

from core import metrics


def token_agreement(output: list[int], baseline: list[int]) -> float:
    """Positions i < min(len) where ``output[i] == baseline[i]``, over ``max(len(output), len(baseline))``:
    the positions past the end of the shorter output count as disagreements (a length mismatch is never
    ignored); two empty outputs agree fully (1.0)."""
    longest = max(len(output), len(baseline))
    if longest == 0:
        return 1.0
    same = sum(1 for i in range(min(len(output), len(baseline))) if output[i] == baseline[i])
    return same / longest


def prefix_agreement(output: list[int], baseline: list[int]) -> float:
    """Length of the common prefix over ``max(len(output), len(baseline))``: how much of the text is
    identical up to the first divergence (after it positions no longer line up); two empty outputs: 1.0."""
    longest = max(len(output), len(baseline))
    if longest == 0:
        return 1.0
    n = 0
    while n < min(len(output), len(baseline)) and output[n] == baseline[n]:
        n += 1
    return n / longest


@lru_cache(maxsize=1)
def _rouge():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (longest common subsequence of words; Lin, 2004) from the ``rouge_score`` package,
    with its Porter stemmer, offline. Identical texts score 1.0 even when they hold no word it keeps
    (its tokenizer keeps only [a-z0-9] runs, so non-Latin text has no words)."""
    if candidate == reference:
        return 1.0
    return float(_rouge().score(reference, candidate)["rougeL"].fmeasure)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The last number written in ``text`` (thousands separators dropped), or None when there is none."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def reference_score(category: str, text: str, reference: str) -> tuple[str, float]:
    """``(metric, score)`` of an output against the dataset's reference answer.

    Math (category containing "math"): ``exact_match`` = 1.0 when the last number of the output equals
    the last number of the reference (GSM8K-style final answers), else 0.0. Otherwise ``rougeL`` F1.
    """
    if "math" in (category or ""):
        want, got = final_number(reference), final_number(text)
        return "exact_match", float(want is not None and got is not None and math.isclose(want, got))
    return "rougeL", rouge_l(text, reference)


def perplexity(pair, prompt_ids: list[int], output_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ``output_ids`` under the target (temperature 1), given the
    prompt; NaN for an empty output. One forward of the bare module: no counting wrapper, no clock."""
    if not output_ids:
        return math.nan
    x = torch.tensor([list(prompt_ids) + list(output_ids)], device=pair.device)
    with torch.inference_mode():
        # Row j of the kept logits predicts output token j: the positions from the prompt's last one on.
        logits = pair.target.module(input_ids=x, logits_to_keep=len(output_ids) + 1).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(output_ids, device=pair.device))
    return float(torch.exp(nll))


def top2_margin(pair, ids: list[int]) -> float:
    """The target's top-1 minus top-2 logit for the token after ``ids`` (prompt + output so far): how near a
    tie its greedy choice there is. One forward of the bare module: no counting wrapper, no clock."""
    x = torch.tensor([list(ids)], device=pair.device)
    with torch.inference_mode():
        top = torch.topk(pair.target.module(input_ids=x, logits_to_keep=1).logits[0, -1].float(), 2).values
    return float(top[0] - top[1])


def divergence(pair, rec: dict, base: dict) -> dict | None:
    """Where a greedy ``rec`` first leaves the baseline's tokens (None when it does not): ``position`` (index
    into ``output_ids``), ``margin`` (the target's top-1 minus top-2 logit there, given the prompt and the
    common prefix), ``tie`` (margin < ``eps``: the two kernels' rounding alone can flip that argmax) and ``eps``
    (:func:`core.metrics.tie_eps` of the pair's dtype). Untimed; the role counters are reset afterwards."""
    i = metrics.first_difference(rec["output_ids"], base["output_ids"])
    if i is None:
        return None
    margin = top2_margin(pair, list(rec["prompt_ids"]) + list(rec["output_ids"][:i]))
    pair.reset_counts()
    eps = metrics.tie_eps(pair.dtype)
    return {"position": i, "margin": margin, "tie": margin < eps, "eps": eps}


def record_quality(pair, rec: dict, base: dict | None) -> dict:
    """The ``quality`` of one lossy record, against the baseline record of the same prompt (when the run
    has one) and the dataset's reference (when the prompt has one). Runs outside the timed region; the
    role counters are reset afterwards so nothing here is ever counted."""
    q: dict = {}
    if base is not None:
        q["token_agreement"] = token_agreement(rec["output_ids"], base["output_ids"])
        q["prefix_agreement"] = prefix_agreement(rec["output_ids"], base["output_ids"])
        q["rougeL_vs_baseline"] = rouge_l(rec["output_text"], base["output_text"])
    if rec.get("reference") is not None:
        q["reference_metric"], q["reference_score"] = reference_score(rec["category"], rec["output_text"], rec["reference"])
        if base is not None:
            q["reference_score_baseline"] = reference_score(base["category"], base["output_text"], base["reference"])[1]
    q["perplexity"] = perplexity(pair, rec["prompt_ids"], rec["output_ids"])
    attribution = (rec.get("extra") or {}).get("attribution_rate")
    if attribution is not None:  # a retrieval method's own count: output tokens copied from a cited source
        q["attribution"] = attribution
    if base is not None:
        q["perplexity_baseline"] = perplexity(pair, base["prompt_ids"], base["output_ids"])
    pair.reset_counts()
    return q


def summarize_quality(records: list[dict]) -> dict:
    """Summary columns for one method's records: means of the agreement and reference scores, medians of
    the perplexities, each over the records that have it (NaN when none); empty without ``quality``."""
    qs = [r["quality"] for r in records if r.get("quality")]
    if not qs:
        return {}

    def mean(key, metric=None):
        vals = [q[key] for q in qs if q.get(key) is not None and not math.isnan(q[key])
                and (metric is None or q.get("reference_metric") == metric)]
        return sum(vals) / len(vals) if vals else math.nan

    return {
        "token_agreement": mean("token_agreement"),
        "prefix_agreement": mean("prefix_agreement"),
        "rougeL_vs_baseline": mean("rougeL_vs_baseline"),
        # Reference scores are averaged per metric, never across metrics.
        "exact_match": mean("reference_score", "exact_match"),
        "exact_match_baseline": mean("reference_score_baseline", "exact_match"),
        "rougeL_vs_reference": mean("reference_score", "rougeL"),
        "rougeL_vs_reference_baseline": mean("reference_score_baseline", "rougeL"),
        "perplexity": metrics.median(q.get("perplexity") for q in qs),
        "perplexity_baseline": metrics.median(q.get("perplexity_baseline") for q in qs),
        "attribution": mean("attribution"),
    }
