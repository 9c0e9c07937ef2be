"""GliDe with CaPE (Du et al., ICML 2024, "GliDe with a CaPE: A Low-Hassle Method to Accelerate Speculative
Decoding"): a draft that glimpses the target's KV cache, and proposals expanded where the draft is unsure.

- GliDe (:mod:`methods.glide._draft`): the draft's blocks cross-attend to the target's cached keys and values
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
- ``weights``: the authors' published draft (:mod:`methods.glide._published`: a small Llama of its own, block i of
  n reading the target's layer L - n + i, all of the cache seen) instead of one trained here.

Greedy output equals ``ar``'s token for token either way.

Where CaPE here differs from the paper, and why:

- by default one threshold and a fixed number of extra candidates (``cape_threshold``, ``cape_k``); the authors'
  rule, candidates by the confidence's decile (their runs: 8 below 0.3 down to 2 above 0.8), is ``cape_bins``.
  The default 0.5 is this harness's choice, not a value from the paper: below it a calibrated draft's top-1 is
  more likely wrong than right, so that is where one more candidate, one more token for the target to score, is
  most likely to pay (measured, README: at ``full`` GliDe's draft is below it at 3.9 of 4 positions), while their
  bins add candidates at every position, sure or not (on a CPU a wider target forward is not free);
- as in the authors' code, siblings are leaves: the chain goes on under the top-1 token only, so the draft runs
  ``gamma`` forwards per step whatever CaPE adds.
"""

from __future__ import annotations

import torch
from pydantic import Field, PositiveInt, model_validator
from transformers import DynamicCache

from core.errors import BenchError
from core.model_parts import LEARNED_POSITIONS, decoder_layers, target_family
from core.static_cache import RowView
from core.swapped_embeddings import fed
from decoding.cache import truncate_cache
from decoding.sampling import draft_token
from decoding.tree import Tree
from methods.glide._draft import (
    CountedGlide,
    GlideDraft,
    GlideRecipe,
    decode_visible,
    glide_artifact,
    untrained_glide,
)
from methods.glide._published import load_published_glide, read_layers
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register
from training.kit import load_or_train, untrained_if_synthetic
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
    cape_bins: list[PositiveInt] | None = Field(
        None, min_length=11, description="CaPE by the authors' rule, in place of cape_threshold and cape_k: a "
        "position whose top-1 probability is p gets cape_bins[int(10 p)] candidates, its top-1 included; never "
        "more for a surer position (their runs: [8, 8, 8, 6, 6, 6, 4, 4, 2, 2, 2, 2]; all 1: no expansion)")
    recipe: GlideRecipe = Field(default_factory=GlideRecipe, description="how the draft is trained")
    weights: str | None = Field(None, description="the authors' published GliDe draft: a hub id or a local folder "
                                "in their layout (docs/published.md); null: the draft this harness trains (recipe)")

    @model_validator(mode="after")
    def bins_are_capes(self):
        if self.cape_bins is not None and not self.cape:
            raise ValueError("cape_bins is CaPE's rule; with cape=false nothing would read it")
        # Their code takes the top-k of the least sure position and cuts each position's from it: a surer position
        # never gets more.
        if self.cape_bins is not None and any(b > a for a, b in zip(self.cape_bins, self.cape_bins[1:])):
            raise ValueError(f"cape_bins {self.cape_bins} grows with the confidence; the authors' rule gives a surer "
                             "position no more candidates than a less sure one")
        return self

    @model_validator(mode="after")
    def gamma_within_block(self):
        # The block bounds what a trained draft has seen; the authors' draft reads all of the cache at inference.
        if self.weights is None and self.gamma > self.recipe.block:
            raise ValueError(f"gamma ({self.gamma}) must not exceed recipe.block ({self.recipe.block}): the draft is "
                             "trained to draft at most that many positions past the target's cache.")
        return self


@register("glide")
class Glide(DraftVerify):
    lossless = True  # every candidate is verified by the target: greedy output equals ar's
    hidden = False  # the draft reads the target's KV cache, not its hidden states
    batched_drafting = True  # its draft's forwards are yielded (read): one per step for a batch
    Config = GlideSettings

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.draft: CountedGlide | None = None
        self.report: dict = {}

    @classmethod
    def has_trained_parts(cls, pair_spec, settings=None) -> bool:
        return not getattr(settings, "weights", None)  # the draft, unless the authors' is read

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
        if getattr(settings, "weights", None):
            return
        block, seq_len = settings.recipe.block, recipe.store.seq_len
        if seq_len <= block:
            raise BenchError(f"method={cls.name} trains on blocks of method.recipe.block={block} positions, the first "
                             f"of which sees none of the target; recipe.store.seq_len={seq_len} must be longer.")

    def setup(self, train_if_missing: bool = True) -> None:
        target = self.pair.target.module
        self.published = bool(self.cfg.weights)
        if self.published:
            draft, self.report = load_published_glide(self.cfg.weights, target, self.pair.cache)
            draft.read_layers = read_layers(len(decoder_layers(target)), len(draft.cross))
        else:
            GlideDraft(target.config, torch.arange(1))  # a target it cannot glimpse is refused before any store work
            layer = kv_layer(target.config, self.cfg.recipe.layer, "method.recipe.layer")
            draft, self.report = untrained_if_synthetic(
                self.pair, lambda: untrained_glide(target.config, self.cfg.recipe),
                lambda: load_or_train(glide_artifact(target, self.pair.tokenizer, self.cfg.recipe, self.pair.teacher),
                                      self.pair.teacher.cache, train_if_missing))
            draft.read_layers = [layer] * len(draft.cross)  # every block reads layer L
        # draft.read_layers: the target layer each block reads, here and in a batch's forwards (core.compiled)
        self.draft = self.pair.add(CountedGlide(draft.to(device=self.pair.device, dtype=self.pair.dtype)))
        # The authors' draft embeds tokens with its own table; the harness's reads the target's embeddings.
        self.embed = self.draft.module.embed_tokens if self.published else target.get_input_embeddings()
        self.vocab_map = self.draft.module.vocab_map

    def batch_parts(self) -> list:
        return [self.draft]

    # ------------------------------------------------------------------------------------------- the loop

    class State(PromptState):
        """One prompt's drafting: the draft's KV cache, this step's top-1 chain, and per-step tallies for ``extra``."""

        dcache: DynamicCache | RowView  # the draft's own (in a batch, its row of the batch cache): a position per token read
        past: int  # this step's pending position
        chain_nodes: list[int]  # this step's tree nodes of the top-1 chain, the pending token's (0) first
        candidates: list[int]  # tokens proposed per step, the pending one not counted
        expanded: list[int]  # positions CaPE expanded per step

    def start(self, state: State) -> None:
        # setup() loads the trained part before the timed decode; never lazily inside it.
        assert self.draft is not None, "call setup() before decode()"
        state.dcache = state.own_cache(self.draft)
        state.track(state.dcache)
        state.past, state.chain_nodes = 0, [0]
        state.candidates = []
        state.expanded = []

    def read(self, state: State, tokens: list[int]):
        """Feed the draft ``tokens`` at the positions after its cache's, glimpsing the target's cache of the
        committed positions < p; returns the logits ``(V',)`` of the token after the last. A generator of that forward:
        in a batch it is yielded as a causal LM's (the embeddings swapped in, the target's cache seen as ``cross_seen``
        says), and the rows' run as one."""
        p = state.cache.get_seq_length()
        start = state.dcache.get_seq_length()
        positions = torch.arange(start, start + len(tokens), device=state.device)
        # Tokens read late (the prompt, a fully accepted draft's last token) see the target as training showed
        # them; the pending token and the drafted ones see all of the cache (None: no mask to build). The
        # authors' draft sees all of it whatever it reads, as their inference does.
        late = start < p and not self.published
        visible = decode_visible(positions, p, self.cfg.recipe.block) if late else None  # (n, p)
        emb = self.embed(torch.tensor([tokens], device=state.device))
        if isinstance(state.dcache, RowView):
            seen = visible if visible is not None else torch.ones(len(tokens), p, dtype=torch.bool)
            out = yield {"lm": self.draft, "cache": state.dcache, "logits_to_keep": 1, "cross_seen": seen.cpu(),
                         **fed(emb[0])}
            return out.logits[0, -1]
        # The committed positions only: a static cache (compile=true) holds more slots than it has filled.
        kvs = [(state.cache.layers[i].keys[..., :p, :], state.cache.layers[i].values[..., :p, :])
               for i in self.draft.module.read_layers]
        return self.draft(emb, positions, kvs, visible if visible is None else visible[None], state.dcache, rows=1)[0, -1]

    def propose(self, state: State) -> Proposal:
        k = min(self.cfg.gamma, state.draft_budget)
        state.past, state.chain_nodes = state.cache.get_seq_length(), [0]  # the pending token's position; its node
        if k <= 0:
            return Proposal(Tree(state.seq[-1]))
        # The committed tokens the draft has not read (after a fully accepted draft: its last), then the pending one.
        logits = yield from self.read(state, state.seq[state.dcache.get_seq_length() :])
        proposal = yield from (self.cape(state, logits, k) if self.cfg.cape else self.chain(state, logits, k))
        state.candidates.append(len(proposal.tree) - 1)
        return proposal

    def accepted(self, state: State, proposal: Proposal, path: list[int], hidden) -> None:
        if self.published:
            # The authors' loop rolls its draft back to the pending token and has it read that token and the
            # accepted ones again, now against the target's cache of them (SpecInfer's way, their comment says).
            truncate_cache(state.dcache, state.past)
            return
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

    def chain(self, state: State, logits: torch.Tensor, k: int):
        """``k`` tokens, one draft forward each after the first: greedy, or sampled from the draft's distribution
        (``q`` then holds it over the full vocabulary, zero outside the draft's). A generator of those forwards
        (:meth:`read`), returning the :class:`Proposal`."""
        tokens, qs = [], []
        vocab = self.pair.target.module.config.vocab_size
        for i in range(k):
            token, q = draft_token(logits, self.vocab_map, vocab, state.sampling, state.generator)
            tokens.append(int(token))
            qs += [q] if q is not None else []
            if i + 1 < k:
                logits = yield from self.read(state, tokens[-1:])
        state.chain_nodes = list(range(k + 1))  # a chain's nodes are its positions
        return Proposal.chain(state.seq[-1], tokens, torch.stack(qs) if qs else None)

    def width(self, confidence: float) -> int:
        """CaPE's candidates at a position whose top-1 probability is ``confidence``, its top-1 included."""
        if self.cfg.cape_bins is not None:
            return self.cfg.cape_bins[min(int(confidence * 10), 10)]
        return 1 + self.cfg.cape_k if confidence < self.cfg.cape_threshold else 1

    def cape(self, state: State, logits: torch.Tensor, k: int):
        """CaPE: the draft's top-1 chain of ``k`` tokens, and at each of its positions the draft's next-best tokens
        as siblings of that chain token, as many as :meth:`width` says for its confidence (deterministic candidates:
        q = None). A generator of the draft's forwards (:meth:`read`), returning the :class:`Proposal`."""
        tree, node, expanded = Tree(state.seq[-1]), 0, 0
        for i in range(k):
            probs = torch.softmax(logits.float(), -1)
            width = min(self.width(float(probs.max())), probs.shape[-1])
            ids = self.vocab_map[probs.topk(width).indices].tolist()
            child = tree.add_child(node, ids[0])
            for tok in ids[1:]:
                tree.add_child(node, tok)
            expanded += width > 1
            node = child
            state.chain_nodes.append(child)
            if i + 1 < k:
                logits = yield from self.read(state, ids[:1])
        state.expanded.append(expanded)
        return Proposal(tree)
