"""The one verification routine every lossless method uses: greedy match, or lossless rejection sampling.

Rejection sampling follows Leviathan et al. (2023), "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1 / Chen et al. (2023): the output is distributed exactly as the target's.
"""

from __future__ import annotations

import torch

from decoding.sampling import Sampling, probs_from_logits, sample


def verify_chain(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Decide how many drafted tokens the target keeps, and the token that follows them.

    Args:
        draft_tokens: ``LongTensor`` of shape ``(k,)``, the proposed continuation.
        draft_probs: ``FloatTensor`` of shape ``(k, vocab)``, the distribution each token was drawn from
            (already tempered / top-p filtered); ignored when greedy. A deterministic drafter (n-gram
            lookup) passes one-hot rows.
        target_logits: ``FloatTensor`` of shape ``(k + 1, vocab)``; row i scores position i, row k is the
            bonus position after the whole draft.
    Returns:
        ``(n_accepted, next_token)``: the first ``n_accepted`` drafted tokens stand, then ``next_token``
        (the target's correction on a rejection, or its bonus token when all ``k`` are accepted).
    """
    k = draft_tokens.shape[0]
    if sampling.greedy:
        target_choice = target_logits.argmax(-1)  # (k + 1,)
        # Accept the longest prefix on which the draft equals the target's own greedy choice.
        mismatch = (draft_tokens != target_choice[:k]).nonzero()
        n = int(mismatch[0]) if mismatch.numel() else k
        return n, int(target_choice[n])

    p = probs_from_logits(target_logits, sampling)  # (k + 1, vocab)
    if k == 0:  # nothing drafted (e.g. the last token of the budget): a plain sample from the target
        return 0, int(sample(p[0], generator))
    idx = torch.arange(k)
    p_tok = p[idx, draft_tokens]
    q_tok = draft_probs[idx, draft_tokens]
    u = torch.rand(k, generator=generator, device=p.device)
    # Accept token i with probability min(1, p(x)/q(x)); u < p/q is the same test without dividing by 0.
    rejected = (u * q_tok >= p_tok).nonzero()
    if rejected.numel() == 0:
        return k, int(sample(p[k], generator))  # every draft kept: a free bonus token from the target
    n = int(rejected[0])
    # On rejection resample from norm(max(0, p - q)): this residual makes the output exactly p.
    residual = (p[n] - draft_probs[n]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else p[n]  # p == q up to rounding: any draw from p is exact
    return n, int(sample(residual, generator))
