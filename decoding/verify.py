"""The lossless verifiers every lossless method uses: greedy match, or rejection sampling.

- :func:`verify_chain`: one drafted path. Rejection sampling follows Leviathan et al. (2023), "Fast Inference
  from Transformers via Speculative Decoding", Algorithm 1 / Chen et al. (2023).
- :func:`verify_tree`: a token tree (:class:`decoding.tree.Tree`). Sampling walks it with recursive rejection
  sampling over each node's children (SpecInfer's multi-step speculative sampling, Miao et al. 2024, Alg. 2;
  for deterministic candidates, Jeon et al. 2024's recursive speculative decoding without replacement).

Either way the output is distributed exactly as the target's, and greedy output is the target's argmax.
"""

from __future__ import annotations

import torch

from decoding.sampling import Sampling, probs_from_logits, sample
from decoding.tree import Tree


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
            (already tempered / top-p filtered); ignored when greedy. ``None`` for a deterministic drafter
            (n-gram lookup, top-1 of a head): its q is one-hot, q(x) = 1 for the proposed token.
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
    q_tok = draft_probs[idx, draft_tokens] if draft_probs is not None else torch.ones_like(p_tok)
    u = torch.rand(k, generator=generator, device=p.device)
    # Accept token i with probability min(1, p(x)/q(x)); u < p/q is the same test without dividing by 0.
    rejected = (u * q_tok >= p_tok).nonzero()
    if rejected.numel() == 0:
        return k, int(sample(p[k], generator))  # every draft kept: a free bonus token from the target
    n = int(rejected[0])
    # On rejection resample from norm(max(0, p - q)): this residual makes the output exactly p.
    return n, int(sample(residual(p[n], draft_probs[n] if draft_probs is not None else None, draft_tokens[n]), generator))


def residual(p: torch.Tensor, q: torch.Tensor | None, token) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after rejecting ``token`` drawn from ``q`` (``None``: one-hot
    at ``token``, so the residual is p without that token). Rejecting from this makes the output exactly p."""
    if q is None:
        out = p.clone()
        out[token] = 0
    else:
        out = (p - q).clamp_min(0)
    total = out.sum()
    return out / total if total > 0 else p  # p == q up to rounding: any draw from p is exact


def verify_tree(tree: Tree, target_logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None,
                draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Walk ``tree`` from the root, keeping nodes the target accepts; returns ``(path, next_token)``.

    Args:
        target_logits: ``FloatTensor (len(tree), vocab)``: row v scores the token after node v.
        draft_probs: ``FloatTensor (len(tree), vocab)`` or ``None``. Row v is the distribution node v's token
            was drawn from, where siblings are independent draws from the same distribution (SpecInfer's
            setting). ``None``: deterministic candidates (n-gram matches, a head's top-k), one-hot rows.
    Returns:
        ``path``: node indices from the root (0) along the accepted nodes; ``next_token``: the target's token
        after the path's last node (its correction, or a bonus token at a leaf).
    """
    if sampling.greedy:
        # Follow the target's own argmax while it was drafted.
        choice = target_logits.argmax(-1).tolist()
        path = [0]
        while (child := tree.child_with(path[-1], choice[path[-1]])) is not None:
            path.append(child)
        return path, choice[path[-1]]
    probs = probs_from_logits(target_logits, sampling)  # (n, vocab)
    path = [0]
    while True:
        p, accepted = probs[path[-1]], None
        for child in tree.children[path[-1]]:
            x = tree.tokens[child]
            q = draft_probs[child] if draft_probs is not None else None
            q_x = float(q[x]) if q is not None else 1.0
            # Accept x with probability min(1, p(x) / q(x)); else go on with the residual, which the next
            # sibling (and, when all are rejected, the final draw) is tested against.
            if float(torch.rand((), generator=generator, device=p.device)) * q_x < float(p[x]):
                accepted = child
                break
            p = residual(p, q, x)
        if accepted is None:
            return path, int(sample(p, generator))
        path.append(accepted)
