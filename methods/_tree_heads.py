"""The loop Medusa and Hydra share: heads propose a tree, the target verifies it in ONE forward.

Each step the heads read the target's last hidden state at the last committed position and fill the
method's candidate tree shape (:class:`decoding.tree.Tree` from rank paths) rooted at the pending token; the
shared loop (:class:`methods.base.DraftVerify`) scores every node under a tree attention mask, keeps the
accepted path's KV entries, and the hidden state of the path's last node feeds the next step's heads. With
``recipe.prefix_layer`` (Hydra++) the path's hidden states go through the prefix layer first
(:meth:`TreeHeadsMethod.heads_input`), which keeps a KV cache of its own over the committed positions; it is
the counted role ``prefix``. Either way the target runs once per step.

- Greedy: the longest path of the target's own argmax choices: equal to ``ar`` token for token.
- Sampling: recursive rejection sampling over each node's children (:func:`decoding.verify.verify_tree`;
  the candidates are a head's top-k, deterministic, so one-hot q): distributed exactly as the target's.
- ``typical: true`` with ``temperature > 0``: Medusa's typical acceptance (:func:`typical_path`) instead --
  LOSSY (:meth:`~TreeHeadsMethod.is_lossless` says so, and records carry ``extra.typical``). At temperature 0
  typical acceptance is the greedy rule, and lossless.

Subclasses (``methods/medusa.py``, ``methods/hydra.py``) set ``kind`` and implement :meth:`fill`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from bench.errors import BenchError
from decoding.sampling import Sampling, probs_from_logits, sample
from decoding.tree import Tree
from methods._heads import (
    KINDS,
    LOSSES,
    CountedHeads,
    CountedPrefix,
    load_or_train_heads,
)
from methods.base import Decoding, Draft, DraftVerify

_RECIPE_POSITIVE = ("num_heads", "vocab", "max_tokens", "eval_tokens", "seq_len", "batch_size", "epochs", "topk")


def typical_path(tree: Tree, logits: torch.Tensor, sampling: Sampling, generator, threshold: float,
                 alpha: float) -> tuple[list[int], int]:
    """Medusa's typical acceptance (Cai et al. 2024, Sec. 2.3.1) -- LOSSY: node x after parent p stands when
    ``p_target(x | p) > min(threshold, alpha * exp(-H(p_target(. | p))))``; the deepest node whose whole
    path stands wins, and the next token is sampled from the target at that node."""
    probs = probs_from_logits(logits, sampling)  # (n, vocab)
    entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1)  # (n,)
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    parent = torch.tensor(tree.parent[1:], device=logits.device)
    tokens = torch.tensor(tree.tokens[1:], device=logits.device)
    ok = torch.ones(len(tree), dtype=torch.bool)
    ok[1:] = (probs[parent, tokens] > bar[parent]).cpu()
    ok_path = (~tree.ancestry() | ok[None, :]).all(-1)  # every node on the path stands
    depth = torch.where(ok_path, torch.tensor(tree.depth), -1)
    best = int(depth.argmax())  # first (breadth-first) among the deepest
    return tree.path_to(best), int(sample(probs[best], generator))


class TreeHeadsMethod(DraftVerify):
    kind = "?"
    hidden = True  # the heads read the target's last hidden states

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.check(cfg)
        self.shape = Tree.from_paths(cfg.tree)
        self.shapes = {d: self.shape.prune(d) for d in range(self.shape.max_depth + 1)}  # pruned near the budget
        self.report: dict = {}
        self.heads: CountedHeads | None = None
        self.prefix: CountedPrefix | None = None

    def is_lossless(self, sampling) -> bool:
        # Typical acceptance keeps tokens the target would not have sampled; at temperature 0 it is the greedy rule.
        return not (self.cfg.get("typical", False) and not sampling.greedy)

    @classmethod
    def check(cls, cfg) -> None:
        """Bad settings, before any model loads: one sentence each."""
        recipe = cfg.get("recipe")
        if recipe is None or cfg.get("tree") is None:
            raise BenchError(f"method '{cfg.name}' needs 'tree' and 'recipe' settings (see configs/method/{cfg.name}.yaml).")
        for key in _RECIPE_POSITIVE:
            if int(recipe[key]) < 1:
                raise BenchError(f"method.recipe.{key} must be at least 1, got {recipe[key]}.")
        if recipe.loss not in LOSSES:
            raise BenchError(f"method.recipe.loss must be one of {', '.join(LOSSES)}, got '{recipe.loss}'.")
        if not float(recipe.lr) > 0:
            raise BenchError(f"method.recipe.lr must be > 0, got {recipe.lr}.")
        if not isinstance(recipe.get("prefix_layer", False), bool):
            raise BenchError(f"method.recipe.prefix_layer must be true or false, got {recipe.get('prefix_layer')!r}.")
        tree = Tree.from_paths(cfg.tree)
        if len(tree) == 1:
            raise BenchError("method.tree must hold at least one path.")
        if tree.max_depth > int(recipe.num_heads):
            raise BenchError(f"method.tree is {tree.max_depth} deep but there are only {recipe.num_heads} heads (method.recipe.num_heads).")
        for key in ("posterior_threshold", "posterior_alpha"):
            if not 0 < float(cfg.get(key, 0.1)) <= 1:
                raise BenchError(f"method.{key} must be in (0, 1], got {cfg.get(key)}.")

    def setup(self, train_if_missing: bool = True) -> None:
        if self.kind not in KINDS:
            raise BenchError(f"unknown heads kind '{self.kind}'; use one of {', '.join(KINDS)}.")
        target = self.pair.target.module
        heads, prefix, self.report = load_or_train_heads(target, self.pair.tokenizer, self.kind, self.cfg.recipe,
                                                         self.pair.cache, train_if_missing)
        if heads.num_heads < self.shape.max_depth or heads.blocks[0].linear.out_features != target.config.hidden_size:
            raise BenchError(f"the cached {self.kind} heads do not fit this target and tree; delete them to retrain.")
        # Registered as a role so the harness counts the heads' calls and FLOPs like any model's.
        self.heads = self.pair.add(CountedHeads(heads.to(device=self.pair.device, dtype=self.pair.dtype), "heads"))
        if prefix is not None:
            self.prefix = self.pair.add(CountedPrefix(prefix.to(device=self.pair.device, dtype=self.pair.dtype), "prefix"))
        self.embed = target.get_input_embeddings()

    def heads_input(self, hiddens: torch.Tensor, memory) -> torch.Tensor:
        """What the heads read once the target has committed more positions.

        Args:
            hiddens: ``(n, hidden)`` the target's last hidden states at the n positions just committed, in
                order: the prompt at the prefill, the accepted path (root first) after a tree step.
            memory: the prefix layer's KV cache for this decode (``None`` without a prefix layer); it is
                extended by these n positions, so no position is ever fed twice.
        Returns:
            ``(hidden,)``: the target's hidden state at the last committed position, or the prefix layer's
            output there.
        """
        if self.prefix is None:
            return hiddens[-1]
        return self.prefix(hiddens.unsqueeze(0), memory)[0, -1]

    def fill(self, hidden: torch.Tensor, pending: int, shape: Tree) -> Tree:
        """``shape`` with its tokens proposed by the heads.

        Args:
            hidden: ``(hidden,)`` the heads' input at the last committed position (:meth:`heads_input`).
            pending: the target's token after it (the root).
        """
        raise NotImplementedError

    def start(self, st: Decoding) -> None:
        if self.heads is None:
            self.setup(train_if_missing=False)
        self.memory = DynamicCache() if self.prefix is not None else None  # the prefix layer's own KV cache
        self.input = self.heads_input(st.prompt_hidden, self.memory)
        self.typical = bool(self.cfg.get("typical", False)) and not st.sampling.greedy
        self.nodes: list[int] = []

    def propose(self, st: Decoding) -> Draft:
        shape = self.shapes[min(st.room, self.shape.max_depth)]
        tree = self.fill(self.input, st.seq[-1], shape) if len(shape) > 1 else Tree(st.seq[-1])
        self.nodes.append(len(tree))
        return Draft(tree)

    def verify(self, st: Decoding, draft: Draft, logits: torch.Tensor) -> tuple[list[int], int]:
        if self.typical:
            return typical_path(draft.tree, logits, st.sampling, st.generator, float(self.cfg.posterior_threshold),
                                float(self.cfg.posterior_alpha))
        return super().verify(st, draft, logits)

    def accepted(self, st: Decoding, draft: Draft, path: list[int], hidden: torch.Tensor) -> None:
        if not st.done:  # the heads' input for the next step (nothing to run after the last one)
            self.input = self.heads_input(hidden, self.memory)

    def figures(self, st: Decoding) -> dict:
        extra = {
            "tree_size": len(self.shape),  # tokens the target scores per call (root included), before budget pruning
            "tree_tokens_per_call": sum(self.nodes) / len(self.nodes) if self.nodes else float("nan"),  # as scored
            "verify": "greedy" if st.sampling.greedy else ("typical" if self.typical else "tree"),
        }
        if self.cfg.get("typical", False):
            extra["typical"] = True  # lossy when sampling: outputs are not distributed as the target's
        return extra
