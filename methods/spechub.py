"""SpecHub (Sun et al., EMNLP 2024): multi-draft speculative sampling around a hub token, beside the RRS baseline.

Sun, Zhou, Chen, Sun, "SpecHub: Provable Acceleration to Multi-Draft Speculative Decoding" (arXiv 2411.05289);
the baseline it improves on is recursive rejection sampling (RRS: SpecInfer, Miao et al. 2024), here with and
without replacement.

One step (ONE target forward), with k = ``drafts`` sequences of ``gamma`` tokens:

1. The draft reads the committed tokens it has not seen; its cache then ends at the pending token, and its logits
   give q, its distribution for the next token.
2. The k sequences' first tokens, by ``verifier``:
   - ``hub`` (k = 2): a pair from SpecHub's sparse joint distribution (:func:`decoding.verify.draw_hub_pair`):
     x1 ~ q; x2 = a, the draft's top token, when x1 != a, else x2 ~ q without a (renormalised). The two
     differ, and one of them is a.
   - ``rrs``: k i.i.d. draws from q (SpecInfer's setting; equal draws stay separate nodes).
   - ``rrs_wo``: k draws without replacement (each from q without the earlier ones, renormalised).
   Greedy (temperature 0), every verifier: the draft's k most likely tokens.
3. Each sequence goes on alone for ``gamma - 1`` tokens, drawn from the draft given its own prefix (greedy: its
   argmax). All k advance in one draft forward per depth: the draft reads them as a token tree (its cache
   holds the committed text, then the tree's nodes level by level, under a tree attention mask).
4. The target scores the tree (the pending token, k x gamma nodes) in ONE forward and keeps a root path:
   ``hub``: :func:`decoding.verify.verify_hub` (at the root, SpecHub's transport plan for the pair; below it,
   each sequence is a chain, verified as in SD); ``rrs`` / ``rrs_wo``: :func:`decoding.verify.verify_tree`.
   Greedy: the target's argmax path, for all three. Lossless in every case.
5. The draft's cache keeps the accepted nodes' entries (:func:`decoding.tree.keep_path`, as the target's), so
   nothing it read is read again; the base then rolls it back with the target's (it is tracked).

SpecHub's verification at the root (:func:`decoding.verify.hub_plan`): every pair holds the hub a, and a non-hub
token i is only in the pairs (i, a), of mass q(i), and (a, i), of mass q(a) q(i) / (1 - q(a)). The plan sends to
each i what it can of those two pairs' mass (its own pair (i, a) first), and to a what their refusals leave;
what is still owed to p is the residual the target's token is drawn from. This greedy pass is the optimum of
the transport LP restricted to that sparse support (the paper's "compact LP"), in O(vocab).

Acceptance at the root, derived here (``decoding.verify.hub_acceptance`` / ``rrs_acceptance``, tested):
P(hub keeps a draft) = 1 - sum_{i != a} (p(i) - q(i) / (1 - q(a)))+; P(RRS keeps one of 2 i.i.d. drafts) =
1 - sum_x (p(x) - (2 - b) q(x))+ with b = sum min(p, q). So SpecHub accepts at least as often as RRS whenever
1 / (1 - q(a)) >= 2 - b, in particular whenever q(a) >= 1/2; with a flat draft (q(a) well below 1/2) it can
accept less (``tests/methods/test_spechub.py`` has a case). The per-prompt figures give both expectations on the same
contexts, whichever verifier runs.

What was read: the abstract (arXiv, ACL Anthology), the start of a third-party summary, and the authors' code
(github.com/MasterGodzilla/Speculative_decoding_OT: ``Sequoia/utils.py`` ``sampling_a_and_i``, the pair sampler,
and ``Sequoia/Tree/MyTree.py`` ``accept_step``, the two-children verification, which raises for more children).
The pair distribution and the plan above follow that code (re-derived and written anew here). The paper's body
(its theorem statements and their conditions, its treatment of k > 2) could not be read; the acceptance formulas
and the q(a) >= 1/2 condition are this file's own derivation, not quotes.

Deviations from the paper: (a) the paper's experiments verify token trees in which nodes branch at several depths
(its 3 / 7 / 15 / 31-node binary trees); here k whole sequences, so the hub acts at the root only and each
sequence is a chain below it. (b) ``verifier=hub`` takes at most 2 drafts (refused beyond, as the authors' code
raises); k = 1 is plain SD. (c) The greedy analogue (the draft's top-k first tokens) is this harness's.
(d) ``rrs`` draws may repeat a token at the root (kept as separate nodes, as the authors' baseline keeps them).

The draft's cache: one tree of k x (gamma - 1) nodes read level by level in a single cache (one prefill in
``start``), rather than k copies of the cache (a batch) or k passes with crops: gamma draft forwards per step,
as SD's, and the accepted path's entries stay where they are.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from transformers import Cache

from decoding.sampling import probs_from_logits, sample
from decoding.tree import Tree, keep_path, nodes_request
from decoding.verify import (
    draw_hub_pair,
    hub_acceptance,
    hub_token,
    rrs_acceptance,
    verify_hub,
)
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register


def draw_without_replacement(q: torch.Tensor, k: int, generator) -> tuple[list[int], list[torch.Tensor]]:
    """Up to ``k`` distinct tokens from ``q (vocab,)``, each from q without the earlier ones (renormalised), and
    the row each was drawn from (what RRS without replacement tests it against). Fewer when q runs out."""
    tokens, rows, rest = [], [], q.clone()
    while len(tokens) < k and float(rest.sum()) > 0:
        row = rest / rest.sum()
        tokens.append(int(sample(row, generator)))
        rows.append(row)
        rest[tokens[-1]] = 0
    return tokens, rows


@register("spechub")
class SpecHub(DraftVerify):
    lossless = True  # every verifier is exact: greedy output equals ar's, sampled output follows the target's
    drafts = 1  # the pair's draft model
    batched_drafting = True  # a batch reads every row's tree level in one draft forward
    label_settings = ("verifier",)  # a row always says whether it is SpecHub or the RRS baseline

    class Config(MethodSettings):
        drafts: int = Field(2, ge=1, description="k: draft sequences per target call (verifier=hub: at most 2)")
        gamma: int = Field(4, ge=1, description="tokens per draft sequence (the depth of the tree the target scores)")
        verifier: Literal["hub", "rrs", "rrs_wo"] = Field(
            "hub", description="hub = SpecHub (a pair around the draft's top token, its transport plan); rrs = "
            "recursive rejection sampling of i.i.d. drafts (SpecInfer), the baseline; rrs_wo = RRS of drafts "
            "drawn without replacement")

        @model_validator(mode="after")
        def hub_takes_a_pair(self):
            if self.verifier == "hub" and self.drafts > 2:
                raise ValueError(f"verifier=hub takes at most 2 drafts, not {self.drafts}: SpecHub pairs the "
                                 "draft's top token with one other draft; use verifier=rrs or rrs_wo for more.")
            return self

    class State(PromptState):
        """One prompt's drafting and root tallies: the draft's KV cache, this step's root, what was kept there."""

        dcache: Cache  # the draft's: a DynamicCache, or its compiled forwards' static one (compile=true)
        past: int  # this step's pending position, where the draft's tree starts
        root_q: torch.Tensor | None  # the draft's q at the pending token, (vocab,); None when greedy
        root_top: int  # the draft's top token there
        tree_steps: int  # steps whose target forward scored a drafted tree
        kept_by_draft: list[int]  # root acceptances, by the sequence kept
        kept_top: int  # root acceptances of the draft's top token
        expected: dict[str, list[float]]  # per call, each scheme's expected root acceptance (sampling, 2 drafts)

    def start(self, state: State):
        # The draft reads the prompt once (its cost, counted); afterwards only what it has not read.
        state.dcache = yield from state.draft_cache(self.pair.draft)
        state.past = 0
        state.root_q, state.root_top = None, -1
        state.tree_steps = 0
        state.kept_by_draft = [0] * self.cfg.drafts
        state.kept_top = 0
        state.expected = {"hub": [], "rrs": []}

    # ------------------------------------------------------------------------------------------- drafting

    def propose(self, state: State):
        depth = min(self.cfg.gamma, state.draft_budget)
        state.past = len(state.seq) - 1
        tree = Tree(state.seq[-1])
        if depth <= 0:
            return Proposal(tree)
        pending = torch.tensor([state.seq[state.dcache.get_seq_length():]], device=state.device)
        out = yield {"lm": self.pair.draft, "cache": state.dcache, "input_ids": pending, "logits_to_keep": 1}
        logits = out.logits[0, -1]
        tokens, rows = self.first_tokens(state, logits)
        level = [tree.add_child(0, t, merge=False) for t in tokens]
        for _ in range(depth - 1):
            # The draft reads the tree level by level: the levels above are in its cache, in node order.
            out = yield nodes_request(self.pair.draft, state.dcache, tree, level, list(range(1, level[0])), state.past)
            logits = out.logits[0]
            if state.sampling.greedy:
                nxt = logits.argmax(-1)
            else:
                q = probs_from_logits(logits, state.sampling)
                nxt = sample(q, state.generator)
                rows += list(q)
            level = [tree.add_child(v, t, merge=False) for v, t in zip(level, nxt.tolist())]
        q = torch.stack([rows[0].new_zeros(rows[0].shape), *rows]) if rows else None  # row 0: the root, unused
        return Proposal(tree, q)

    def first_tokens(self, state: State, logits: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
        """The k sequences' first tokens after the pending one, and the row of q each is verified with (none when
        greedy). ``logits (vocab,)``: the draft's at the pending token."""
        k = self.cfg.drafts
        if state.sampling.greedy:
            state.root_q, state.root_top = None, hub_token(logits)
            return logits.topk(min(k, logits.shape[-1])).indices.tolist(), []
        q = state.root_q = probs_from_logits(logits, state.sampling)
        state.root_top = hub_token(q)  # the hub, as draw_hub_pair and verify_hub find it
        if self.cfg.verifier == "rrs_wo":
            return draw_without_replacement(q, k, state.generator)
        if self.cfg.verifier == "hub":
            tokens = draw_hub_pair(q, state.generator) if k == 2 else [int(sample(q, state.generator))]
        else:
            tokens = sample(q.expand(k, -1), state.generator).tolist()
        return tokens, [q] * len(tokens)  # a hub pair: both rows hold the q its joint distribution is built on

    # ------------------------------------------------------------------------------------------- verifying

    def verify(self, state: State, proposal: Proposal, logits: torch.Tensor) -> tuple[list[int], int]:
        if self.cfg.verifier == "hub":
            path, nxt = verify_hub(proposal.tree, logits, state.sampling, state.generator, proposal.q)
        else:
            path, nxt = super().verify(state, proposal, logits)  # RRS over each node's children (verify_tree)
        if proposal.depth:
            self.tally(state, proposal, logits, path)
            # The draft read the nodes above the leaves; keep the accepted ones' entries, in order, before the
            # commit rolls its cache back to the committed text (which they then are).
            keep_path(state.dcache, state.past, path[: proposal.depth])
        return path, nxt

    def tally(self, state: State, proposal: Proposal, logits: torch.Tensor, path: list[int]) -> None:
        """Which root draft was kept; and, when sampling two drafts, both schemes' expected root acceptance on
        this very context (the same p and q: a paired comparison, free of sampling noise)."""
        state.tree_steps += 1
        if len(path) > 1:
            state.kept_by_draft[proposal.tree.children[0].index(path[1])] += 1
            state.kept_top += proposal.tree.tokens[path[1]] == state.root_top
        if state.root_q is not None and self.cfg.drafts == 2:
            p = probs_from_logits(logits[0], state.sampling)
            state.expected["hub"].append(hub_acceptance(p, state.root_q))
            state.expected["rrs"].append(rrs_acceptance(p, state.root_q, 2))

    def extra(self, state: State) -> dict:
        kept = sum(state.kept_by_draft)
        steps = state.accept_lengths

        def mean(xs):
            return sum(xs) / len(xs) if xs else float("nan")

        return {"verifier": self.cfg.verifier, "drafts": self.cfg.drafts,
                "accepted_per_call": mean(steps),
                "root_accept_rate": kept / state.tree_steps if state.tree_steps else float("nan"),
                "root_kept_by_draft": list(state.kept_by_draft),
                "root_kept_top_share": state.kept_top / kept if kept else float("nan"),
                # Sampling with 2 drafts: P(a root draft is kept) under each scheme, from the step's p and q.
                "root_accept_expected_hub": mean(state.expected["hub"]),
                "root_accept_expected_rrs": mean(state.expected["rrs"])}
