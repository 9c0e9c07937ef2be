"""Tree verification: score a whole tree of candidate continuations in ONE target forward, keep the path
the target agrees with, and keep exactly that path's KV entries.

A tree is written as Medusa writes it (Cai et al. 2024, "Medusa", Sec. 2.1.2): a list of rank paths, e.g.
``[[0], [1], [0, 0]]``: node ``(r1, ..., rd)`` at depth ``d`` holds the ``r_d``-th best proposal for the
token ``d`` steps after the pending one, given the proposals ``r1 .. r_{d-1}`` above it. The root (depth 0)
is the pending token: already committed, not yet in the KV cache. Nodes are kept in breadth-first order
(depth, then path), so pruning a tree to a maximum depth is slicing a prefix of its nodes.

Each node attends to the cache and to its ancestors (itself included), at position ``past + depth``: its
logits are exactly those of its path scored as a plain sequence (tested in ``tests/test_heads.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from bench.errors import BenchError
from decoding.sampling import Sampling, probs_from_logits, sample


@dataclass(frozen=True)
class Tree:
    """A candidate tree. ``paths[i]`` is node i's rank path (``()`` for the root, node 0)."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def from_paths(cls, paths) -> "Tree":
        """Build from a YAML list of rank paths (the root is implicit); raises :class:`BenchError` when bad."""
        try:
            clean = [tuple(int(r) for r in p) for p in paths]
        except (TypeError, ValueError):
            raise BenchError(f"tree must be a list of lists of ranks (e.g. [[0], [1], [0, 0]]), got {paths}.") from None
        seen = set(clean)
        for p in clean:
            if not p or min(p) < 0:
                raise BenchError(f"tree path {list(p)} must be a non-empty list of ranks >= 0.")
            if len(p) > 1 and p[:-1] not in seen:
                raise BenchError(f"tree path {list(p)} has no parent {list(p[:-1])} in the tree.")
        if len(seen) != len(clean):
            raise BenchError("tree lists a path twice.")
        return cls(((),) + tuple(sorted(seen, key=lambda p: (len(p), p))))

    @classmethod
    def chain(cls, depth: int) -> "Tree":
        """A single path of top-1 proposals: plain speculative decoding's chain."""
        return cls(tuple((0,) * d for d in range(depth + 1)))

    def __len__(self) -> int:
        return len(self.paths)

    @cached_property
    def depth(self) -> torch.Tensor:
        """``LongTensor (n,)``: node depths (root 0)."""
        return torch.tensor([len(p) for p in self.paths])

    @property
    def max_depth(self) -> int:
        return len(self.paths[-1])

    @cached_property
    def parent(self) -> list[int]:
        """Node index of each node's parent (-1 for the root)."""
        index = {p: i for i, p in enumerate(self.paths)}
        return [-1] + [index[p[:-1]] for p in self.paths[1:]]

    @cached_property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.paths]
        for i, p in enumerate(self.parent[1:], start=1):
            kids[p].append(i)
        return kids

    @cached_property
    def ancestry(self) -> torch.Tensor:
        """``BoolTensor (n, n)``: ``[i, j]`` is True when node j is node i or one of its ancestors."""
        n = len(self.paths)
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):  # parents come before children, so their rows are complete already
            anc[i] |= anc[self.parent[i]]
        return anc

    def prune(self, max_depth: int) -> "Tree":
        """The nodes of depth <= ``max_depth`` (a prefix, by breadth-first order)."""
        if max_depth >= self.max_depth:
            return self
        return Tree(tuple(p for p in self.paths if len(p) <= max_depth))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, both included."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parent[node]
        return out[::-1]


def tree_attention_mask(tree: Tree, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask ``(1, 1, n, past + n)``: 0 where a node may attend (cache, ancestors, itself), else -inf-ish.

    Additive (not boolean) because transformers' eager attention adds the mask to the scores, while SDPA
    takes either; a 4D mask is passed through by ``create_causal_mask`` as is.
    """
    n = len(tree)
    allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), tree.ancestry], dim=1).to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def score_tree(target, cache, tokens: torch.Tensor, tree: Tree):
    """Score every node of ``tree`` in ONE forward of ``target`` (a ``CountedLM``); the cache grows by ``n``.

    Args:
        tokens: ``LongTensor (n,)``, node tokens in the tree's order (node 0 = the pending token).
    Returns:
        ``(logits, hidden)``: ``(n, vocab)`` and the last (normed) hidden states ``(n, hidden)``.
    """
    past = cache.get_seq_length()
    dtype = next(target.module.parameters()).dtype
    mask = tree_attention_mask(tree, past, dtype, tokens.device)
    position_ids = (past + tree.depth.to(tokens.device)).unsqueeze(0)
    out = target(tokens.unsqueeze(0), cache, attention_mask=mask, position_ids=position_ids, output_hidden_states=True)
    return out.logits[0], out.hidden_states[-1][0]


def keep_path(cache, past: int, path: list[int]) -> None:
    """Keep the KV entries of the tree nodes ``path`` (indices into the scored tree) right after the first
    ``past`` positions and drop the rest: the cache then holds the prefix plus the accepted path, in order,
    with nothing recomputed."""
    idx = torch.tensor(path, device=cache.layers[0].keys.device) + past
    n = len(path)
    for layer in cache.layers:
        # index_select copies before the slice is overwritten, so overlapping source and target are safe.
        layer.keys[..., past : past + n, :] = layer.keys.index_select(-2, idx)
        layer.values[..., past : past + n, :] = layer.values.index_select(-2, idx)
    extra = cache.get_seq_length() - (past + n)
    if extra > 0:
        cache.crop(-extra)


def greedy_path(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """The longest root path on which every node is the target's own greedy choice after its parent.

    Returns ``(path, next_token)``: node indices from the root, and the target's greedy token after the
    path's last node (its correction, or the bonus token when a leaf is reached). Lossless by construction.
    """
    choice = logits.argmax(-1).tolist()  # (n,) the target's next token after each node
    toks = tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        nxt = next((c for c in tree.children[node] if toks[c] == choice[node]), None)
        if nxt is None:
            return path, choice[node]
        path.append(nxt)


def typical_path(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor, sampling: Sampling, generator,
                 threshold: float, alpha: float) -> tuple[list[int], int]:
    """Medusa's typical acceptance (Cai et al. 2024, Sec. 2.3.1) -- LOSSY: node x after parent p stands when
    ``p_target(x | p) > min(threshold, alpha * exp(-H(p_target(. | p))))``; the deepest node whose whole
    path stands wins, and the next token is sampled from the target at that node."""
    probs = probs_from_logits(logits, sampling)  # (n, vocab)
    entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1)  # (n,)
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    parent = torch.tensor(tree.parent[1:], device=logits.device)
    ok = torch.ones(len(tree), dtype=torch.bool)
    ok[1:] = (probs[parent, tokens[1:]] > bar[parent]).cpu()
    ok_path = (~tree.ancestry | ok[None, :]).all(-1)  # every node on the path stands
    depth = torch.where(ok_path, tree.depth, -1)
    best = int(depth.argmax())  # first (breadth-first) among the deepest
    return tree.path_to(best), int(sample(probs[best], generator))
