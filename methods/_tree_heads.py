"""The decode loop Medusa and Hydra share: heads propose a tree, the target verifies it in ONE forward.

Each step: the heads read the target's last hidden state at the last committed position and fill a
candidate tree rooted at the pending token (committed, not yet in the KV cache); the target scores every
node under a tree attention mask (:func:`decoding.tree.score_tree`); the longest path matching the target's
greedy choice stands, plus the target's own next token; the cache keeps that path's entries only
(:func:`decoding.tree.keep_path`), and the hidden state of the path's last node feeds the next step's heads.
With ``recipe.prefix_layer`` (Hydra++) the path's hidden states go through the prefix layer first
(:meth:`TreeHeadsMethod.heads_input`), which keeps a KV cache of its own over the committed positions; it is
the counted role ``prefix``. Either way the target runs once per step.

- Greedy (``temperature: 0``): lossless, equal to ``ar`` token for token.
- ``typical: true`` with ``temperature > 0``: Medusa's typical acceptance over the tree -- LOSSY
  (``lossless`` is False on such an instance, and records carry ``extra.typical``).
- ``temperature > 0`` without ``typical``: no lossless tree rule is implemented, so the tree falls back to
  a chain of the heads' top-1 proposals (depth = the tree's depth), verified by the shared rejection
  sampler :func:`decoding.verify.verify_chain` with one-hot draft rows (a deterministic drafter): lossless.

Subclasses (``methods/medusa.py``, ``methods/hydra.py``) set ``kind`` and implement :meth:`propose`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from bench.errors import BenchError
from methods._heads import KINDS, LOSSES, CountedHeads, CountedPrefix, load_or_train_heads
from decoding.sampling import next_token
from decoding.tree import Tree, greedy_path, keep_path, score_tree, typical_path
from decoding.verify import verify_chain
from methods.base import Decoded, Method

_RECIPE_POSITIVE = ("num_heads", "vocab", "max_tokens", "eval_tokens", "seq_len", "batch_size", "epochs", "topk")


class TreeHeadsMethod(Method):
    kind = "?"

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.check(cfg)
        self.tree = Tree.from_paths(cfg.tree)
        self.chain = Tree.chain(self.tree.max_depth)
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
        if heads.num_heads < self.tree.max_depth or heads.blocks[0].linear.out_features != target.config.hidden_size:
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

    def propose(self, hidden: torch.Tensor, pending: int, tree: Tree) -> torch.Tensor:
        """Fill ``tree`` with candidates.

        Args:
            hidden: ``(hidden,)`` the target's last hidden state at the last committed position.
            pending: the target's token after it (the root).
        Returns:
            ``LongTensor (len(tree),)``: node tokens in the tree's order, node 0 = ``pending``.
        """
        raise NotImplementedError

    def decode(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens) -> Decoded:
        if self.heads is None:
            self.setup(train_if_missing=False)
        target, device = self.pair.target, prompt_ids.device
        typical = bool(self.cfg.get("typical", False)) and not sampling.greedy
        base = self.tree if sampling.greedy or typical else self.chain
        cache = DynamicCache()
        memory = DynamicCache() if self.prefix is not None else None  # the prefix layer's own KV cache
        out = target(prompt_ids, cache, logits_to_keep=1, output_hidden_states=True)
        first = int(next_token(out.logits[0, -1], sampling, generator))
        emitted = [first]
        on_tokens(1)
        emitted, done = self.finish(emitted, max_new_tokens)
        if not done:
            hidden = self.heads_input(out.hidden_states[-1][0], memory)
        accept_lengths, drafted, nodes, depths = [], [], [], []
        while not done:
            # Never propose past the token budget: the target's own token fills the last slot.
            tree = base.prune(max_new_tokens - len(emitted) - 1)
            tokens = self.propose(hidden, emitted[-1], tree) if len(tree) > 1 else torch.tensor([emitted[-1]], device=device)
            past = cache.get_seq_length()
            logits, hiddens = score_tree(target, cache, tokens, tree)  # ONE target forward for the whole tree
            if sampling.greedy:
                path, nxt = greedy_path(tree, tokens, logits)
            elif typical:
                path, nxt = typical_path(tree, tokens, logits, sampling, generator,
                                         float(self.cfg.posterior_threshold), float(self.cfg.posterior_alpha))
            else:
                onehot = torch.nn.functional.one_hot(tokens[1:], logits.shape[-1]).to(logits.dtype)
                n, nxt = verify_chain(tokens[1:], onehot, logits, sampling, generator)
                path = list(range(n + 1))  # a chain's nodes are in path order
            keep_path(cache, past, path)
            committed = tokens[path[1:]].tolist() + [nxt]
            emitted.extend(committed)
            accept_lengths.append(len(committed))
            drafted.append(tree.max_depth)  # the most candidates a call can accept: acceptance by position = by depth
            nodes.append(len(tree))
            depths.append(len(path) - 1)
            before = len(emitted)
            emitted, done = self.finish(emitted, max_new_tokens)
            on_tokens(len(committed) - (before - len(emitted)))
            if not done:  # the heads' input for the next step (nothing to run after the last one)
                hidden = self.heads_input(hiddens[path], memory)
        extra = {
            "tree_size": len(base),  # tokens the target scores per call (root included), before budget pruning
            "tree_tokens_per_call": sum(nodes) / len(nodes) if nodes else float("nan"),  # as actually scored
            # P(a call accepts at least d candidates), d = 1 .. depth, over calls whose tree reached depth d
            "accept_at_depth": [
                (sum(a >= d for a, k in zip(depths, drafted) if k >= d) / n_d) if (n_d := sum(k >= d for k in drafted)) else float("nan")
                for d in range(1, base.max_depth + 1)
            ],
            "verify": "greedy" if sampling.greedy else ("typical" if typical else "chain"),
        }
        if self.cfg.get("typical", False):
            extra["typical"] = True  # lossy when sampling: outputs are not distributed as the target's
        return Decoded(emitted, accept_lengths=accept_lengths, drafted=drafted, extra=extra)
