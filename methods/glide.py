"""GliDe with CaPE (Du et al., ICML 2024, "GliDe with a CaPE: A Low-Hassle Method to Accelerate Speculative
Decoding"): a draft that glimpses the target's KV cache, and proposals expanded where the draft is unsure.

- GliDe (:mod:`methods._glide_draft`): the draft's blocks cross-attend to the target's cached keys and values
  of one layer (the last by default). While decoding they are read straight from the target's KV cache,
  ``state.cache``, which after each commit holds exactly the committed tokens minus the pending one: the context
  the target verified. The draft keeps a KV cache of its own over what it has read (rolled back with the
  target's).
- CaPE (confidence-aware proposal expansion, ``cape: true``): the draft's top-1 chain of ``gamma`` tokens, and at
  each chain position whose top-1 probability (the draft's confidence) is below ``cape_threshold``, its next
  ``cape_k`` tokens as extra candidates (siblings: more children of the previous chain node). The chain goes on
  under the top-1 tokens only, so CaPE costs the draft nothing; the target scores every candidate in ONE
  forward under a tree mask and the shared lossless tree verifier keeps a path (candidates are deterministic:
  one-hot q, so sampled output follows the target's distribution too).
- Without CaPE: a chain of ``gamma`` tokens, greedy or sampled from the draft's distribution, verified by
  standard speculative sampling.

Greedy output equals ``ar``'s token for token either way.

Where CaPE here differs from the paper, and why:

- one threshold and a fixed number of extra candidates (``cape_threshold``, ``cape_k``), and the default 0.5 is
  this harness's choice, not a value from the paper: below it a calibrated draft's top-1 is more likely wrong
  than right, so that is where one more candidate, one more token for the target to score, is most likely to
  pay (measured, README: at ``full`` GliDe's draft is below it at 3.9 of 4 positions);
- siblings are leaves: the chain goes on under the top-1 token only, so the draft runs ``gamma`` forwards per
  step whatever CaPE adds, and the target scores at most ``gamma * (1 + cape_k)`` tokens (on a CPU a wider
  target forward is not free).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from transformers import DynamicCache

from core.errors import BenchError
from core.model_parts import LEARNED_POSITIONS, target_family
from decoding.cache import truncate_cache
from decoding.sampling import draft_token
from decoding.tree import Tree
from methods._glide_draft import (
    CountedGlide,
    GlideDraft,
    GlideRecipe,
    decode_visible,
    load_or_train_glide,
)
from methods.base import Draft, DraftVerify, MethodSettings, PromptState
from methods.registry import register
from training.kv_store import kv_layer


class GlideSettings(MethodSettings):
    """GliDe with CaPE's settings (``method.*``)."""

    gamma: int = Field(4, ge=1, description="tokens drafted per target call (the depth of the proposal)")
    cape: bool = Field(True, description="CaPE: add the draft's next-best tokens as candidates where it is unsure")
    cape_threshold: float = Field(0.5, ge=0, le=1, description="CaPE expands a draft position whose top-1 "
                                  "probability is below this (0.5: where the draft's own guess is more likely "
                                  "wrong than right)")
    cape_k: int = Field(1, ge=1, description="CaPE: extra candidates per expanded position (each one more token "
                        "the target scores)")
    recipe: GlideRecipe = Field(default_factory=GlideRecipe, description="how the draft is trained")

    @model_validator(mode="after")
    def gamma_within_block(self):
        if self.gamma > self.recipe.block:
            raise ValueError(f"gamma ({self.gamma}) must not exceed recipe.block ({self.recipe.block}): the draft is "
                             "trained to draft at most that many positions past the target's cache.")
        return self


@register("glide")
class Glide(DraftVerify):
    lossless = True  # every candidate is verified by the target: greedy output equals ar's
    hidden = False  # the draft reads the target's KV cache, not its hidden states
    Config = GlideSettings

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.draft: CountedGlide | None = None
        self.report: dict = {}

    @classmethod
    def trains(cls, pair_spec, settings=None) -> bool:
        return True  # the draft

    @classmethod
    def check_pair(cls, settings, pair) -> None:
        """GliDe's draft rotates its queries as the target rotates its cached keys: a target with learned
        absolute positions (GPT-2) has no rotation to share, and is refused before any model loads."""
        super().check_pair(settings, pair)
        family = target_family(pair)
        if family in LEARNED_POSITIONS:
            raise BenchError(f"method={cls.name} needs a target with rotary attention (Llama, Qwen2, Mistral, Gemma): "
                             f"its draft rotates its queries to meet the target's rotated keys, and pair={pair.name}'s "
                             f"target is {family}, whose keys carry learned absolute positions instead.")

    @classmethod
    def check_recipe(cls, settings, recipe) -> None:
        block, seq_len = settings.recipe.block, recipe.store.seq_len
        if seq_len <= block:
            raise BenchError(f"method={cls.name} trains on blocks of method.recipe.block={block} positions, the first "
                             f"of which sees none of the target; recipe.store.seq_len={seq_len} must be longer.")

    def setup(self, train_if_missing: bool = True) -> None:
        target = self.pair.target.module
        self.layer = kv_layer(target.config, self.cfg.recipe.layer, "method.recipe.layer")
        GlideDraft(target.config, torch.arange(1))  # a target it cannot glimpse is refused before any store work
        draft, self.report = load_or_train_glide(target, self.pair.tokenizer, self.cfg.recipe, self.pair.teacher,
                                                 train_if_missing)
        self.draft = self.pair.add(CountedGlide(draft.to(device=self.pair.device, dtype=self.pair.dtype)))
        self.embed = target.get_input_embeddings()
        self.vocab_map = self.draft.module.vocab_map

    # ------------------------------------------------------------------------------------------- the loop

    class State(PromptState):
        """One prompt's drafting: the draft's KV cache, this step's top-1 chain, and per-step tallies for ``extra``."""

        dcache: DynamicCache  # the draft's own: one entry per position it has read
        past: int  # this step's pending position
        chain_nodes: list[int]  # this step's tree nodes of the top-1 chain, the pending token's (0) first
        candidates: list[int]  # tokens proposed per step, the pending one not counted
        expanded: list[int]  # positions CaPE expanded per step

    def start(self, state: State) -> None:
        # setup() loads the trained part before the timed decode; never lazily inside it.
        assert self.draft is not None, "call setup() before decode()"
        state.dcache = DynamicCache()
        state.track(state.dcache)
        state.past, state.chain_nodes = 0, [0]
        state.candidates = []
        state.expanded = []

    def read(self, state: State, tokens: list[int]) -> torch.Tensor:
        """Feed the draft ``tokens`` at the positions after its cache's, glimpsing the target's cache of the
        committed positions < p; returns the logits ``(V',)`` of the token after the last."""
        p = state.cache.get_seq_length()
        cached = state.cache.layers[self.layer]
        start = state.dcache.get_seq_length()
        positions = torch.arange(start, start + len(tokens), device=state.device)
        # Tokens read late (the prompt, a fully accepted draft's last token) see the target as training showed
        # them; the pending token and the drafted ones see all of the cache (None: no mask to build).
        visible = decode_visible(positions, p, self.cfg.recipe.block)[None] if start < p else None
        emb = self.embed(torch.tensor([tokens], device=state.device))
        return self.draft(emb, positions, cached.keys, cached.values, visible, state.dcache, rows=1)[0, -1]

    def propose(self, state: State) -> Draft:
        k = min(self.cfg.gamma, state.draft_budget)
        state.past, state.chain_nodes = state.cache.get_seq_length(), [0]  # the pending token's position; its node
        if k <= 0:
            return Draft(Tree(state.seq[-1]))
        # The committed tokens the draft has not read (after a fully accepted draft: its last), then the pending one.
        logits = self.read(state, state.seq[state.dcache.get_seq_length() :])
        draft = self.cape(state, logits, k) if self.cfg.cape else self.chain(state, logits, k)
        state.candidates.append(len(draft.tree) - 1)
        return draft

    def accepted(self, state: State, draft: Draft, path: list[int], hidden) -> None:
        # The draft read the pending token and its chain at positions past, past + 1, ...; a path that left the
        # chain at a CaPE sibling keeps only the entries before it (the commit dropped those past the text).
        on_chain = next((i for i, (v, c) in enumerate(zip(path, state.chain_nodes)) if v != c), len(path))
        truncate_cache(state.dcache, state.past + on_chain)

    def extra(self, state: State) -> dict:
        calls = len(state.candidates)
        return {"cape": self.cfg.cape,
                # Tokens proposed per target call (the pending one not counted), and positions CaPE expanded.
                "candidates_per_call": sum(state.candidates) / calls if calls else float("nan"),
                "expanded_per_call": sum(state.expanded) / calls if calls and self.cfg.cape else float("nan")}

    # ------------------------------------------------------------------------------------------- drafting

    def chain(self, state: State, logits: torch.Tensor, k: int) -> Draft:
        """``k`` tokens, one draft forward each after the first: greedy, or sampled from the draft's distribution
        (``q`` then holds it over the full vocabulary, zero outside the draft's)."""
        tokens, qs = [], []
        vocab = self.pair.target.module.config.vocab_size
        for i in range(k):
            token, q = draft_token(logits, self.vocab_map, vocab, state.sampling, state.generator)
            tokens.append(int(token))
            qs += [q] if q is not None else []
            if i + 1 < k:
                logits = self.read(state, tokens[-1:])
        state.chain_nodes = list(range(k + 1))  # a chain's nodes are its positions
        return Draft.chain(state.seq[-1], tokens, torch.stack(qs) if qs else None)

    def cape(self, state: State, logits: torch.Tensor, k: int) -> Draft:
        """CaPE: the draft's top-1 chain of ``k`` tokens; where its top-1 probability is below ``cape_threshold``,
        its next ``cape_k`` tokens too, as siblings of that chain token (deterministic candidates: q = None)."""
        tree, node, expanded = Tree(state.seq[-1]), 0, 0
        width = min(1 + self.cfg.cape_k, logits.shape[-1])
        for i in range(k):
            top = torch.softmax(logits.float(), -1).topk(width)
            ids = self.vocab_map[top.indices].tolist()
            child = tree.add_child(node, ids[0])
            if float(top.values[0]) < self.cfg.cape_threshold:
                for tok in ids[1:]:
                    tree.add_child(node, tok)
                expanded += 1
            node = child
            state.chain_nodes.append(child)
            if i + 1 < k:
                logits = self.read(state, ids[:1])
        state.expanded.append(expanded)
        return Draft(tree)
