"""The shared verifier: greedy prefix matching, and the rejection sampler preserving the target distribution."""

import math

import pytest
import torch

from decoding.sampling import Sampling, probs_from_logits
from decoding.verify import verify_chain


# Release-independent (no transformers model is loaded or called here): CI's oldest-transformers leg skips it.
pytestmark = pytest.mark.newest_only


def test_greedy_accepts_longest_matching_prefix():
    logits = torch.full((4, 6), -10.0)
    for row, tok in enumerate([2, 3, 5, 1]):
        logits[row, tok] = 10.0
    assert verify_chain(torch.tensor([2, 3, 0]), None, logits, Sampling()) == (2, 5)
    assert verify_chain(torch.tensor([2, 3, 5]), None, logits, Sampling()) == (3, 1)  # bonus token
    assert verify_chain(torch.tensor([4, 3, 5]), None, logits, Sampling()) == (0, 2)
    assert verify_chain(torch.tensor([], dtype=torch.long), None, logits[:1], Sampling()) == (0, 2)


def _output_histogram(p_logits, q, sampling, n, seed):
    """Distribution of the first committed token when drafts come from q and the target scores p."""
    gen = torch.Generator().manual_seed(seed)
    vocab = q.shape[-1]
    counts = torch.zeros(vocab)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    for x in drafts:
        tokens = x.view(1)
        n_acc, nxt = verify_chain(tokens, q.view(1, -1), p_logits, sampling, gen)
        counts[int(tokens[0]) if n_acc == 1 else nxt] += 1
    return counts


def _chi2_pvalue(counts, probs):
    from scipy.stats import chisquare

    expected = probs * counts.sum()
    keep = expected > 0
    if counts[~keep].sum() > 0:  # a token the target gives zero probability was emitted: certainly wrong
        return 0.0
    return chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_rejection_sampling_preserves_target_distribution(temperature, top_p):
    torch.manual_seed(0)
    vocab = 6
    sampling = Sampling(temperature, top_p)
    p_logits = torch.randn(2, vocab) * 1.5  # row 0 scores the draft token, row 1 is the bonus position
    q = probs_from_logits(torch.randn(vocab) * 1.5, sampling)
    p = probs_from_logits(p_logits[0], sampling)
    counts = _output_histogram(p_logits, q, sampling, n=20000, seed=1)
    assert _chi2_pvalue(counts, p) > 1e-3
    # The test has power: the draft's own distribution (what "accept everything" would emit) is rejected.
    assert _chi2_pvalue(torch.multinomial(q, 20000, replacement=True).bincount(minlength=vocab).float(), p) < 1e-6


def test_draft_with_partial_support_is_still_exact():
    """A reduced drafting vocabulary gives q(x) = 0 for most tokens; the output must still be p."""
    vocab = 8
    sampling = Sampling(1.0, 1.0)
    p_logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3))
    q = torch.zeros(vocab)
    q[:3] = torch.tensor([0.5, 0.3, 0.2])
    counts = _output_histogram(p_logits, q, sampling, n=20000, seed=2)
    assert _chi2_pvalue(counts, probs_from_logits(p_logits[0], sampling)) > 1e-3


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probs_from_logits(logits, Sampling(1.0, 0.8))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    assert math.isclose(float(probs_from_logits(logits, Sampling(1.0, 1.0)).sum()), 1.0, rel_tol=1e-6)
