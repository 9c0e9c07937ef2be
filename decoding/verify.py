"""The lossless verifiers every lossless method uses: greedy match, or rejection sampling.

- :func:`verify_chain`: one drafted path. Rejection sampling follows Leviathan et al. (2023), "Fast Inference
  from Transformers via Speculative Decoding", Algorithm 1 / Chen et al. (2023).
- :func:`verify_tree`: a token tree (:class:`decoding.tree.Tree`). Sampling walks it with recursive rejection
  sampling over each node's children (SpecInfer's multi-step speculative sampling, Miao et al. 2024, Alg. 2;
  for deterministic candidates, Jeon et al. 2024's recursive speculative decoding without replacement).
- :func:`verify_hub`: a token tree whose two-child nodes hold SpecHub's pair of drafts (Sun et al., EMNLP 2024),
  drawn by :func:`draw_hub_pair` from a sparse joint distribution around the draft's top token and verified
  by that distribution's transport plan (:func:`hub_plan`); other nodes as :func:`verify_tree`.

Either way the output is distributed exactly as the target's, and greedy output is the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        accepted, p = rrs_children(tree, path[-1], probs[path[-1]], draft_probs, generator)
        if accepted is None:
            return path, int(sample(p, generator))
        path.append(accepted)


def rrs_children(tree: Tree, node: int, p: torch.Tensor, draft_probs: torch.Tensor | None,
                 generator: torch.Generator | None) -> tuple[int | None, torch.Tensor]:
    """Recursive rejection sampling over ``node``'s children, in order, against the target's ``p (vocab,)``.

    Returns ``(child, p)``: the accepted child, or ``None`` and the residual the target's own token is then
    drawn from. ``draft_probs`` as in :func:`verify_tree`; a child's row may differ from its siblings' (drawn
    without replacement: the draft's q without the earlier siblings' tokens, renormalised) and the output is
    still exactly p, since each test only needs its own token's distribution given the earlier ones."""
    for child in tree.children[node]:
        x = tree.tokens[child]
        q = draft_probs[child] if draft_probs is not None else None
        q_x = float(q[x]) if q is not None else 1.0
        # Accept x with probability min(1, p(x) / q(x)); else go on with the residual, which the next
        # sibling (and, when all are rejected, the final draw) is tested against.
        if float(torch.rand((), generator=generator, device=p.device)) * q_x < float(p[x]):
            return child, p
        p = residual(p, q, x)
    return None, p


# ------------------------------------------------------------------------------------------- SpecHub
#
# Sun, Zhou, Chen, Sun, "SpecHub: Provable Acceleration to Multi-Draft Speculative Decoding", EMNLP 2024
# (arXiv 2411.05289). Verifying k drafts optimally is an optimal-transport LP over all k-tuples of tokens (OTM,
# quadratic in the vocabulary for k = 2). SpecHub makes the drafts' joint distribution sparse instead: every
# pair of drafts holds the hub, the draft's most likely token a, so the LP has O(vocab) variables and its optimum
# is found greedily in one pass.


def hub_token(q: torch.Tensor) -> int:
    """The hub: the draft's most likely token (the first one on a tie), which every SpecHub pair holds."""
    return int(q.argmax())


def draw_hub_pair(q: torch.Tensor, generator: torch.Generator | None = None) -> list[int]:
    """Two distinct drafts ``[x1, x2]`` from SpecHub's sparse joint distribution over ordered pairs, around the
    hub a = argmax ``q (vocab,)``:

        Q(i, a) = q(i),    Q(a, i) = q(a) q(i) / (1 - q(a))    for every i != a;    0 for every other pair.

    That is x1 ~ q (an ordinary draft), and x2 = a when x1 != a, else x2 ~ q without a, renormalised.
    ``[a]`` alone when q has no other token (there is no pair: one draft, verified as in plain SD)."""
    a = hub_token(q)
    rest = q.clone()
    rest[a] = 0
    x1 = int(sample(q, generator))
    if float(rest.sum()) <= 0:
        return [x1]
    return [x1, a] if x1 != a else [a, int(sample(rest, generator))]  # multinomial renormalises


@dataclass
class HubPlan:
    """SpecHub's transport plan at one node: how the pairs of :func:`draw_hub_pair` deliver the target's p.

    ``keep_lead (vocab,)``: P(output i | pair (i, a)); ``keep_behind (vocab,)``: P(output i | pair (a, i));
    ``hub_after_lead`` / ``hub_after_behind``: P(output a | such a pair whose i was refused); ``left (vocab,)``:
    p less what the pairs deliver (unnormalised; it sums to P(both refused)), what the target's token is then
    drawn from."""

    hub: int
    keep_lead: torch.Tensor
    keep_behind: torch.Tensor
    hub_after_lead: float
    hub_after_behind: float
    left: torch.Tensor


def hub_plan(p: torch.Tensor, q: torch.Tensor) -> HubPlan:
    """The plan maximising P(one draft is the output) over transports from Q (:func:`draw_hub_pair`) to ``p``.

    A non-hub token i is only in the pairs (i, a) and (a, i); the hub is in every pair. So each i first takes
    what it can of its own pairs' mass, those it leads first (as the paper's code does), and the hub takes what
    their refusals leave. Serving an i first never lowers the total (a unit more to i costs the hub at most a
    unit), so this one greedy pass is the LP's optimum. Both ``(vocab,)``; q has a token besides its hub.

    In float64 and normalised as :func:`draw_hub_pair`'s sampler normalises (x2 from q without a, over its own
    sum): with a confident fp32 draft, 1 - q(a) is far from that sum (or 0), and a plan built on it would not
    deliver p."""
    p, q = p.double(), q.double() / q.double().sum()
    a = hub_token(q)
    lead = q.clone()
    lead[a] = 0  # Q(i, a)
    behind = lead * (q[a] / lead.sum())  # Q(a, i) = q(a) q(i) / (1 - q(a)), with 1 - q(a) as the sampler sees it
    via_lead = torch.minimum(p, lead)
    via_behind = torch.minimum(p - via_lead, behind)
    spare_behind, spare_lead = (behind - via_behind).sum(), (lead - via_lead).sum()  # pairs whose i was refused
    hub_behind = torch.minimum(p[a], spare_behind)
    hub_lead = torch.minimum(p[a] - hub_behind, spare_lead)
    left = p - via_lead - via_behind
    left[a] = p[a] - hub_behind - hub_lead
    return HubPlan(a, _ratio(via_lead, lead), _ratio(via_behind, behind), float(_ratio(hub_lead, spare_lead)),
                   float(_ratio(hub_behind, spare_behind)), left.clamp_min(0))


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den in [0, 1], 0 where den is 0 (a pair that is never drawn)."""
    return torch.where(den > 0, num / torch.where(den > 0, den, 1), 0).clamp(0, 1)


def hub_outcome(plan: HubPlan, x1: int, x2: int) -> tuple[float, float]:
    """(P(output x1), P(output x2)) for the drawn pair ``(x1, x2)``; the rest is P(both refused)."""
    if x2 == plan.hub:  # (i, a): the non-hub token leads
        kept = float(plan.keep_lead[x1])
        return kept, (1 - kept) * plan.hub_after_lead
    if x1 == plan.hub:  # (a, i)
        kept = float(plan.keep_behind[x2])
        return (1 - kept) * plan.hub_after_behind, kept
    raise ValueError(f"pair ({x1}, {x2}) does not hold the hub {plan.hub}: it was not drawn by draw_hub_pair")


def verify_hub_pair(p: torch.Tensor, q: torch.Tensor, x1: int, x2: int,
                    generator: torch.Generator | None = None) -> tuple[int | None, torch.Tensor]:
    """SpecHub's verification of one pair ``(x1, x2)`` drawn by :func:`draw_hub_pair` from ``q`` against the
    target's ``p`` (both ``(vocab,)``). Returns ``(0 or 1, p)``: which draft is kept, or ``(None, residual)``:
    the distribution the target's own token is drawn from. The output is exactly p (tested by enumeration)."""
    plan = hub_plan(p, q)
    first, second = hub_outcome(plan, x1, x2)
    u = float(torch.rand((), generator=generator, device=p.device))
    if u < first:
        return 0, p
    if u < first + second:
        return 1, p
    total = plan.left.sum()
    return None, (plan.left / total if total > 0 else p)  # total 0: refused only by rounding, p is exact


def verify_hub(tree: Tree, target_logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None,
               draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
    """:func:`verify_tree` for a tree whose two-child nodes hold a SpecHub pair (in the order drawn, both rows of
    ``draft_probs`` = the q it was drawn from); nodes with one child are verified as in SD. Greedy: the
    target's argmax path, as :func:`verify_tree`. Returns ``(path, next_token)``."""
    if sampling.greedy:
        return verify_tree(tree, target_logits, sampling)
    probs = probs_from_logits(target_logits, sampling)  # (n, vocab)
    path = [0]
    while True:
        node, p = path[-1], probs[path[-1]]
        kids = tree.children[node]
        if len(kids) == 2:
            kept, p = verify_hub_pair(p, draft_probs[kids[0]], tree.tokens[kids[0]], tree.tokens[kids[1]], generator)
            accepted = kids[kept] if kept is not None else None
        elif len(kids) < 2:
            accepted, p = rrs_children(tree, node, p, draft_probs, generator)
        else:
            raise ValueError(f"node {node} has {len(kids)} children; SpecHub's plan is defined for two drafts")
        if accepted is None:
            return path, int(sample(p, generator))
        path.append(accepted)


# ------------------------------------------------------------------------------------------- acceptance, analytic


def hub_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(SpecHub keeps one of its pair) at a node: 1 - sum_{i != a} (p(i) - q(i) / (1 - q(a)))+, where a is the
    hub. (The pair holding i has mass q(i) / (1 - q(a)); the hub always gets all of p(a).) With q(a) = 1: p(a)."""
    p, q = p.double(), q.double() / q.double().sum()  # as hub_plan: the sampler's normalisation, in float64
    a = hub_token(q)
    rest = torch.cat([q[:a], q[a + 1 :]]).sum()  # summed, not 1 - q(a): no cancellation for a confident draft
    if float(rest) <= 0:
        return float(p[a])
    over = (p - q / rest).clamp_min(0)
    over[a] = 0
    return 1 - float(over.sum())


def rrs_acceptance(p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """P(recursive rejection sampling keeps one of ``k`` i.i.d. drafts from q) at a node (SpecInfer's scheme,
    :func:`verify_tree`): 1 - prod_j (1 - sum min(r_j, q)), r_0 = p, r_{j+1} = norm((r_j - q)+)."""
    r, refused = p, 1.0
    for _ in range(k):
        refused *= 1 - float(torch.minimum(r, q).sum())
        r = (r - q).clamp_min(0)
        if float(r.sum()) <= 0:
            return 1.0
        r = r / r.sum()
    return 1 - refused
