"""SAM-Decoding (Hu et al. 2024, "SAM Decoding: Speculative Decoding via Suffix Automaton"): no draft model. A suffix
automaton over the prompt and the committed output (:mod:`decoding.suffix_automaton`), extended as tokens are
committed, finds the longest suffix of the text (the pending token included) that occurred before; the tokens
that followed its first occurrence are the draft, and the target scores them in ONE forward.

How a draft is chosen, as the authors' ``DraftModel.lookup`` chooses it (``match``: the length of that longest
suffix in the text; ``corpus match``: in the optional corpus automaton, the authors' "static" SAM):

- ``aux: none`` (the authors without a tree model): the longer of the two matches drafts, ``min(n_predicts - 1,
  int(alpha * match))`` tokens: the text's automaton a chain after the first occurrence, the corpus's a tree of
  its most frequent continuations (best-first by count, at most 8 per depth).
- ``aux: pld`` or ``eagle`` (the authors with a tree model; Spec-Bench's SAMD runs EAGLE-2): when ``max(match,
  corpus match - len_bias) >= len_threshold`` the longer drafts a chain of ``n_predicts - 1`` tokens (the text's
  from the earliest occurrence of a suffix with that many tokens after it: the authors' ``to_anc``); otherwise
  the auxiliary drafter drafts: prompt lookup (``methods/pld.py``) or EAGLE-2's dynamic tree
  (``methods/eagle/eagle.py``, its trained draft layer).

Each prompt has its own automaton and cursors (on the state), so a prompt's result does not depend on the
prompts before it. Every draft is deterministic (one-hot q, or EAGLE's top-k tree) and verified by the shared
lossless verifiers: greedy output equals ``ar``, sampled output follows the target's distribution.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Literal

from pydantic import Field

from core.artifacts import tokenizer_fingerprint
from core.corpus import Corpus
from core.metrics import ratio
from decoding.ngram import corpus_token_docs
from decoding.suffix_automaton import SuffixAutomaton
from decoding.tree import Tree
from methods.base import DraftVerify, MethodSettings, Proposal
from methods.eagle.eagle import Eagle, EagleSettings
from methods.pld import PLD
from methods.registry import register

CORPUS_TREE_WIDTH = 8  # the authors' K: nodes per depth of a corpus tree, children per node


@register("samd")
class SAMD(DraftVerify):
    lossless = True
    label_settings = ("aux", "n_predicts")  # a row always says which auxiliary drafter ran, and how long a draft

    class Config(MethodSettings):
        n_predicts: int = Field(8, ge=2, description="a draft's length with the pending token, as the authors "
                                "count it: at most n_predicts - 1 tokens drafted (Spec-Bench: 40; 8: measured on "
                                "a 2-core CPU)")
        len_threshold: int = Field(5, ge=0, description="with an auxiliary drafter: the automaton drafts when its "
                                   "match is at least this long, the auxiliary drafter otherwise (Spec-Bench: 5)")
        len_bias: int = Field(5, ge=0, description="a match in the corpus counts this much less than one in the "
                              "text (Spec-Bench: 5)")
        alpha: float = Field(4.0, gt=0, description="aux none: draft int(alpha x match length) tokens, at most "
                             "n_predicts - 1 (the authors: 4)")
        aux: Literal["none", "pld", "eagle"] = Field(
            "none", description="the auxiliary drafter for short matches: none (the automaton alone, its drafts "
            "as long as alpha x match: measured best on a 2-core CPU), pld (prompt lookup) or eagle (EAGLE-2's tree, "
            "a trained draft layer: Spec-Bench's SAMD)")
        corpus: Corpus | None = Field(None, description="packaged text of the corpus automaton (the authors' "
                                      "static SAM); null: the text's automaton only")
        pld: PLD.Config = Field(default_factory=lambda: PLD.Config(name="pld"),
                                description="aux pld: prompt lookup's settings (method=pld)")
        eagle: EagleSettings = Field(default_factory=lambda: EagleSettings(name="eagle"),
                                     description="aux eagle: EAGLE-2's settings (method=eagle)")

    class State(PLD.State, Eagle.State):
        """One prompt's automaton and cursors, with the auxiliary drafter's state (``PLD.State``'s index or
        ``Eagle.State``'s draft cache, whichever runs) and tallies per drafter."""

        sam: SuffixAutomaton  # over seq[:-1]: the committed text but the pending token
        cursor: tuple[int, int]  # (state, length): the longest suffix of sam's text occurring before its last token
        corpus_cursor: tuple[int, int]  # the longest suffix of seq[:corpus_read] occurring in the corpus
        corpus_read: int  # tokens of seq the corpus cursor has read
        source: str  # who drafted this step: automaton, corpus, pld, eagle or none
        steps: Counter  # steps per source
        proposed: Counter  # drafted tokens (deepest path) per source
        kept: Counter  # accepted drafted tokens per source
        matches: list[int]  # the text match's length at each step

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.hidden = self.cfg.aux == "eagle"  # EAGLE's draft reads the target's features
        self.pld = PLD(self.cfg.pld, pair) if self.cfg.aux == "pld" else None
        self.eagle = Eagle(self.cfg.eagle, pair) if self.cfg.aux == "eagle" else None
        self.batched_drafting = self.eagle is not None  # EAGLE's draft forwards are yielded: a batch runs them as one
        self.corpus_sam: SuffixAutomaton | None = None

    @classmethod
    def has_trained_parts(cls, pair_spec, settings=None) -> bool:
        return getattr(settings, "aux", None) == "eagle" and Eagle.has_trained_parts(pair_spec, settings.eagle)

    @classmethod
    def check_recipe(cls, settings, recipe) -> None:
        if settings.aux == "eagle":
            Eagle.check_recipe(settings.eagle, recipe)

    def setup(self, train_if_missing: bool = True) -> None:
        if self.eagle is not None:
            self.eagle.setup(train_if_missing)
        if self.cfg.corpus is not None:
            self.corpus_sam = corpus_automaton(self.pair.tokenizer, self.cfg.corpus)

    def batch_parts(self) -> list:
        return self.eagle.batch_parts() if self.eagle is not None else []

    # ------------------------------------------------------------------------------------------- the loop

    def start(self, state: State) -> None:
        state.sam, state.cursor = SuffixAutomaton(), (0, 0)
        state.corpus_cursor, state.corpus_read = (0, 0), 0
        state.steps, state.proposed, state.kept, state.matches = Counter(), Counter(), Counter(), []
        state.source = "none"
        self.read(state)  # the prompt's automaton, built in the timed decode as the authors build it at prefill
        if self.pld is not None:
            self.pld.start(state)
        if self.eagle is not None:
            self.eagle.start(state)

    def read(self, state: State) -> None:
        """Extend the automaton with what was committed since the last step (all but the pending token), moving
        the cursor before each token is added (so it matches against the text before it), and the corpus
        cursor with it: amortized O(1) per token."""
        sam, cursor = state.sam, state.cursor
        for token in state.seq[len(sam): len(state.seq) - 1]:
            cursor = sam.step(*cursor, token)
            sam.append(token)
        state.cursor = cursor
        if self.corpus_sam is not None:
            state.corpus_cursor = self.corpus_sam.match(state.seq[state.corpus_read:-1], *state.corpus_cursor)
            state.corpus_read = len(state.seq) - 1

    def propose(self, state: State):
        """A generator of EAGLE's draft forwards when it drafts (``aux: eagle``), returning the proposal."""
        pending, k = state.seq[-1], min(self.cfg.n_predicts - 1, state.draft_budget)
        if k <= 0:
            return self.chosen(state, "none", Proposal(Tree(pending)))
        self.read(state)
        node, match = state.sam.step(*state.cursor, pending)
        cnode, cmatch = self.corpus_sam.step(*state.corpus_cursor, pending) if self.corpus_sam else (0, 0)
        state.matches.append(match)
        if self.cfg.aux == "none":
            if match >= cmatch:
                tokens = state.sam.continuation(node, min(k, int(self.cfg.alpha * match)))
                return self.chosen(state, "automaton", Proposal.chain(pending, tokens))
            size = min(k, int(self.cfg.alpha * cmatch)) + 1
            return self.chosen(state, "corpus", Proposal(self.corpus_tree(pending, cnode, size, k)))
        cmatch -= self.cfg.len_bias
        if max(match, cmatch) >= self.cfg.len_threshold:
            if match >= cmatch:
                node = state.sam.earlier(node, k + 1)  # a shorter suffix may have more text after it
                return self.chosen(state, "automaton", Proposal.chain(pending, state.sam.continuation(node, k)))
            return self.chosen(state, "corpus", Proposal.chain(pending, self.corpus_sam.continuation(cnode, k)))
        if self.eagle is not None:
            return self.chosen(state, "eagle", (yield from self.eagle.propose(state)))
        return self.chosen(state, "pld", self.pld.propose(state))

    def chosen(self, state: State, source: str, proposal: Proposal) -> Proposal:
        state.source = source if proposal.depth else "none"  # an empty draft is a plain step, whoever looked
        state.steps[state.source] += 1
        state.proposed[state.source] += proposal.depth
        return proposal

    def accepted(self, state: State, proposal: Proposal, path: list[int], hidden) -> None:
        state.kept[state.source] += len(path) - 1
        if self.eagle is not None:  # EAGLE's draft reads the true features of every committed token
            self.eagle.accepted(state, proposal, path, hidden)

    def corpus_tree(self, pending: int, node: int, size: int, depth: int) -> Tree:
        """The authors' static-SAM tree: best-first from ``node`` by the share of its occurrences each
        continuation has (a path's product of shares), at most ``CORPUS_TREE_WIDTH`` nodes per depth and
        children per node, ``size`` nodes with the root, ``depth`` deep."""
        sam, counts = self.corpus_sam, self.corpus_sam.counts()
        tree, per_depth, order = Tree(pending), Counter(), 0
        heap: list = []  # (-share, order, parent node, token, automaton state): children not yet in the tree

        def push(parent: int, s: int, share: float) -> None:
            nonlocal order
            if tree.depth[parent] >= depth or not counts[s]:
                return
            for token, child in sam.top_next(s, CORPUS_TREE_WIDTH):
                if token >= 0:  # never the document separator
                    heapq.heappush(heap, (-share * counts[child] / counts[s], order, parent, token, child))
                    order += 1

        push(0, node, 1.0)
        while heap and len(tree) < size:
            share, _, parent, token, s = heapq.heappop(heap)
            d = tree.depth[parent] + 1
            if per_depth[d] >= CORPUS_TREE_WIDTH:
                continue
            per_depth[d] += 1
            push(tree.add_child(parent, token, merge=False), s, -share)
        return tree

    def extra(self, state: State) -> dict:
        sources = ["automaton"] + (["corpus"] if self.corpus_sam else []) + \
            ([self.cfg.aux] if self.cfg.aux != "none" else []) + ["none"]
        steps = sum(state.steps.values())
        out = {
            "aux": self.cfg.aux,
            "mean_match": ratio(sum(state.matches), len(state.matches)),  # the text match's length per lookup
            "steps": {s: state.steps[s] for s in sources},  # target calls each drafter drafted for (none: no draft)
            "share": {s: ratio(state.steps[s], steps) for s in sources},  # of all target calls
            # drafted tokens (deepest path) the target kept, per drafter
            "accept_rate": {s: ratio(state.kept[s], state.proposed[s]) for s in sources if s != "none"},
        }
        if self.eagle is not None:
            out["eagle_tree_tokens_per_call"] = self.eagle.extra(state)["tree_tokens_per_call"]
        return out


_CORPORA: dict[tuple[str, str], SuffixAutomaton] = {}  # (tokenizer fingerprint, corpus) -> its automaton


def corpus_automaton(tokenizer, corpus: str) -> SuffixAutomaton:
    """The automaton of a packaged corpus (train split) in the tokenizer's ids, with its counts: built at setup
    (about a second per 100k tokens, so not stored on disk) and kept for the process; read-only afterwards, so
    every prompt shares it."""
    key = (tokenizer_fingerprint(tokenizer), corpus)
    if key not in _CORPORA:
        sam = SuffixAutomaton()
        for doc in corpus_token_docs(tokenizer, corpus):
            sam.add_document(doc)
        sam.counts()  # once, before any timed decode
        _CORPORA[key] = sam
    return _CORPORA[key]
