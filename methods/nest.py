"""NEST: Nearest Neighbor Speculative Decoding (Li, Chen, Holtzman, Chen, Lin, Yih and Lin, NeurIPS 2024,
"Nearest Neighbor Speculative Decoding for LLM Generation and Attribution"). No draft model: the drafts are
spans of real text, copied from a datastore, and every copied token cites its source.

The paper, per prompt and step:

1. Passage retrieval, once per prompt: the top passages of a Wikipedia datastore (100-word passages; a dense
   retriever, DRAGON+ fused with BM25).
2. Token retrieval at every step: the LM's hidden state at the current position is the query, the keys are the
   LM's states at every token of the retrieved passages; the k nearest (squared L2) give p_kNN(w) ∝ Σ over
   neighbours whose next token is w of exp(−d / T). The mixture p_M = λ p_LM + (1 − λ) p_kNN weighs the LM by
   the Relative Retrieval Confidence λ = σ((s_max / s_min − α) / τ), s = −d over the k neighbours, i.e.
   σ((d_nearest / d_kth − α) / τ): a nearest neighbour far closer than the k-th one trusts retrieval.
3. Dynamic span selection: when λ < δ, the next token is the token of the neighbour the mixture likes best,
   and the n tokens that follow it in its passage are proposed with it; a copied span that was kept whole is
   continued from the same passage at the next step.
4. Relaxed speculative acceptance: the LM scores the proposal in one forward; the longest prefix whose every
   token x has p_M(x) > ½ γ max_w p_M(w) at its position is kept (the ½ is the authors' code's; the relaxation
   factor γ = 5e-2 in the paper's main experiments); the first rejected token is replaced by the mixture's own.
   Copied positions are not retrieved again.

LOSSY by design: the output follows the mixture, not the target; records carry ``quality`` (bench/quality.py),
and ``extra`` the attribution: the share of output tokens copied from a cited passage, and the documents cited.

This harness's version:

- Datastore (``methods/_nest.py``): packaged text (Lee news, gensim's Wikipedia extract; ``corpus``), each
  document cut to ``doc_tokens`` tokens and into passages of ``passage_len`` tokens (the paper's 100 words is
  about 128 tokens); the keys are the target's states entering its last decoder layer (the authors' code reads
  ``hidden_states[-2]``: the same tensor), each passage read on its own as the authors encode retrieved
  passages. They are computed once and cached (fp16) instead of per prompt: the same keys, off the clock.
- Passage retrieval: TF-IDF cosine between the prompt's text and the passages' (scikit-learn), not the paper's
  dense retriever (DRAGON+/Contriever need weights this offline harness does not have) fused with BM25.
- The mixture's next token is taken from the row of the SAME target forward that verified the span: the row
  after the kept prefix, as in SD's bonus token. So one target forward per step scores the span and prepares
  the next one (the authors' loop runs a second forward for the proposal's first position). The prompt's first
  new token comes from the base's prefill (the target alone) and is not cited.
- Citations: only tokens copied from a passage (a span's tokens, and the neighbour's token that starts a copy
  when λ < δ) cite a source. A mixture token that merely equals a neighbour's is not counted as copied, and
  starts no copy (an earlier version did both, which inflated attribution and copied when retrieval was not
  trusted).
- Sampling (temperature > 0): the run's temperature and top-p are applied to the mixture p_M (whose p_LM is
  already tempered by ``lm_temperature``): the two temperatures compound.
- Neighbours are ranked for span selection by their token's mixture probability (the paper's wording; the
  authors' code ranks by the LM's term), ties to the nearest.
- Default span: 16 tokens per target call (the authors' demo proposes 64; a 65-token CPU forward costs several
  one-token ones, and a rejected span wastes them). The kNN search and mixing are not counted in FLOPs (as
  n-gram lookups are not).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, field_validator

from core.layer_taps import LayerTaps
from core.metrics import ratio
from decoding.sampling import probs_from_logits, sample
from methods._nest import (
    TokenIndex,
    check_folder,
    load_or_build_datastore,
    open_given,
)
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register

NEST_CORPORA = Literal["news", "lee", "wiki", "news+wiki", "lee+wiki"]
TIE = 1e-6  # neighbours whose tokens the mixture scores alike are ordered by their own kNN weight


@dataclass
class Mixture:
    """The mixture at ``n`` positions. ``p``: ``(n, vocab)`` p_M; ``p_knn``: ``(n, vocab)``; ``lam``: ``(n,)`` the
    LM's weight λ; ``top``: ``(n,)`` the best neighbour's key row in the prompt's :class:`TokenIndex` (-1: none)."""

    p: torch.Tensor
    p_knn: torch.Tensor
    lam: torch.Tensor
    top: torch.Tensor


@register("nest")
class Nest(DraftVerify):
    lossless = False  # the output follows the retrieval mixture, not the target: see the module docstring

    class Config(MethodSettings):
        datastore: str | None = Field(None, description="a built NEST datastore folder (cache_dir/nest/datastore-"
                                      "<key>) to use; null: the artifact cache's, built when missing")
        corpus: NEST_CORPORA = Field("news+wiki", description="packaged text retrieved from: news (the 50 held-out "
                                     "Lee articles), lee (all 350), wiki (gensim's Wikipedia extract), or two")
        doc_tokens: int = Field(512, ge=16, description="tokens kept from the start of each document")
        passage_len: int = Field(128, ge=8, description="tokens per passage (the paper's 100 words)")
        passages: int = Field(20, ge=1, description="passages retrieved per prompt (the authors' demo: 20)")
        k: int = Field(1024, ge=1, description="nearest token keys behind p_kNN (the authors': 1024)")
        knn_temperature: float | None = Field(None, gt=0, description="p_kNN = softmax(-squared L2 / this); null: "
                                              "sqrt(hidden size), as the authors' code")
        lm_temperature: float = Field(0.7, gt=0, description="temperature of p_LM inside the mixture (the authors' "
                                      "code: 0.7)")
        alpha: float = Field(0.3, ge=0, le=1, description="RRC offset: lambda = sigmoid((d_nearest/d_kth - alpha) "
                             "/ tau), the LM's weight (the paper: 0.3)")
        tau: float = Field(0.1, gt=0, description="RRC scale (the paper: 0.1)")
        delta: float = Field(0.5, ge=0, le=1, description="a span is copied when lambda < delta (the paper: 0.5; "
                             "0: never)")
        gamma: float = Field(0.05, ge=0, le=2, description="relaxation: a copied token stays while p_M(x) > "
                             "gamma/2 * max p_M (the paper: 5e-2; 0: every copied token stays; 2: none)")
        span_len: int = Field(16, ge=1, description="copied tokens proposed per target call at most (the authors' "
                              "demo: 64)")

        @field_validator("datastore")
        @classmethod
        def built_folder(cls, path):
            """A datastore folder that exists and says so (checked before any model loads)."""
            if path is not None and (why := check_folder(path)) is not None:
                raise ValueError(f"{why}; leave it unset to build one in the cache.")
            return path

    class State(PromptState):
        """One prompt's retrieval and copying: its passages and their token index, the span in flight, the
        source of every committed token, and the tallies ``extra`` reports."""

        queries: LayerTaps  # the target's last forward's states entering its last decoder layer
        retrieved: list[int]  # the passages retrieved for the prompt
        index: TokenIndex  # their token keys, less the positions already copied
        plan: list[tuple[int, int, int]]  # (token, doc, position) to propose next
        span: list[tuple[int, int, int]]  # what this step proposed
        sources: list[tuple[int, int] | None]  # (doc, position) per committed token; None: not copied
        step_sources: list[tuple[int, int] | None]  # the same for this step's tokens, before the commit
        lams: list[float]  # lambda at each step that mixed
        gated: int  # steps where lambda < delta started a copy
        spans: int  # steps that proposed a copied span
        spans_whole: int  # of those, spans kept whole
        span_tokens: int  # copied tokens proposed
        span_kept: int  # copied tokens kept

    def setup(self, train_if_missing: bool = True) -> None:
        cfg = self.cfg
        self.last_layer = self.pair.target.module.config.num_hidden_layers - 1  # its input: the queries
        build = {"corpus": cfg.corpus, "doc_tokens": cfg.doc_tokens, "passage_len": cfg.passage_len}
        self.store = (open_given(cfg.datastore, self.pair, build) if cfg.datastore
                      else load_or_build_datastore(self.pair, build, train_if_missing))
        self.report = self.store.report  # what `python -m bench train method method=nest` prints
        hidden = int(self.pair.target.module.config.hidden_size)
        self.knn_t = cfg.knn_temperature if cfg.knn_temperature is not None else math.sqrt(hidden)

    # ------------------------------------------------------------------------------------------ the mixture

    def mixture(self, index: TokenIndex, logits: torch.Tensor | None, h: torch.Tensor) -> Mixture:
        """p_M at each of ``n`` positions from the target's ``logits (n, vocab)`` (None: p_kNN alone), its query
        states ``h (n, hidden)`` and the prompt's token ``index``."""
        cfg = self.cfg
        vocab = logits.shape[-1] if logits is not None else int(self.pair.target.module.config.vocab_size)
        n = h.shape[0]
        p_lm = torch.softmax(logits.float() / cfg.lm_temperature, -1) if logits is not None else None
        if len(index) == 0:  # every retrieved position already copied: the LM alone
            p = p_lm if p_lm is not None else torch.full((n, vocab), 1.0 / vocab, device=h.device)
            return Mixture(p, torch.zeros_like(p), torch.ones(n, device=h.device),
                           torch.full((n,), -1, dtype=torch.long, device=h.device))
        d2, rows = index.search(h, cfg.k)
        w = torch.softmax(-d2 / self.knn_t, -1)  # (n, k') weights of the neighbours
        vals = index.vals[rows]
        p_knn = torch.zeros(n, vocab, device=h.device).scatter_add_(1, vals, w)
        # Relative Retrieval Confidence: s_max / s_min with s = -d2 is d_nearest / d_kth (0 when all are at 0).
        rel = torch.where(d2[:, -1] > 0, d2[:, 0] / d2[:, -1].clamp_min(1e-30), torch.zeros_like(d2[:, 0]))
        lam = torch.sigmoid((rel - cfg.alpha) / cfg.tau) if p_lm is not None else torch.zeros(n, device=h.device)
        p = lam[:, None] * p_lm + (1 - lam[:, None]) * p_knn if p_lm is not None else p_knn
        best = (p.gather(1, vals) + TIE * w).argmax(-1, keepdim=True)  # the neighbour whose token p_M likes best
        return Mixture(p, p_knn, lam, rows.gather(1, best)[:, 0])

    def passes(self, p: torch.Tensor, token: int) -> bool:
        """The relaxed rule: ``token`` stays when p_M(token) > ½ γ max p_M (``p``: ``(vocab,)``)."""
        return bool(p[token] > 0.5 * self.cfg.gamma * p.max())

    @staticmethod
    def source(index: TokenIndex, row: int) -> tuple[int, int]:
        """(document, position) of the token after key ``row`` of the prompt's ``index``."""
        return int(index.doc[row]), int(index.pos[row])

    def continuation(self, doc: int, pos: int) -> list[tuple[int, int, int]]:
        """``(token, doc, position)`` of up to ``span_len`` tokens after position ``pos`` of document ``doc``."""
        text = self.store.doc_tokens(doc)
        end = min(len(text), pos + 1 + self.cfg.span_len)
        return [(int(text[q]), doc, q) for q in range(pos + 1, end)]

    def choose(self, state: State, mix: Mixture, row: int, span: list, kept_whole: bool) -> tuple[int, tuple | None]:
        """The token after the kept prefix (``mix`` row ``row``) and its source, ``None`` for the LM's own."""
        p, top = mix.p[row], int(mix.top[row])
        if span and kept_whole:  # a copied span kept whole goes on in its passage, checked like its tokens
            doc, pos = span[-1][1], span[-1][2] + 1
            if pos < len(self.store.doc_tokens(doc)) and self.passes(p, tok := int(self.store.doc_tokens(doc)[pos])):
                return tok, (doc, pos)
        state.lams.append(float(mix.lam[row]))
        top_tok = int(state.index.vals[top]) if top >= 0 else -1
        if kept_whole and top >= 0 and float(mix.lam[row]) < self.cfg.delta and self.passes(p, top_tok):
            state.gated += 1
            # Dynamic span selection: retrieval is confident, copy from there.
            return top_tok, self.source(state.index, top)
        if state.sampling.greedy:
            tok = int(p.argmax())
        else:
            tok = int(sample(probs_from_logits(p.clamp_min(1e-38).log(), state.sampling), state.generator))
        # The mixture's own token: not copied, so not cited (even when it equals a neighbour's), and no copy starts.
        return tok, None

    # ------------------------------------------------------------------------------------------ the loop

    def start(self, state: State) -> None:
        # From here on every target forward leaves its last layer's input states in state.queries: the queries.
        state.queries = state.closing.enter_context(LayerTaps(self.pair.target, (self.last_layer,)))  # the base closes it
        query = self.pair.tokenizer.decode(state.prompt_ids[0].tolist(), skip_special_tokens=True)
        state.retrieved = self.store.retrieve(query, self.cfg.passages)
        state.index = TokenIndex(self.store, state.retrieved, state.device)
        state.plan, state.span, state.step_sources, state.lams = [], [], [], []
        state.sources = [None]  # the prefill's token is the target's own: not cited
        state.gated = state.spans = state.spans_whole = state.span_tokens = state.span_kept = 0
        # Copies start from the first verifying forward on.

    def propose(self, state: State) -> Proposal:
        state.span = state.plan[: max(state.draft_budget, 0)]
        state.spans += bool(state.span)
        state.span_tokens += len(state.span)
        return Proposal.chain(state.seq[-1], [t for t, _, _ in state.span])

    def verify(self, state: State, proposal: Proposal, logits: torch.Tensor) -> tuple[list[int], int]:
        """Relaxed acceptance of the copied span; the next token from the mixture after the kept prefix."""
        mix = self.mixture(state.index, logits, state.queries.input(self.last_layer)[0])
        kept = 0
        for i, (tok, _, _) in enumerate(state.span):  # row i scores the token after node i
            if not self.passes(mix.p[i], tok):
                break
            kept += 1
        nxt, src = self.choose(state, mix, kept, state.span, kept_whole=kept == len(state.span))
        state.step_sources = [(d, q) for _, d, q in state.span[:kept]] + [src]
        state.plan = self.continuation(*src) if src is not None else []
        return list(range(kept + 1)), nxt

    def accepted(self, state: State, proposal: Proposal, path: list[int], hidden) -> None:
        committed = state.step_sources[: len(state.out) - len(state.sources)]  # the commit may stop at EOS / budget
        state.sources += committed
        for s in committed:
            if s is not None:
                state.index.drop(*s)  # copied text is not retrieved again
        if state.span:
            state.span_kept += len(path) - 1
            state.spans_whole += len(path) - 1 == len(state.span)

    def extra(self, state: State) -> dict:
        srcs = state.sources[: len(state.out)]
        cited = [s for s in srcs if s is not None]
        nearby = [None, *srcs, None]  # a cited token whose neighbour continues the same document is in a span
        in_spans = sum(1 for i, s in enumerate(srcs, 1) if s is not None and (
            nearby[i - 1] == (s[0], s[1] - 1) or nearby[i + 1] == (s[0], s[1] + 1)))
        by_doc = Counter(doc for doc, _ in cited)
        docs = self.store.docs
        return {
            "attribution_rate": ratio(len(cited), len(state.out)),  # output tokens copied from a cited passage
            "attributed_tokens": len(cited),
            # the same, counting only runs of >= 2 consecutive tokens of one document (not one-token agreements)
            "attribution_rate_spans": ratio(in_spans, len(state.out)),
            "sources": [{"doc": docs[d]["id"], "title": docs[d]["title"], "tokens": n} for d, n in by_doc.most_common()],
            "spans_proposed": state.spans,  # target calls that scored a copied span
            "spans_accepted": state.spans_whole,  # of those, spans kept whole
            "span_tokens_proposed": state.span_tokens,
            "span_tokens_accepted": state.span_kept,
            "spans_selected": state.gated,  # steps where lambda < delta started a copy (dynamic span selection)
            "retrieval_weight": ratio(sum(1 - x for x in state.lams), len(state.lams)),  # mean 1 - lambda
            "retrieved": list(dict.fromkeys(docs[self.store.passages[i]["doc"]]["id"] for i in state.retrieved)),
        }
