"""Cascade speculative drafting (CS Drafting; Chen et al. 2023, "Cascade Speculative Drafting for Even
Faster LLM Inference").

Levels, most expensive first: the target (level 0), the draft model, the pair's second draft when it has
one, and at the bottom a statistical drafter that costs no forward pass (the longest n-gram of the current
text matched earlier in it, else a chain through a bigram table of packaged text).

- Vertical cascade: a model level does not decode token by token; it runs speculative decoding itself,
  reviewing proposals made by the levels below it.
- Horizontal cascade: a proposal reviewed by level i is made of ``k_matrix[i][0]`` tokens from level i+1,
  then ``k_matrix[i][1]`` from level i+2, ... : later positions, less likely to survive, come from cheaper
  drafters. A model level asked for n tokens reviews proposals of at most n - 1 tokens, since each of its
  reviews adds one token of its own (so the proposal is cut where its row asks for more).

The target's review is :func:`decoding.verify.verify_chain` (strict, lossless). Inner reviews only shape the
draft, so greedily they may be lenient (``lenience`` > 1: a token passes when it is among the reviewer's
top ``lenience``). When sampling, inner reviews are strict rejection sampling, so every token a model level
emits is distributed as that model's own next-token distribution q, which the target's exact test needs
(statistical tokens are deterministic: one-hot q). Either way greedy output equals ``ar``.

KV caches are never recomputed: the target's is the shared loop's (:class:`methods.base.DraftVerify`); each
draft level keeps the tokens its cache holds and, before scoring, is cropped to the longest common prefix
with the text it is asked about.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field, NonNegativeInt, model_validator

from core.corpus import Corpus
from core.errors import BenchError
from core.metrics import ratio
from decoding.cache import truncate_cache
from decoding.ngram import NGramIndex, load_bigram_table, ngram_sizes
from decoding.sampling import probs_from_logits
from decoding.verify import verify_chain
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register

# Default k-matrices by the number of levels (target, drafts..., statistical): row i lists how many tokens
# each lower level contributes to one proposal that level i reviews. A level asked for n tokens reviews
# proposals of at most n - 1 (its own review adds a token), so each row sums to at most the count asked of
# that level from above, minus one.
DEFAULT_K = {
    3: [[4, 1], [3]],  # target <- 4 draft + 1 stat; draft <- 3 stat
    4: [[4, 2, 1], [2, 1], [1]],  # target <- 4 draft + 2 draft2 + 1 stat; draft <- 2 draft2 + 1 stat; draft2 <- 1 stat
}


class ModelLevel:
    """A draft model with its own KV cache (``cache``, empty at first) and the token ids that cache holds."""

    def __init__(self, lm, cache):
        self.lm, self.name, self.cache = lm, lm.role, cache
        self.toks: list[int] = []

    def score(self, ctx: list[int], proposal: list[int], device):
        """Next-token logits after ``ctx`` and after each proposed token: ``FloatTensor (len(proposal) + 1, vocab)``.
        A generator of the one draft forward (a batch runs every row's as one, ``DraftVerify.steps``).

        Only what the cache lacks is fed: the cache is first cropped to its common prefix with ``ctx`` (what
        an earlier review rejected goes), keeping at least the last context token to score from.
        """
        keep = 0
        for a, b in zip(self.toks, ctx):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ctx) - 1)
        truncate_cache(self.cache, keep)
        feed = ctx[keep:] + proposal
        rows = len(proposal) + 1
        out = yield {"lm": self.lm, "cache": self.cache, "input_ids": torch.tensor([feed], device=device),
                     "logits_to_keep": rows}
        logits = out.logits[0, -rows:]
        self.toks = ctx + proposal
        return logits


class StatLevel:
    """The free bottom drafter: a continuation of the longest n-gram match in the committed text, topped
    up by a bigram chain from packaged text."""

    name = "stat"

    def __init__(self, index: NGramIndex, bigram):
        self.index, self.bigram = index, bigram
        self.lookups = self.context_hits = 0

    def draft(self, ctx: list[int], n: int) -> list[int]:
        found = self.index.continuations(ctx, n)
        self.lookups += 1
        self.context_hits += bool(found)
        tokens = found[0] if found else []
        return tokens + self.bigram.chain(tokens[-1] if tokens else ctx[-1], n - len(tokens))


class TargetLevel:
    """Level 0: the target, whose reviews are the shared loop's one forward per step."""

    name = "target"


def q_matrix(tokens: torch.Tensor, q_rows: list, vocab: int) -> torch.Tensor | None:
    """``(k, vocab)`` proposal distributions: a model level's row, or one-hot for a deterministic statistical
    token (``None`` in ``q_rows``); ``None`` when every token is deterministic."""
    if all(r is None for r in q_rows):
        return None
    rows = [r if r is not None else F.one_hot(tokens[i], vocab).to(torch.float32) for i, r in enumerate(q_rows)]
    return torch.stack(rows).to(tokens.device)


@register("cascade")
class Cascade(DraftVerify):
    lossless = True
    drafts = 2  # at most: a pair with one draft gives a three-level cascade
    batched_drafting = True  # each model level's forwards are yielded: a batch runs every row's as one

    class Config(MethodSettings):
        k_matrix: list[list[NonNegativeInt]] | None = Field(
            None, description="row i: tokens each lower level adds to a proposal level i reviews (a level asked "
            "for n tokens reviews at most n - 1 per forward); null = by level count: target, draft, stat: "
            "[[4, 1], [3]]; with pair.drafts[1]: [[4, 2, 1], [2, 1], [1]]")
        lenience: int = Field(1, ge=1, description="inner reviews (greedy only): accept a token in the "
                              "reviewer's top-lenience; 1 = strict")
        max_ngram: int = Field(3, ge=1, description="statistical level: longest n-gram of the text matched first ...")
        min_ngram: int = Field(1, ge=1, description="... down to this one; no match: the bigram chain")
        corpus: Corpus = Field("lee", description="packaged text of the bigram table")

        @model_validator(mode="after")
        def sizes(self):
            return ngram_sizes(self)

        @model_validator(mode="after")
        def triangle(self):
            """Row i has one count per level below level i: a triangle, e.g. [[4, 1], [3]]."""
            k = self.k_matrix
            if k is not None and not (k and all(len(r) == len(k) - i for i, r in enumerate(k))):
                raise ValueError(f"k_matrix must be a triangle of rows (one per reviewing level, row i with one "
                                 f"count per level below it, e.g. [[4, 1], [3]]), got {k}.")
            return self

    @classmethod
    def check_pair(cls, settings, pair) -> None:
        super().check_pair(settings, pair)
        levels = 1 + len(pair.drafts[:2])  # the levels that review: the target and up to two drafts
        if settings.k_matrix is not None and len(settings.k_matrix) != levels:
            raise BenchError(f"method.k_matrix has {len(settings.k_matrix)} rows but pair={pair.name} gives {levels} "
                             f"reviewing levels (the target and {levels - 1} draft(s)).")

    def setup(self, train_if_missing: bool = True) -> None:
        self.bigram = load_bigram_table(self.pair.tokenizer, self.pair.target.module.config.vocab_size,
                                        self.cfg.corpus, self.pair.cache)
        _ = self.pair.draft  # a pair without a draft model raises its one-sentence error here
        n_levels = 1 + len(self.pair.drafts[:2]) + 1
        k = self.cfg.k_matrix
        self.k = [list(r) for r in k] if k is not None else DEFAULT_K[n_levels]

    class State(PromptState):
        """One prompt's cascade: its levels (each draft's KV cache, the statistical drafter's index) and tallies."""

        lenience: int  # inner reviews (greedy only): a token passes in the reviewer's top-lenience; 1 = strict
        index: NGramIndex  # the committed text's n-grams, read by the statistical level
        levels: list  # target, draft model(s), statistical: most expensive first
        reviews: dict[str, dict]  # "<drafter>><reviewer>": tokens proposed / accepted
        sources: list[int]  # the level each token of this step's proposal came from

    # --------------------------------------------------------------------------------------- the cascade

    def propose_for(self, state: State, i: int, ctx: list[int], limit: int):
        """The proposal level ``i`` reviews after ``ctx``: at most ``limit`` tokens, ``k[i][0]`` from level
        i+1, then ``k[i][1]`` from level i+2, ... Returns ``(tokens, q_rows, sources)``: ``q_rows`` holds one
        ``FloatTensor (vocab,)`` per token when sampling (``None`` for a deterministic statistical token),
        ``sources`` the level each token came from. A generator of the model levels' forwards."""
        tokens, q_rows, sources = [], [], []
        for j, count in enumerate(self.k[i], start=i + 1):
            count = min(count, limit - len(tokens))
            if count <= 0:
                continue
            new, q = yield from self.generate(state, j, ctx + tokens, count)
            tokens += new
            q_rows += q
            sources += [j] * len(new)
        return tokens, q_rows, sources

    def generate(self, state: State, j: int, ctx: list[int], n: int):
        """``n`` tokens from level ``j`` after ``ctx`` (speculative decoding at model levels) and their q rows. A
        generator of the model levels' forwards."""
        level = state.levels[j]
        if isinstance(level, StatLevel):
            return level.draft(ctx, n), [None] * n
        gen, q_rows = [], []
        while len(gen) < n:
            # A review yields up to len(proposal) + 1 tokens: propose one fewer than still needed.
            prop, pq, src = yield from self.propose_for(state, j, ctx + gen, n - len(gen) - 1)
            logits = yield from level.score(ctx + gen, prop, state.device)
            acc, nxt = self.review(state, logits, prop, pq)
            self.tally(state, j, src, acc)
            gen += prop[:acc] + [nxt]
            if not state.sampling.greedy:
                # Each emitted token is distributed as this level's own next-token distribution.
                q_rows += list(probs_from_logits(logits[: acc + 1], state.sampling))
        return gen, q_rows

    def review(self, state: State, logits, prop: list[int], q_rows: list) -> tuple[int, int]:
        """An inner review's accepted count and next token: lenient (greedy only) is top-k membership,
        strict is the shared verifier."""
        tokens = torch.tensor(prop, dtype=torch.long, device=logits.device)
        if state.lenience > 1:
            top = logits[: len(prop)].topk(state.lenience, dim=-1).indices  # (k, lenience)
            bad = (~(top == tokens[:, None]).any(-1)).nonzero()
            acc = int(bad[0]) if bad.numel() else len(prop)
            return acc, int(logits[acc].argmax())
        q = None if state.sampling.greedy else q_matrix(tokens, q_rows, logits.shape[-1])
        return verify_chain(tokens, q, logits, state.sampling, state.generator)

    def tally(self, state: State, reviewer: int, sources: list[int], accepted: int) -> None:
        for pos, j in enumerate(sources):
            key = f"{state.levels[j].name}>{state.levels[reviewer].name}"
            stat = state.reviews.setdefault(key, {"proposed": 0, "accepted": 0})
            stat["proposed"] += 1
            stat["accepted"] += pos < accepted

    # --------------------------------------------------------------------------------------- the loop

    def start(self, state: State) -> None:
        # Lenient inner reviews change what a level emits, so only greedy decoding may use them.
        state.lenience = self.cfg.lenience if state.sampling.greedy else 1
        state.index = NGramIndex(self.cfg.min_ngram, self.cfg.max_ngram)
        state.index.add_document(state.seq)
        drafts = [ModelLevel(d, state.own_cache(d)) for d in self.pair.drafts[:2]]
        state.levels = [TargetLevel(), *drafts, StatLevel(state.index, self.bigram)]
        state.reviews = {}

    def propose(self, state: State) -> Proposal:
        state.index.extend(state.seq[len(state.index):])
        tokens, q_rows, state.sources = yield from self.propose_for(state, 0, state.seq, state.draft_budget)
        q = None if state.sampling.greedy else q_matrix(torch.tensor(tokens, dtype=torch.long, device=state.device),
                                                      q_rows, self.pair.target.module.config.vocab_size)
        return Proposal.chain(state.seq[-1], tokens, q)

    def accepted(self, state: State, proposal: Proposal, path: list[int], hidden) -> None:
        self.tally(state, 0, state.sources, len(path) - 1)  # the target's review is always strict

    def extra(self, state: State) -> dict:
        for stat in state.reviews.values():
            stat["accept_rate"] = ratio(stat["accepted"], stat["proposed"])  # proposed tokens the reviewer kept
        stat_level = state.levels[-1]
        return {
            "levels": [lv.name for lv in state.levels],
            "k_matrix": self.k,
            "reviews": state.reviews,  # "<drafter>><reviewer>": tokens proposed / accepted / rate
            "stat_lookups": stat_level.lookups,  # statistical drafts asked for
            "stat_context_hit_rate": ratio(stat_level.context_hits, stat_level.lookups),  # found in the text itself
            "lenience": state.lenience,
        }
