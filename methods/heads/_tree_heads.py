"""The loop Medusa and Hydra share: heads propose a tree, the target verifies it in ONE forward.

Each step the heads read the target's last hidden state at the last committed position and fill the
method's candidate tree shape (:class:`decoding.tree.Tree` from rank paths) rooted at the pending token; the
shared loop (:class:`methods.base.DraftVerify`) scores every node under a tree attention mask, keeps the
accepted path's KV entries, and the hidden state of the path's last node feeds the next step's heads. With
``recipe.prefix_layer`` (Hydra++) the path's hidden states go through the prefix layer first
(:meth:`TreeHeadsMethod.heads_input`), which keeps a KV cache of its own over the committed positions; it is
the counted role ``prefix``; Amphista's staged adaptation layers (``methods/heads/amphista.py``) take its place and
also read the token after each position. Either way the target runs once per step.

- Greedy: the longest path of the target's own argmax choices: equal to ``ar`` token for token.
- Sampling: recursive rejection sampling over each node's children (:func:`decoding.verify.verify_tree`;
  the candidates are a head's top-k, deterministic, so one-hot q): distributed exactly as the target's.
- ``typical: true`` with ``temperature > 0``: Medusa's typical acceptance (:func:`typical_path`) instead --
  LOSSY (:meth:`~TreeHeadsMethod.is_lossless` says so, and records carry ``extra.typical``). At temperature 0
  typical acceptance is the greedy rule, and lossless.

Subclasses (``methods/heads/medusa.py``, ``methods/heads/hydra.py``, ``methods/heads/amphista.py``) set ``kind`` and implement
:meth:`fill`.
"""

from __future__ import annotations

import torch
from pydantic import Field, NonNegativeInt, model_validator
from transformers import DynamicCache

from core.errors import BenchError
from core.static_cache import RowView
from core.swapped_embeddings import fed
from decoding.sampling import Sampling, probs_from_logits, sample
from decoding.tree import Tree
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal, forwards_of
from methods.heads._heads import KINDS, CountedHeads, CountedPrefix, HeadsRecipe
from methods.heads._published import load_published_heads
from methods.heads._train import heads_artifact, untrained_heads
from training.kit import check_store_keeps_hidden, load_or_train, untrained_if_synthetic

# Medusa's default sparse tree shape, as rank paths: 19 candidates + the root = 20 tokens scored per target
# call, depth 4.
DEFAULT_TREE = [[0], [1], [2], [3],
                [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0],
                [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 2],
                [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0]]

# Medusa's published tree ``mc_sim_7b_63`` (the authors' ``medusa_choices.py``; Hydra's and Spec-Bench's runs of
# both use it too): 63 rank paths + the root = 64 tokens per target call, depth 4, for Vicuna-7B on a GPU.
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1],
    [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0],
    [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6],
    [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1],
    [1, 6], [0, 7, 0]]
TREES = {"default": DEFAULT_TREE, "mc_sim_7b_63": MC_SIM_7B_63}


class TreeHeadsSettings(MethodSettings):
    """Settings of Medusa, Hydra and Hydra++ (``method.*``)."""

    tree: str | list[list[NonNegativeInt]] = Field(
        default_factory=lambda: [list(p) for p in DEFAULT_TREE], min_length=1,
        description="candidate tree as rank paths: [r1, ..., rd] = the r_d-th best proposal of head d-1 under "
        "the path [r1 .. r_{d-1}]; the root (the target's own next token) is implicit; every path's prefix "
        "must be listed too; or a name: mc_sim_7b_63 (the papers' 64-token GPU tree), default (20 tokens)")
    typical: bool = Field(False, description="Medusa's typical acceptance when temperature > 0: LOSSY "
                          "(records say so)")
    posterior_threshold: float = Field(0.09, gt=0, le=1, description="typical acceptance: epsilon, a hard floor "
                                       "on p_target(candidate)")
    posterior_alpha: float = Field(0.3, gt=0, le=1, description="typical acceptance: delta, scales "
                                   "exp(-entropy of the target's distribution)")
    recipe: HeadsRecipe = Field(default_factory=HeadsRecipe, description="how the heads are trained")

    @property
    def paths(self) -> list[list[int]]:
        """The tree's rank paths (a name looked up in :data:`TREES`)."""
        return TREES[self.tree] if isinstance(self.tree, str) else self.tree

    @model_validator(mode="after")
    def tree_fits_heads(self):
        """A known name, every path's prefix listed, and the tree no deeper than there are heads (published
        heads: checked against the file when it is read)."""
        if isinstance(self.tree, str) and self.tree not in TREES:
            raise ValueError(f"tree '{self.tree}' is not a known tree ({', '.join(TREES)}); give rank paths or one of "
                             "those names.")
        try:
            depth = Tree.from_paths(self.paths).max_depth
        except BenchError as err:
            raise ValueError(str(err)) from None
        if depth > self.recipe.num_heads and not getattr(self, "weights", None):
            raise ValueError(f"tree is {depth} deep but there are only {self.recipe.num_heads} heads "
                             "(recipe.num_heads).")
        return self


class PublishedHeadsSettings(TreeHeadsSettings):
    """Settings of the heads methods whose authors published weights (Medusa, Hydra, Hydra++)."""

    weights: str | None = Field(None, description="the authors' published heads: a hub id or a local folder in "
                                "their layout (docs/published.md); null: the heads this harness trains (recipe)")


def typical_path(tree: Tree, logits: torch.Tensor, sampling: Sampling, generator, threshold: float,
                 alpha: float) -> tuple[list[int], int]:
    """Medusa's typical acceptance (Cai et al. 2024, Sec. 2.3.1) -- LOSSY: node x after parent p stands when
    ``p_target(x | p) > min(threshold, alpha * exp(-H(p_target(. | p))))``; the deepest node whose whole
    path stands wins -- among equally deep ones, the path the target finds most likely (the sum of its tokens'
    log-probabilities, as the authors' ``evaluate_posterior`` breaks ties) -- and the next token is sampled from
    the target at that node."""
    probs = probs_from_logits(logits, sampling)  # (n, vocab)
    entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1)  # (n,)
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    parent = torch.tensor(tree.parent[1:], device=logits.device)
    tokens = torch.tensor(tree.tokens[1:], device=logits.device)
    p_node = probs[parent, tokens].cpu()  # (n - 1,): p_target(node's token | its parent)
    ok = torch.ones(len(tree), dtype=torch.bool)
    ok[1:] = p_node > bar[parent].cpu()
    ancestry = tree.ancestry()  # (n, n): [i, j] when j is on the path to i
    ok_path = (~ancestry | ok[None, :]).all(-1)  # every node on the path stands
    depth = torch.where(ok_path, torch.tensor(tree.depth), -1)
    logp = torch.zeros(len(tree))
    logp[1:] = p_node.clamp_min(1e-20).log()
    path_logp = ancestry.float() @ logp  # (n,): log-likelihood of the path to each node
    deepest = depth == depth.max()
    best = int(torch.where(deepest, path_logp, float("-inf")).argmax())
    return tree.path_to(best), int(sample(probs[best], generator))


class TreeHeadsMethod(DraftVerify):
    kind = "?"
    Config = TreeHeadsSettings
    hidden = True  # the heads read the target's last hidden states
    # A batch stacks every row's heads call into one, and runs the prefix layer's forwards (Hydra++) as one.
    batched_drafting = True

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.shape = Tree.from_paths(self.cfg.paths)
        self.shapes = {d: self.shape.prune(d) for d in range(self.shape.max_depth + 1)}  # pruned near the budget
        self.report: dict = {}
        self.heads: CountedHeads | None = None
        self.prefix: CountedPrefix | None = None

    @classmethod
    def has_trained_parts(cls, pair_spec, settings=None) -> bool:
        return not getattr(settings, "weights", None)  # the heads, unless the authors' are read

    @classmethod
    def check_recipe(cls, settings, recipe) -> None:
        if getattr(settings, "weights", None):
            return  # published heads: nothing is trained, the store is never read
        check_store_keeps_hidden(cls.name, recipe)
        K = settings.recipe.num_heads
        if recipe.store.seq_len <= K + 1:
            raise BenchError(f"recipe.store.seq_len ({recipe.store.seq_len}) must exceed method.recipe.num_heads + 1 "
                             f"({K + 1}): head k learns from the token k + 2 positions ahead.")

    def is_lossless(self, sampling) -> bool:
        # Typical acceptance keeps tokens the target would not have sampled; at temperature 0 it is the greedy rule.
        return not (self.cfg.typical and not sampling.greedy)

    def setup(self, train_if_missing: bool = True) -> None:
        if self.kind not in KINDS:
            raise BenchError(f"unknown heads kind '{self.kind}'; use one of {', '.join(KINDS)}.")
        target = self.pair.target.module
        if getattr(self.cfg, "weights", None):
            heads, prefix, self.report = load_published_heads(self.kind, self.name, self.cfg.weights, target,
                                                              self.pair.spec.target.get("id"), self.pair.cache)
            if heads.num_heads < self.shape.max_depth:
                raise BenchError(f"method.tree is {self.shape.max_depth} deep but {self.cfg.weights} holds "
                                 f"{heads.num_heads} heads; use a shallower tree.")
        else:
            (heads, prefix), self.report = untrained_if_synthetic(
                self.pair, lambda: untrained_heads(target.config, self.kind, self.cfg.recipe),
                lambda: load_or_train(heads_artifact(target, self.pair.tokenizer, self.kind, self.cfg.recipe,
                                                     self.pair.teacher, self.name), self.pair.teacher.cache,
                                      train_if_missing))
        if heads.num_heads < self.shape.max_depth or heads.blocks[0].linear.out_features != target.config.hidden_size:
            raise BenchError(f"the cached {self.kind} heads do not fit this target and tree; delete them to retrain.")
        self.add_roles(heads.to(device=self.pair.device, dtype=self.pair.dtype),
                       prefix.to(device=self.pair.device, dtype=self.pair.dtype) if prefix is not None else None)
        self.embed = target.get_input_embeddings()

    def add_roles(self, heads, prefix) -> None:
        """Register the trained parts as roles, so the harness counts their calls and FLOPs like any model's."""
        self.heads = self.pair.add(CountedHeads(heads, "heads"))
        if prefix is not None:
            self.prefix = self.pair.add(CountedPrefix(prefix, "prefix"))

    def batch_parts(self) -> list:
        return [self.prefix] if self.prefix is not None else []

    def new_memory(self, state: PromptState):
        """The caches of whatever the heads' input runs over the committed positions, fresh for ``state``'s decode:
        the prefix layer's KV cache (in a batch, its row of the layer's batch cache; ``None`` without one)."""
        return state.own_cache(self.prefix) if self.prefix is not None else None

    def heads_input(self, hiddens: torch.Tensor, next_ids: list[int], memory):
        """What the heads read once the target has committed more positions.

        Args:
            hiddens: ``(n, hidden)`` the target's last hidden states at the n positions committed since the
                last call, in order: the prompt after the prefill, the accepted path (root first) after a step.
            next_ids: the n tokens after those positions (the last is the pending token).
            memory: :meth:`new_memory`'s caches for this decode; extended by these n positions, so no position
                is ever fed twice.
        Returns:
            ``(hidden,)``: the target's hidden state at the last committed position, or the prefix layer's
            output there (a generator of its forward: in a batch it is yielded as a causal LM's, the hidden states
            swapped in for token embeddings, and the rows' run as one).
        """
        if self.prefix is None:
            return hiddens[-1]
        if not isinstance(memory, RowView):
            return self.prefix(hiddens.unsqueeze(0), memory)[0, -1]
        out = yield {"lm": self.prefix, "cache": memory, "logits_to_keep": 1, **fed(hiddens)}
        return self.prefix.module.combine(hiddens[-1], out.logits[0, -1])

    def fill(self, hidden: torch.Tensor, pending: int, shape: Tree):
        """``shape`` with its tokens proposed by the heads: a generator of the heads' calls (``{"lm": self.heads,
        "args": (inputs,)}``, each input with its items along dim 0; a batch stacks every row's into one call,
        ``core.counting.CountedModule.forward_rows``), returning the tree.

        Args:
            hidden: the heads' input at the last committed position (:meth:`heads_input`): ``(hidden,)``, or
                Amphista's ``(stages, hidden)``.
            pending: the target's token after it (the root).
        """
        raise NotImplementedError

    class State(PromptState):
        """One prompt's heads: what they read next, the prefix or adaptation layers' caches, and the tree sizes."""

        memory: DynamicCache | RowView | list[DynamicCache | RowView] | None  # new_memory()'s, extended by heads_input
        unread: torch.Tensor | None  # (n, hidden) the target's hidden states heads_input has not read yet
        input: torch.Tensor  # heads_input's output at the last committed position: what fill reads
        typical: bool  # Medusa's typical acceptance verifies this prompt (sampling with typical: true)
        nodes: list[int]  # tokens the target scored at each call

    def start(self, state: State) -> None:
        # setup() loads the trained part before the timed decode; never lazily inside it.
        assert self.heads is not None, "call setup() before decode()"
        state.memory = self.new_memory(state)
        state.unread = state.prompt_hidden  # fed to heads_input at the first proposal, once the pending token is known
        state.typical = self.cfg.typical and not state.sampling.greedy
        state.nodes = []

    def propose(self, state: State) -> Proposal:
        if state.unread is not None:
            state.input = yield from forwards_of(self.heads_input(state.unread, state.seq[-len(state.unread):],
                                                                 state.memory))
            state.unread = None
        shape = self.shapes[min(state.draft_budget, self.shape.max_depth)]
        tree = (yield from self.fill(state.input, state.seq[-1], shape)) if len(shape) > 1 else Tree(state.seq[-1])
        state.nodes.append(len(tree))
        return Proposal(tree)

    def verify(self, state: State, proposal: Proposal, logits: torch.Tensor) -> tuple[list[int], int]:
        if state.typical:
            return typical_path(proposal.tree, logits, state.sampling, state.generator, self.cfg.posterior_threshold,
                                self.cfg.posterior_alpha)
        return super().verify(state, proposal, logits)

    def accepted(self, state: State, proposal: Proposal, path: list[int], hidden: torch.Tensor) -> None:
        state.unread = hidden  # the heads' input for the next step, read when it proposes (never after the last)

    def extra(self, state: State) -> dict:
        extra = {
            "tree_size": len(self.shape),  # tokens the target scores per call (root included), before budget pruning
            "tree_tokens_per_call": sum(state.nodes) / len(state.nodes) if state.nodes else float("nan"),  # as scored
            "verify": "greedy" if state.sampling.greedy else ("typical" if state.typical else "tree"),
        }
        if self.cfg.typical:
            extra["typical"] = True  # lossy when sampling: outputs are not distributed as the target's
        return extra
