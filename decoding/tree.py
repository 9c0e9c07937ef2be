"""The one token tree: candidate continuations scored in ONE target forward, and the KV cache of the path kept.

Node 0 is the root: the pending token (committed, not yet in the KV cache). Every other node v has a
parent ``parent[v] < v``, so parents come before children. A chain (plain speculative decoding) is a tree
of one path. Trees come from two places:

- inserting candidate token paths (:meth:`Tree.add`; hierarchy drafting merges its databases' candidates,
  shared prefixes once);
- a fixed shape written as Medusa writes it (Cai et al. 2024, Sec. 2.1.2; :meth:`Tree.from_paths`): rank
  paths such as ``[[0], [1], [0, 0]]``, node ``(r1, ..., rd)`` holding the ``r_d``-th best proposal for the
  token d steps after the pending one under the proposals ``r1 .. r_{d-1}``; draft heads then
  :meth:`Tree.fill` its tokens. Shape nodes are in breadth-first order (depth, then path), so pruning to a
  depth keeps a prefix of the nodes.

Each node attends to the cache and to its ancestors (itself included), at position ``past + depth``: its
logits are exactly those of its path scored as a plain sequence (tested in ``tests/decoding/test_tree.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import BenchError


class Tree:
    """A token tree rooted at the pending token. ``tokens[v]``, ``parent[v]``, ``depth[v]``, ``source[v]``
    (who proposed node v: a database name, a rank path, ...) and ``children[v]`` (node indices) describe v."""

    def __init__(self, root: int = -1):
        self.tokens, self.parent, self.depth, self.source = [root], [-1], [0], [None]
        self.children: list[list[int]] = [[]]
        self.paths: tuple | None = None  # rank paths, for a shape made by from_paths
        self._ancestry: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @property
    def is_chain(self) -> bool:
        return all(len(kids) <= 1 for kids in self.children)

    # ------------------------------------------------------------------------------------------- building

    def add_child(self, node: int, token: int, source=None, merge: bool = True) -> int:
        """The child of ``node`` holding ``token``, created when there is none (``merge=False``: always a new
        node, as for siblings drawn independently from a draft, which the sampling verifier needs as drawn)."""
        for child in self.children[node] if merge else ():
            if self.tokens[child] == token:
                return child
        self.tokens.append(int(token))
        self.parent.append(node)
        self.depth.append(self.depth[node] + 1)
        self.source.append(source)
        self.children.append([])
        self.children[node].append(len(self.tokens) - 1)
        self._ancestry = None
        return len(self.tokens) - 1

    def add(self, candidate, source=None) -> int:
        """Insert a candidate path below the root; returns how many new nodes it created."""
        node, before = 0, len(self)
        for tok in candidate:
            node = self.add_child(node, tok, source)
        return len(self) - before

    @classmethod
    def chain(cls, root: int, tokens) -> "Tree":
        """A single path: ``root`` then ``tokens``."""
        tree = cls(root)
        tree.add(tokens)
        return tree

    @classmethod
    def from_paths(cls, paths) -> "Tree":
        """A shape from a YAML list of rank paths (the root is implicit; tokens unset: -1); one sentence when bad."""
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
        tree, index = cls(), {(): 0}
        for p in sorted(seen, key=lambda p: (len(p), p)):
            index[p] = len(tree)
            tree.tokens.append(-1)
            tree.parent.append(index[p[:-1]])
            tree.depth.append(len(p))
            tree.source.append(p)
            tree.children.append([])
            tree.children[index[p[:-1]]].append(index[p])
        tree.paths = ((),) + tuple(sorted(seen, key=lambda p: (len(p), p)))
        return tree

    def prune(self, max_depth: int) -> "Tree":
        """The nodes of depth <= ``max_depth`` (a prefix of a breadth-first shape)."""
        if max_depth >= self.max_depth:
            return self
        keep = [v for v in range(len(self)) if self.depth[v] <= max_depth]
        if keep != list(range(len(keep))):
            raise ValueError("prune needs a breadth-first tree")
        out = Tree(self.tokens[0])
        out.tokens, out.parent, out.depth = self.tokens[: len(keep)], self.parent[: len(keep)], self.depth[: len(keep)]
        out.source = self.source[: len(keep)]
        out.children = [[c for c in kids if c < len(keep)] for kids in self.children[: len(keep)]]
        out.paths = self.paths[: len(keep)] if self.paths is not None else None
        return out

    def fill(self, tokens: list[int]) -> "Tree":
        """This shape with its node tokens set (``tokens[0]`` is the root); the structure is shared."""
        out = Tree.__new__(Tree)
        out.__dict__.update(self.__dict__)
        out.tokens = [int(t) for t in tokens]
        return out

    # ------------------------------------------------------------------------------------------- reading

    def child_with(self, node: int, token: int) -> int | None:
        """The child of ``node`` that holds ``token`` (None: the target's token was not drafted there)."""
        return next((c for c in self.children[node] if self.tokens[c] == token), None)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, both included."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parent[node]
        return out[::-1]

    def ancestry(self) -> torch.Tensor:
        """``BoolTensor (n, n)``: ``[i, j]`` is True when node j is node i or one of its ancestors."""
        if self._ancestry is None:
            n = len(self)
            anc = torch.eye(n, dtype=torch.bool, device="cpu")  # host-side, like the tree itself
            for i in range(1, n):  # parents come first, so their rows are complete already
                anc[i] |= anc[self.parent[i]]
            self._ancestry = anc
        return self._ancestry


def additive_mask(allowed: torch.Tensor, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``(1, 1, n, past + m)`` additive attention mask: every query attends to the ``past`` cached positions,
    and to the m new ones where ``allowed (n, m)`` is True; the dtype's minimum elsewhere. Additive because
    transformers' eager attention adds the mask to the scores (SDPA takes either); a 4D mask is passed through
    ``create_causal_mask`` as is."""
    n, m = allowed.shape
    mask = torch.zeros(n, past + m, dtype=dtype, device=device)
    mask[:, past:].masked_fill_(~allowed.to(device), torch.finfo(dtype).min)
    return mask[None, None]


@dataclass
class SideRows:
    """Rows the target reads in the same forward as a tree that are no candidates (Lookahead's Jacobi window):
    none of the tree's nodes sees them, they see the cache, the root (the pending token) and the side rows
    ``allowed`` marks, and their KV entries go when the step keeps its path (:func:`keep_path`).

    ``tokens``: the m rows' tokens; ``offsets``: each row's position minus the root's; ``allowed``: ``BoolTensor
    (m, m)``, ``[i, j]`` True when row i attends to row j; ``keep``: the rows whose logits are needed, in order
    (the output head runs on those only).
    """

    tokens: list[int]
    offsets: list[int]
    allowed: torch.Tensor
    keep: list[int]


def score_tree(target, cache, tree: Tree, hidden: bool = False, side: SideRows | None = None, **kwargs):
    """Score every node of ``tree`` in ONE forward of ``target`` (a ``CountedLM``); the cache grows by ``n``
    (and by the side rows, when given).

    A chain is a plain causal forward (no mask); any other tree, or one with ``side`` rows after it, gets the
    tree attention mask and positions ``past + depth``. Returns ``(logits (n, vocab), hidden (n, hidden) or
    None)``: the last hidden states only when ``hidden``. With ``side``, the logits have ``len(side.keep)`` more
    rows, the kept side rows' after the tree's (and the hidden states every side row's).
    """
    request = tree_request(target, cache.get_seq_length(), tree, hidden, side, **kwargs)
    return tree_scores(target, tree, side, target(cache=cache, **request), hidden)


def tree_request(target, past: int, tree: Tree, hidden: bool = False, side: SideRows | None = None, **kwargs) -> dict:
    """What :func:`score_tree` hands ``target`` for the tree after ``past`` cached positions: ``input_ids (1, n)`` and
    the forward's keywords (one row of a batch forward, ``core.counting.CountedLM.forward_rows``, takes the same)."""
    device = target.device
    tokens, allowed, offsets = tree.tokens, None, None
    if side is not None:
        n, m = len(tree), len(side.tokens)
        tokens = tree.tokens + side.tokens
        allowed = torch.zeros(n + m, n + m, dtype=torch.bool, device="cpu")  # host-side, like the tree
        allowed[:n, :n] = tree.ancestry()
        allowed[n:, 0] = True  # every side row reads the root
        allowed[n:, n:] = side.allowed
        offsets = tree.depth + side.offsets
        if kwargs.get("logits_to_keep"):
            raise ValueError("score_tree keeps every tree row's logits when there are side rows")
        kwargs["logits_to_keep"] = torch.tensor(list(range(n)) + [n + k for k in side.keep], device=device)
    elif not tree.is_chain:
        allowed, offsets = tree.ancestry(), tree.depth
    if allowed is not None:
        dtype = next(target.module.parameters()).dtype
        kwargs["attention_mask"] = additive_mask(allowed, past, dtype, device)
        kwargs["position_ids"] = (past + torch.tensor(offsets, device=device)).unsqueeze(0)
    return {"input_ids": torch.tensor([tokens], device=device), "output_hidden_states": hidden, **kwargs}


def tree_scores(target, tree: Tree, side: SideRows | None, out, hidden: bool):
    """:func:`score_tree`'s ``(logits, hidden)`` from the forward's output ``out``."""
    logits = out.logits[0]
    if target.acceptance is not None:  # a synthetic pair: the coin decides the target's choice at each node
        n = logits.shape[0] - (len(side.keep) if side is not None else 0)
        logits = torch.cat([target.acceptance.rewrite(tree, logits[:n]), logits[n:]])
    return logits, (out.hidden_states[-1][0] if hidden else None)


def nodes_request(model, cache, tree: Tree, nodes: list[int], cached: list[int], past: int) -> dict:
    """The ONE forward of ``model`` (a draft, a ``CountedLM``) over the tree's ``nodes``, as a method yields it
    (``out = yield nodes_request(...)``, ``methods.base.DraftVerify.steps``; ``out.logits[0]``: the nodes' logits
    ``(len(nodes), vocab)``). ``cache`` holds the text up to the pending token (the root, at position ``past``), then
    the tree's nodes ``cached`` in that order; ``nodes`` go in after them. Each attends to the text and to its own
    ancestors among ``cached`` and ``nodes`` (itself included) at position ``past + depth``, so its logits are its
    path's scored as a plain sequence. A single node below a cached chain of its own ancestors is a plain causal
    step. How a draft reads a token tree level by level (SpecHub's sequences, GSD's graph)."""
    device = model.device
    ids = torch.tensor([[tree.tokens[v] for v in nodes]], device=device)
    request = {"lm": model, "cache": cache, "input_ids": ids}
    allowed = tree.ancestry()[nodes][:, cached + nodes]  # (len(nodes), len(cached) + len(nodes))
    if len(nodes) == 1 and bool(allowed.all()):
        return request
    dtype = next(model.module.parameters()).dtype
    mask = additive_mask(allowed, past + 1, dtype, device)  # past + 1: the text up to the pending token
    positions = (past + torch.tensor([tree.depth[v] for v in nodes], device=device)).unsqueeze(0)
    return {**request, "attention_mask": mask, "position_ids": positions}


def keep_path(cache, past: int, path: list[int]) -> None:
    """Keep the KV entries of the tree nodes ``path`` right after the first ``past`` positions and drop the
    rest: the cache then holds the prefix plus the accepted path, in order, with nothing recomputed."""
    n = len(path)
    if path != list(range(n)):  # a prefix of the nodes (always, for a chain) is already in place
        idx = torch.tensor(path, device=cache.layers[0].keys.device) + past
        for layer in cache.layers:
            # index_select copies before the slice is overwritten, so overlapping source and target are safe.
            layer.keys[..., past : past + n, :] = layer.keys.index_select(-2, idx)
            layer.values[..., past : past + n, :] = layer.values.index_select(-2, idx)
    extra = cache.get_seq_length() - (past + n)
    if extra > 0:
        cache.crop(-extra)
