"""SWIFT: on-the-fly self-speculative decoding (Xia et al. 2025, ICLR). No draft model: the target drafts for
itself with some of its intermediate attention and MLP sub-layers skipped, and verifies in full.

- Drafting: the skipping target (:class:`methods._swift.SkippingLM`) proposes its greedy token (or a sample)
  one forward at a time, into the target's own KV cache (only the attention layers it runs write), and stops
  after a token it gives a probability below ``confidence`` (the paper's 0.8) or after ``max_draft`` (25).
  The cache is then cropped back: the verification recomputes every layer.
- The candidates (the paper's dynamic tree): at each drafted position, the draft's next-best tokens beside
  its chosen one, as many as its confidence there asks (``widths``: 3, 5, 8 or 10 candidates for a top-1
  probability above 0.95, above 0.8, above 0.5, or below; ``widths_sampled``: 1, 3, 5, 10 when sampling,
  where the extra candidates are independent draws from the draft's distribution, which the shared tree
  verifier needs for exactness). ONE target forward scores the tree; the shared lossless verifier keeps a
  path. ``widths: [1, 1, 1, 1]`` is a plain chain.
- The skip set (``search``): ``online`` (the paper's default) starts from the alternating half of the layers
  and searches during decoding: once a prompt has more than ``context_window + 1`` generated tokens (the
  authors' condition), every decoding step
  (``search_every``) runs one search iteration on them before drafting, and the search's state carries over
  to the next prompts until it stops (:class:`methods._swift.SkipSearch`). Its time is inside those prompts'
  timed decodes, as in the paper, and each record says how much (``search_s``, under the harness clock).
  ``cached``: the set a search found once, over the target's own answers to packaged instructions, before
  any timing (the paper's cached configuration); its one-off cost is in the records as ``search_build_s``.
  ``off``: ``attn_skip`` / ``mlp_skip`` as given, or the alternating half when unset.

Lossless: the target verifies every token (greedy output equals ``ar``; sampled output follows the target).
Where this differs from the authors' code: the draft writes into the target's cache and crops it instead of
drafting in a clone of it; a prompt's search scores a window of ``context_window`` tokens fed once (the
authors feed one more token whose prediction they drop); the searches are seeded (``seed``).

Compiled (``compile=true``): the verification runs the target's compiled graphs; the draft's forwards, which the
graphs (built with every sub-layer) cannot run, run the same code uncompiled on the same static cache
(``CompiledLM.eagerly``; counted as ``uncompiled_calls``), and the online search's on an eager copy of the prompt's
KV. As in production, where a layer-skipping draft is its own graph, not the target's.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator
from transformers import DynamicCache

from core.metrics import ratio
from decoding.cache import truncate_cache
from decoding.sampling import probs_from_logits, sample
from decoding.tree import Tree
from methods._swift import (
    SkippingLM,
    SkipSearch,
    SkipSet,
    load_or_build_skip_set,
    matchness,
    n_layers_of,
    prompt_cache,
)
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register

CONFIDENCE_BANDS = (0.95, 0.8, 0.5)  # the paper's: a top-1 probability above each picks widths[0], [1], [2]


def width(confidence: float, widths: list[int]) -> int:
    """Candidates at a drafted position whose chosen token the draft gives probability ``confidence``."""
    return next((w for band, w in zip(CONFIDENCE_BANDS, widths) if confidence > band), widths[-1])


@register("swift")
class Swift(DraftVerify):
    lossless = True
    # Its draft is the target with sub-layers skipped, on the target's own cache: in a batch, ONE forward of every
    # drafting row on the target's batch cache (SkippingLM.forward_rows).
    batched_drafting = True
    label_settings = ("search",)

    class Config(MethodSettings):
        search: Literal["online", "cached", "off"] = Field(
            "online", description="the skip set: searched during decoding (online, the paper's default), found "
            "once before timing and cached (cached), or attn_skip/mlp_skip as given (off)")
        skip_ratio: float = Field(0.45, gt=0, lt=1, description="share of the sub-layers between the first and "
                                  "last layer that a searched skip set skips")
        attn_skip: list[int] | None = Field(None, description="search=off: layers whose attention the draft skips "
                                            "(unset with mlp_skip: every other layer from layer 1)")
        mlp_skip: list[int] | None = Field(None, description="search=off: layers whose MLP the draft skips")
        context_window: int = Field(32, ge=1, description="generated tokens a candidate skip set is scored on")
        search_every: int = Field(1, ge=1, description="online: one search iteration every this many decoding steps")
        bayes_interval: int = Field(25, ge=0, description="every this many iterations a Bayesian-optimisation "
                                    "candidate, else a random one (0: random search only)")
        max_iters: int = Field(1000, ge=1, description="the search stops after this many iterations ...")
        patience: int = Field(300, ge=0, description="... or after this many without a better set ...")
        target_score: float = Field(0.95, gt=0, le=1, description="... or once a set's matchness exceeds this")
        calibration: int = Field(4, ge=1, description="search=cached: packaged instructions whose target answers "
                                 "the search reads")
        seed: int = Field(0, ge=0, description="the search's random candidates and Bayesian optimiser")
        confidence: float = Field(0.8, ge=0, le=1, description="drafting stops after a token the draft gives a "
                                  "probability below this")
        max_draft: int = Field(25, ge=1, description="tokens drafted per target call at most")
        widths: list[int] = Field([3, 5, 8, 10], description="greedy: candidates at a drafted position whose top-1 "
                                  "probability is > 0.95, > 0.8, > 0.5, or lower")
        widths_sampled: list[int] = Field([1, 3, 5, 10], description="sampling: the same, as draws")

        @field_validator("widths", "widths_sampled")
        @classmethod
        def four_widths(cls, v: list[int]) -> list[int]:
            if len(v) != 4 or min(v) < 1:
                raise ValueError(f"needs four candidate counts of at least 1 (for top-1 probability > 0.95, > 0.8, "
                                 f"> 0.5, lower), not {v}")
            return v

        @model_validator(mode="after")
        def explicit_set_means_off(self):
            if (self.attn_skip is not None or self.mlp_skip is not None) and self.search != "off":
                raise ValueError("attn_skip / mlp_skip are a skip set given by hand: set method.search=off to use "
                                 "them (search=online and search=cached find their own).")
            return self

    def setup(self, train_if_missing: bool = True) -> None:
        self.n_layers = n_layers_of(self.pair.target)
        # The draft's skip set and the online search outlive a prompt by design: the search's state carries over
        # to the next prompts until it stops (the module docstring), so both stay on the method, not the State.
        self.draft_lm = self.pair.add(SkippingLM(self.pair.target, "draft_skip"))
        self.search, self.built = None, {}
        if self.cfg.search == "online":
            start = SkipSet.alternating(self.n_layers)
            self.search = SkipSearch(self.n_layers, self.cfg, start)
            self.search_lm = self.pair.add(SkippingLM(self.pair.target, "search"))
        elif self.cfg.search == "cached":
            start, self.built = load_or_build_skip_set(self.pair, self.cfg, self.n_layers, train_if_missing)
            self.report = self.built  # what `python -m bench train method method=swift method.search=cached` prints
        elif self.cfg.attn_skip is None and self.cfg.mlp_skip is None:
            start = SkipSet.alternating(self.n_layers)
        else:
            start = SkipSet(tuple(sorted(set(self.cfg.attn_skip or ()))), tuple(sorted(set(self.cfg.mlp_skip or ()))))
        start.check(self.n_layers, f"method.search={self.cfg.search}'s skip set")
        self.draft_lm.use(start)

    class State(PromptState):
        """One prompt's steps, its share of the online search, and what each step drafted."""

        steps: int  # decoding steps so far (the search runs every search_every-th)
        search_iters: int  # online search iterations run inside this decode
        search_s: float  # ... and their seconds (harness clock)
        window_cache: DynamicCache | None  # the prompt's KV the search scores candidates after; copied at first use
        chain_lens: list[int]  # per target call: tokens the skipping target drafted
        candidates: list[int]  # per target call: tree nodes the target scored

    def start(self, state: State) -> None:
        state.steps = state.search_iters = 0
        state.search_s, state.window_cache = 0.0, None
        state.chain_lens, state.candidates = [], []

    # ------------------------------------------------------------------------------------------ the search

    def search_step(self, state: State) -> None:
        """One iteration of the online search, on this prompt's first ``context_window + 1`` generated tokens."""
        window = state.out[: self.cfg.context_window + 1]

        def score(cand: SkipSet) -> float:
            if state.window_cache is None:  # the prompt's KV, copied once per prompt (on the search's clock)
                state.window_cache = prompt_cache(state.cache, state.prompt_len)
            self.search_lm.use(cand)
            return matchness(self.search_lm, state.window_cache, window)

        before = self.search.seconds
        if self.search.step(score, state.device):
            self.draft_lm.use(self.search.best)
        state.search_iters += 1
        state.search_s += self.search.seconds - before

    # ------------------------------------------------------------------------------------------- drafting

    def propose(self, state: State) -> Proposal:
        searching = self.search is not None and not self.search.done
        if searching and len(state.out) > self.cfg.context_window + 1 and state.steps % self.cfg.search_every == 0:
            self.search_step(state)
        state.steps += 1
        k = min(self.cfg.max_draft, state.draft_budget)
        if k <= 0:
            return Proposal.chain(state.seq[-1], [])
        chain, confidences, rows = yield from self.draft_chain(state, k)
        proposal = self.tree(state, chain, confidences, rows)
        state.chain_lens.append(len(chain))
        state.candidates.append(len(proposal.tree) - 1)
        return proposal

    def draft_chain(self, state: State, k: int):
        """Up to ``k`` tokens from the skipping target, each its argmax or a sample, stopping after one whose
        (untempered) probability is below ``confidence``. Returns the tokens, those probabilities and per
        token the logits (greedy) or the distribution it was drawn from (sampling), ``(vocab,)`` each. A generator
        of the skipping target's forwards, on the target's cache (a batch runs every drafting row's as one)."""
        past = state.cache.get_seq_length()
        x, chain, confidences, rows = state.seq[-1], [], [], []
        for _ in range(k):
            out = yield {"lm": self.draft_lm, "cache": state.cache, "input_ids": torch.tensor([[x]], device=state.device),
                         "logits_to_keep": 1}
            logits = out.logits[0, -1]
            p = torch.softmax(logits.float(), -1)
            if state.sampling.greedy:
                x, row = int(p.argmax()), logits
            else:
                row = probs_from_logits(logits, state.sampling)
                x = int(sample(row, state.generator))
            chain.append(x)
            confidences.append(float(p[x]))
            rows.append(row)
            if confidences[-1] < self.cfg.confidence:
                break
        truncate_cache(state.cache, past)  # the committed text again: the target recomputes every layer
        return chain, confidences, rows

    def tree(self, state: State, chain: list[int], confidences: list[float], rows: list[torch.Tensor]) -> Proposal:
        """The chain and, at each position, ``width(confidence) - 1`` more candidates as siblings of its token:
        the next-best tokens (greedy; deterministic, ``q = None``) or more draws from the same distribution
        (sampling; ``q`` holds it for each, as the tree verifier's recursive rejection sampling needs)."""
        tree, node, qs = Tree(state.seq[-1]), 0, []
        greedy = state.sampling.greedy
        widths = list(self.cfg.widths if greedy else self.cfg.widths_sampled)
        for tok, conf, row in zip(chain, confidences, rows):
            n = width(conf, widths)
            if greedy:
                child = tree.add_child(node, tok)
                for alt in row.topk(min(n, row.shape[-1])).indices.tolist():
                    if len(tree.children[node]) < n:
                        tree.add_child(node, alt)  # the chain's own token is merged, not added twice
            else:
                draws = sample(row.expand(n - 1, -1), state.generator).tolist() if n > 1 else []
                child = tree.add_child(node, tok, merge=False)
                for alt in draws:  # kept even when equal to a sibling: each is one draw the verifier tests
                    tree.add_child(node, alt, merge=False)
                qs += [row] * (1 + len(draws))  # nodes are numbered as added: q's rows follow them
            node = child
        q = None if greedy else torch.stack([torch.zeros_like(qs[0])] + qs)
        return Proposal(tree, q)

    def extra(self, state: State) -> dict:
        search = self.search
        calls = len(state.chain_lens)
        return {
            "search": self.cfg.search,
            **self.draft_lm.skip.as_dict(),  # the skip set in use at the end of this prompt
            "skipped": self.draft_lm.skip.size,  # sub-layers the draft skips, of 2 per layer
            "search_iters": state.search_iters,  # online: search iterations run inside this decode
            "search_s": state.search_s,  # ... and their seconds (harness clock), part of this decode's wall time
            "search_score": search.best_score if search else self.built.get("score", float("nan")),
            "search_done": search.done if search else True,
            "search_build_s": self.built.get("search_s", 0.0),  # cached: the one-off search before any timing
            "drafted_per_call": ratio(sum(state.chain_lens), calls),  # the skipping target's chain, per target call
            "candidates_per_call": ratio(sum(state.candidates), calls),  # tree nodes the target scores, per call
        }
