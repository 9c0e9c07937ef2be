"""EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees") over
EAGLE's feature-level draft (:mod:`methods.eagle._draft`).

Each step the draft first reads the target's features of the positions committed since the last step (their
true values, from the verification forward: the guessed ones are dropped with the rejected proposal), then
drafts from its own guesses:

- ``draft: tree`` (EAGLE-2's dynamic draft tree): the ``top_k`` best tokens after the pending one open the
  tree; at each further depth the ``top_k`` nodes of the newest level with the highest *cumulative* draft
  log-probability (the paper's global acceptance estimate) are expanded, all in one draft forward under a tree
  attention mask, ``top_k`` children each; finally every drafted node is reranked by that value and the
  best ``total_tokens - 1`` kept (a child never ranks above its parent, so they form a tree), and the target
  scores them in ONE forward (:mod:`decoding.tree`). Candidates are the draft's top-k, deterministic, so
  verification is the shared lossless tree verifier with one-hot q: greedy output equals ``ar``, sampled
  output follows the target's distribution.
- ``draft: chain``: ``gamma`` tokens, one per draft forward, greedy or sampled from the draft's distribution
  and verified by standard speculative sampling (for a CPU, where scoring many tokens at once is not free).

The paper's tree (total_tokens 60, depth 6, top_k 10 on a GPU) costs the target r(60) one-token forwards on
this CPU; the defaults here are a small tree (README: measured).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, NonNegativeInt, model_validator
from transformers import DynamicCache

from core.errors import BenchError
from core.static_cache import RowView
from core.swapped_embeddings import fed
from decoding.cache import truncate_cache
from decoding.sampling import draft_token
from decoding.tree import Tree, additive_mask
from methods.eagle._draft import CountedEagle, EagleRecipe, eagle_artifact, untrained_eagle
from methods.eagle._published import load_published_eagle
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register
from training.kit import check_store_keeps_hidden, load_or_train, untrained_if_synthetic

# EAGLE-1's published static tree (its authors' ``choices.py``, named mc_sim_7b_63 there like Medusa's other
# tree): 25 rank paths + the root, depth 5.
EAGLE1_TREE = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0],
               [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0],
               [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
STATIC_TREES = {"eagle1": EAGLE1_TREE}


class EagleSettings(MethodSettings):
    """EAGLE-2's settings (``method.*``)."""

    draft: Literal["tree", "chain", "static"] = Field("tree", description="tree: EAGLE-2's dynamic draft tree; "
                                                      "chain: gamma tokens, no tree; static: EAGLE-1's static tree "
                                                      "(static_tree)")
    total_tokens: int = Field(6, ge=2, description="tree: tokens the target scores per call, the pending one "
                              "included (the paper: 60 on a GPU)")
    depth: int = Field(4, ge=1, description="tree: the deepest draft token (the paper: 6)")
    top_k: int = Field(4, ge=1, description="tree: nodes expanded per depth and children per node (the paper: 10)")
    gamma: int = Field(3, ge=1, description="chain: tokens drafted per target call")
    static_tree: str | list[list[NonNegativeInt]] = Field(
        "eagle1", min_length=1, description="static: the tree as rank paths ([r1, ..., rd] = the r_d-th best draft "
        "token under the path [r1 .. r_{d-1}]; every prefix listed), or eagle1: EAGLE-1's published 26-token tree")
    recipe: EagleRecipe = Field(default_factory=EagleRecipe, description="how the draft layer is trained")
    weights: str | None = Field(None, description="the authors' published draft layer (EAGLE-1/2): a hub id or a "
                                "local folder in their layout (docs/published.md); null: the layer this harness "
                                "trains (recipe)")


    @model_validator(mode="after")
    def known_static_tree(self):
        if isinstance(self.static_tree, str) and self.static_tree not in STATIC_TREES:
            raise ValueError(f"static_tree '{self.static_tree}' is not a known tree ({', '.join(STATIC_TREES)}); give "
                             "rank paths for another")
        try:
            Tree.from_paths(self.static_paths)
        except BenchError as err:
            raise ValueError(str(err)) from None
        return self

    @property
    def static_paths(self) -> list[list[int]]:
        return STATIC_TREES[self.static_tree] if isinstance(self.static_tree, str) else self.static_tree


@register("eagle")
class Eagle(DraftVerify):
    lossless = True
    hidden = True  # the draft reads the target's features
    batched_drafting = True  # its draft layer's forwards are yielded (draft_forward): one per step for a batch
    Config = EagleSettings

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.draft: CountedEagle | None = None
        self.report: dict = {}
        self.static = Tree.from_paths(self.cfg.static_paths)  # draft: static's shape

    @classmethod
    def has_trained_parts(cls, pair_spec, settings=None) -> bool:
        return not getattr(settings, "weights", None)  # the draft layer, unless the authors' is read

    @classmethod
    def check_recipe(cls, settings, recipe) -> None:
        if not getattr(settings, "weights", None):
            check_store_keeps_hidden(cls.name, recipe)

    def setup(self, train_if_missing: bool = True) -> None:
        target = self.pair.target.module
        if getattr(self.cfg, "weights", None):
            draft, self.report = load_published_eagle(self.cfg.weights, target, self.pair.cache)
        else:
            draft, self.report = untrained_if_synthetic(
                self.pair, lambda: untrained_eagle(target.config, self.cfg.recipe),
                lambda: load_or_train(eagle_artifact(target, self.pair.tokenizer, self.cfg.recipe, self.pair.teacher,
                                                     self.name), self.pair.teacher.cache, train_if_missing))
        self.draft = self.pair.add(CountedEagle(draft.to(device=self.pair.device, dtype=self.pair.dtype)))
        # The authors' layer carries its own copy of the token embedding; the harness's reads the target's.
        own = self.draft.module.embed
        self.embed = own if own is not None else target.get_input_embeddings()
        self.vocab_map = self.draft.module.vocab_map

    def batch_parts(self) -> list:
        return [self.draft]

    # ------------------------------------------------------------------------------------------- the loop

    class State(PromptState):
        """One prompt's drafting: the draft layer's KV cache, the target's features it has yet to read, tree sizes."""

        dcache: DynamicCache | RowView  # the draft layer's (in a batch, its row of the batch cache): the committed
        # positions it has read, then this step's guesses
        todo: torch.Tensor  # (n, H) the target's features the draft has not read yet
        read: int  # the committed positions whose true features the draft's cache holds
        nodes: list[int]  # tokens the target scored per step, the pending one included

    def start(self, state: State) -> None:
        # setup() loads the trained part before the timed decode; never lazily inside it.
        assert self.draft is not None, "call setup() before decode()"
        state.dcache = state.own_cache(self.draft)  # in a batch, its row of the draft's batch cache
        state.todo = state.prompt_hidden
        state.read = 0
        state.nodes = []

    def draft_forward(self, state: State, feats: torch.Tensor, emb: torch.Tensor, rows: int, **kwargs):
        """The draft layer over ``feats`` and ``emb`` ``(n, H)`` on the prompt's draft cache (``kwargs``: a tree's
        ``attention_mask`` and ``position_ids``): the guessed features ``(n, H)`` and the logits ``(rows, V')`` of the
        last ``rows``. A generator of that forward: in a batch it is yielded as a causal LM's (its input ``fc``'s
        fused features in place of token embeddings), and the rows' run as one."""
        if isinstance(state.dcache, RowView):
            fused = self.draft.fused(feats.to(self.pair.dtype), emb)
            out = yield {"lm": self.draft, "cache": state.dcache, "logits_to_keep": rows, "output_hidden_states": True,
                         **fed(fused), **kwargs}
            return out.hidden_states[-1][0], out.logits[0]
        out, logits = self.draft(feats[None].to(self.pair.dtype), emb[None], state.dcache, rows=rows, **kwargs)
        return out[0], logits[0]

    def read_committed(self, state: State):
        """Feed the draft the features it has not read (positions ``read .. len(seq) - 2``, each with the
        token after it), after dropping its guesses of the last step. Returns the guessed feature at the
        pending token's position ``(H,)`` and the logits ``(V',)`` of the first draft token (a generator of its
        forward, as :meth:`draft_forward`)."""
        read = len(state.seq) - 1 - len(state.todo)
        truncate_cache(state.dcache, read)
        tokens = torch.tensor(state.seq[read + 1 :], device=state.device)
        out, logits = yield from self.draft_forward(state, state.todo, self.embed(tokens), rows=1)
        state.todo, state.read = state.todo[:0], len(state.seq) - 1  # the cache's true entries; guesses follow them
        return out[-1], logits[-1]

    def propose(self, state: State):
        deepest = {"chain": self.cfg.gamma, "tree": self.cfg.depth, "static": self.static.max_depth}[self.cfg.draft]
        depth = min(deepest, state.draft_budget)
        if depth <= 0:
            return Proposal(Tree(state.seq[-1]))
        feat, logits = yield from self.read_committed(state)
        draft = {"chain": self.chain, "static": self.fill_static, "tree": self.tree}[self.cfg.draft]
        proposal = yield from draft(state, feat, logits, depth)
        state.nodes.append(len(proposal.tree))
        return proposal

    def accepted(self, state: State, proposal: Proposal, path: list[int], hidden: torch.Tensor) -> None:
        if not state.done:  # the true features of the root and the accepted nodes: read at the next step
            state.todo = torch.cat([state.todo, hidden])

    def extra(self, state: State) -> dict:
        return {"draft": self.cfg.draft,
                "tree_tokens_per_call": sum(state.nodes) / len(state.nodes) if state.nodes else float("nan")}

    # ------------------------------------------------------------------------------------------- drafting

    def chain(self, state: State, feat: torch.Tensor, logits: torch.Tensor, k: int):
        """``k`` tokens, one draft forward each after the first: greedy, or sampled from the draft's
        distribution (``q`` then holds it over the full vocabulary, zero outside the draft's)."""
        tokens, qs = [], []
        vocab = self.pair.target.module.config.vocab_size
        for i in range(k):
            token, q = draft_token(logits, self.vocab_map, vocab, state.sampling, state.generator)
            tokens.append(token)
            qs += [q] if q is not None else []
            if i + 1 < k:  # the draft reads its own guess and its token: a plain causal step
                out, logits = yield from self.draft_forward(state, feat[None], self.embed(tokens[-1])[None], rows=1)
                feat, logits = out[-1], logits[-1]
        return Proposal.chain(state.seq[-1], torch.stack(tokens), torch.stack(qs) if qs else None)

    def expand(self, state: State, tree: Tree, nodes: list[int], guessed: dict, fed: list[int]):
        """One draft forward over tree ``nodes`` (each reads its parent's guessed feature and its own token, under
        a tree mask over the committed positions and the nodes ``fed`` before); records their guessed features
        in ``guessed`` and appends them to ``fed``. Returns their next-token logits ``(len(nodes), V')`` (a generator of
        the forward, as :meth:`draft_forward`)."""
        read = state.read  # the committed positions in the draft cache; the root's input is the last of them
        mask = additive_mask(tree.ancestry()[nodes][:, fed + nodes], read, self.pair.dtype, state.device)
        positions = torch.tensor([[read - 1 + tree.depth[v] for v in nodes]], device=state.device)
        feats = torch.stack([guessed[tree.parent[v]] for v in nodes])
        tokens = torch.tensor([tree.tokens[v] for v in nodes], device=state.device)
        out, logits = yield from self.draft_forward(state, feats, self.embed(tokens), rows=len(nodes),
                                                    attention_mask=mask, position_ids=positions)
        fed += nodes
        guessed.update(zip(nodes, out))
        return logits

    def fill_static(self, state: State, feat: torch.Tensor, logits: torch.Tensor, depth: int):
        """EAGLE-1's static tree (``static_tree``'s rank paths, ``depth`` deep at most) filled depth by depth, one
        draft forward per depth over the nodes that have children (node [r1 .. rd] holds the r_d-th best draft
        token after [r1 .. r_{d-1}])."""
        tree, node_of = Tree(state.seq[-1]), {(): 0}
        guessed, fed = {0: feat}, []
        sub = {0: logits}  # the draft's next-token logits at each node that has children
        for d in range(1, depth + 1):
            paths = [tuple(p) for p in self.static.paths if len(p) == d]
            parents = sorted({node_of[p[:-1]] for p in paths})
            if d > 1:
                sub.update(zip(parents, (yield from self.expand(state, tree, parents, guessed, fed))))
            width = max(p[-1] for p in paths) + 1
            top = {v: self.vocab_map[sub[v].topk(width).indices].tolist() for v in parents}
            for p in paths:
                parent = node_of[p[:-1]]
                node_of[p] = tree.add_child(parent, top[parent][p[-1]], merge=False)
        return Proposal(tree)

    def tree(self, state: State, feat: torch.Tensor, logits: torch.Tensor, depth: int):
        """EAGLE-2's expand-and-rerank, ``depth`` levels deep at most (see the module doc). :meth:`chain`,
        :meth:`fill_static` and this are generators of the draft's forwards that return the proposal."""
        k = min(self.cfg.top_k, logits.shape[-1])
        tree = Tree(state.seq[-1])
        score = [0.0]  # cumulative draft log-probability of each node's path
        guessed = {0: feat}  # the draft's guessed feature at each expanded node
        level = self.grow(tree, score, [0], torch.log_softmax(logits.float(), -1)[None], k)
        fed: list[int] = []  # tree nodes in the draft cache after the committed positions, in order
        for _ in range(depth - 1):
            expand = sorted(level, key=lambda v: -score[v])[:k]
            sub_logits = yield from self.expand(state, tree, expand, guessed, fed)
            level = self.grow(tree, score, expand, torch.log_softmax(sub_logits.float(), -1), k)
        # Rerank: the best total_tokens - 1 nodes by cumulative log-probability; ties go to the earlier node,
        # so a parent (never below its child) always comes first and the kept nodes form a tree.
        best = sorted(range(1, len(tree)), key=lambda v: (-score[v], v))[: self.cfg.total_tokens - 1]
        out_tree, new = Tree(state.seq[-1]), {0: 0}
        for v in sorted(best):
            new[v] = out_tree.add_child(new[tree.parent[v]], tree.tokens[v], merge=False)
        return Proposal(out_tree)

    def grow(self, tree: Tree, score: list[float], parents: list[int], logp: torch.Tensor, k: int) -> list[int]:
        """Add the ``k`` most likely children of each of ``parents`` (``logp (P, V')``); returns the new nodes."""
        top = logp.topk(k, dim=-1)
        ids = self.vocab_map[top.indices].tolist()
        values = top.values.tolist()
        level = []
        for row, parent in enumerate(parents):
            for tok, lp in zip(ids[row], values[row]):
                level.append(tree.add_child(parent, tok, merge=False))
                score.append(score[parent] + lp)
        return level
