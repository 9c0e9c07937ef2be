"""Graph-structured speculative decoding (GSD; Gong et al., ACL Findings 2024, arXiv 2407.16207).

The draft proposes several hypotheses, and hypotheses share token sequences: GSD keeps them in a graph (the paper's
directed acyclic graph) in which a recurring token is drafted once and then reached from every hypothesis that
produces it, so the draft computes its continuations once. The target then verifies every path of the graph in
ONE forward. (The authors' merge rule can also link a node to one that leads back to it: a cycle, which the
unrolling below bounds like any other path.)

One step (ONE target forward):

1. The draft reads the committed tokens it has not seen; its logits at the pending token give the root's
   candidates. Per level (at most ``max_depth`` levels), for each expandable node of the newest level, its
   ``top_k`` most likely next tokens, of which those with probability >= ``sibling_ratio`` x the node's top
   probability are kept (the authors' ``sibling_threshold``).
2. A kept candidate c below node f is **merged** (:meth:`Graph.merge_target`) when an existing node n, not on f's
   own path, holds c and the ``repeat`` tokens before n equal the ``repeat`` tokens ending at f (the authors'
   ``repeat_threshold``; 0: the token alone; -1: never merge, a plain top-k tree). Then f links to n (the
   authors' "pseudo child"): n's continuations, drafted in n's context, are reused after f, and the draft reads
   nothing for c. Otherwise c becomes a new node.
3. A node whose own probability is below ``leaf_prob`` (the authors' ``prob_threshold``) is a leaf: the draft
   does not expand it. Drafting stops when a level has no expandable node, at ``max_depth``, or when the graph
   holds ``max_nodes`` nodes. All the nodes of one level are read in ONE draft forward (a tree attention mask
   over the real parent links, which form a tree, with positions by depth), as SpecHub's draft reads its tree.
4. The graph is unrolled into a token tree (:meth:`Graph.unroll`): breadth first from the root, each node's
   children and then its merge links, a linked node's whole subgraph copied under the node that links to it, at
   most ``max_nodes`` nodes (the authors' 100) and never deeper than the token budget allows. Unrolling is what
   keeps GSD exact: every copy is scored by the target in its own context (its own ancestors, its own position),
   where a merged node's key and value would otherwise stand for contexts it was not computed in.
5. ONE target forward scores the tree (:func:`decoding.tree.score_tree`); the shared lossless verifier keeps a
   path (:func:`decoding.verify.verify_tree`; the candidates are deterministic, so under sampling it is recursive
   speculative decoding with one-hot q, exact). Greedy output equals ``ar``'s token for token.
6. The draft's cache keeps the accepted nodes it computed in their own context (the path's prefix on real parent
   links, up to the first copy or leaf); the rest of the accepted text it reads at the next step.

What was read: the abstract and the authors' code (github.com/gzhch/gsd, ``utils/graph_decoding.py``:
``TokenGraph.check_repetition`` for the merge rule, the breadth-first graph-to-tree conversion before the large
model's forward, and the sweep in ``gsd.py``: top-k 4, repeat 0 / 1 / -1, prob_threshold 0.3 / 0.4,
sibling_threshold 0.1-0.4). The defaults here are from that sweep (``max_depth`` 8 is this harness's: the
script does not set the authors' max_step_draft); the paper's own choice could not be read.
Deviations: (a) the authors' sampling mode accepts a draft token with probability min(1, p/q) and no residual
(lossy); here the shared exact verifier. (b) A node may hold several merge links (the authors keep the last one).
(c) A leaf's children are not drafted (the authors' development version still drafts them, marked as leaves,
while any other node is expandable). (d) The authors' draft cache keeps a merged node's entries for the copy the
target accepted, though they were computed in another context; here such tokens are read again by the draft.
"""

from __future__ import annotations

import torch
from pydantic import Field
from transformers import Cache

from decoding.tree import Tree, keep_path, nodes_request
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register


class Graph:
    """The draft's token DAG for one step. ``tree`` holds the nodes on their real parent links (node 0: the
    pending token); ``links[v]``: the existing nodes node v also leads to (merges); ``prob[v]``: the draft's
    probability of node v's token given its real path."""

    def __init__(self, root: int, repeat: int):
        self.tree = Tree(root)
        self.prob = [1.0]
        self.links: list[list[int]] = [[]]
        self.repeat = repeat
        self.merges = 0

    def __len__(self) -> int:
        return len(self.tree)

    def merge_target(self, father: int, token: int) -> int | None:
        """An existing node to link ``token`` below ``father`` to, or None (the authors' repetition check): a node
        off ``father``'s own path holding ``token``, whose ``repeat`` real ancestors hold the same tokens as
        ``father`` and its ancestors. The first such node, in the order nodes were made."""
        if self.repeat < 0:
            return None
        own = set(self.tree.path_to(father))
        tokens, parent = self.tree.tokens, self.tree.parent
        for node in range(1, len(self)):
            if node in own or tokens[node] != token:
                continue
            a, b = father, parent[node]
            for _ in range(self.repeat):  # compare the preceding tokens, nearest first
                if a < 0 or b < 0 or tokens[a] != tokens[b]:
                    break
                a, b = parent[a], parent[b]
            else:
                return node
        return None

    def add(self, father: int, token: int, prob: float) -> int | None:
        """Put a candidate below ``father``: a merge link to an existing node (returns None) or a new node."""
        node = self.merge_target(father, token)
        if node is not None:
            self.links[father].append(node)
            self.merges += 1
            return None
        node = self.tree.add_child(father, token, merge=False)
        self.prob.append(prob)
        self.links.append([])
        return node

    def unroll(self, max_nodes: int, max_depth: int) -> tuple[Tree, list[int], list[bool]]:
        """The graph as a token tree: breadth first, each node's children then its links, a linked node's
        subgraph copied below the linking node; at most ``max_nodes`` nodes, none deeper than ``max_depth``.
        Returns ``(tree, origin, own)``: tree node i copies graph node ``origin[i]``; ``own[i]``: it stands on
        real parent links all the way up (the context the draft computed it in)."""
        tree, origin, own = Tree(self.tree.tokens[0]), [0], [True]
        head = 0
        while head < len(tree) and len(tree) < max_nodes:
            g = origin[head]
            if tree.depth[head] < max_depth:
                nexts = [(c, True) for c in self.tree.children[g]] + [(n, False) for n in self.links[g]]
                for n, real in nexts:
                    if len(tree) >= max_nodes:
                        break
                    tree.add_child(head, self.tree.tokens[n], source="link" if not real else None, merge=False)
                    origin.append(n)
                    own.append(own[head] and real)
            head += 1
        return tree, origin, own


@register("gsd")
class GSD(DraftVerify):
    lossless = True  # the unrolled tree is verified exactly: greedy output equals ar, sampled follows the target
    drafts = 1
    batched_drafting = True  # a batch reads every row's graph level in one draft forward
    label_settings = ("repeat",)  # -1 is the plain top-k tree without merging: a row always says which

    class Config(MethodSettings):
        top_k: int = Field(4, ge=1, description="candidates drafted below each expanded node (the authors' n_tree)")
        sibling_ratio: float = Field(0.3, ge=0, le=1, description="keep a candidate whose draft probability is at "
                                     "least this share of its node's top candidate's (the authors' sibling_threshold)")
        leaf_prob: float = Field(0.4, ge=0, le=1, description="a node the draft gives a lower probability is not "
                                 "expanded (the authors' prob_threshold)")
        repeat: int = Field(1, ge=-1, description="merge a candidate into an existing node holding its token when "
                            "this many preceding tokens match too (0: the token alone; -1: never merge, a plain tree)")
        max_depth: int = Field(8, ge=1, description="draft levels per step at most")
        max_nodes: int = Field(100, ge=2, description="nodes of the graph, and of the tree the target scores, at "
                               "most (the authors' 100)")

    class State(PromptState):
        """One prompt's drafting: the draft's KV cache, this step's graph and the tree it unrolled to, and the
        tallies summed over steps for ``extra``."""

        dcache: Cache  # the draft's: a DynamicCache, or its compiled forwards' static one (compile=true)
        past: int  # this step's pending position
        read: list[int]  # graph nodes the draft read this step, in cache order after the pending token
        graph: Graph | None
        origin: list[int]  # tree node i copies graph node origin[i]
        own: list[bool]  # tree node i stands on real parent links (the context the draft computed it in)
        tally: dict[str, int]

    def start(self, state: State):
        state.dcache = yield from state.draft_cache(self.pair.draft)  # the draft reads the prompt: its cost, counted
        state.past = 0
        state.read = []
        state.graph = None
        state.origin = []
        state.own = []
        state.tally = {"graph_nodes": 0, "tree_nodes": 0, "copies": 0, "merges": 0, "draft_forwards": 0, "steps": 0,
                       "accepted_through_link": 0}

    # ------------------------------------------------------------------------------------------- drafting

    def propose(self, state: State):
        state.past = len(state.seq) - 1
        state.read = []
        graph = state.graph = Graph(state.seq[-1], self.cfg.repeat)
        depth = min(self.cfg.max_depth, state.draft_budget)
        if depth <= 0:
            state.origin, state.own = [0], [True]
            return Proposal(graph.tree)
        pending = torch.tensor([state.seq[state.dcache.get_seq_length():]], device=state.device)
        out = yield {"lm": self.pair.draft, "cache": state.dcache, "input_ids": pending, "logits_to_keep": 1}
        logits = out.logits[0, -1:]
        level, forwards = [0], 1
        for d in range(depth):
            level = self.expand(graph, level, logits)
            level = [v for v in level if graph.prob[v] >= self.cfg.leaf_prob]  # leaves are not expanded
            if not level or d + 1 == depth or len(graph) >= self.cfg.max_nodes:
                break
            # The draft reads the level's nodes in one forward, after the nodes it read before (its cache order).
            out = yield nodes_request(self.pair.draft, state.dcache, graph.tree, level, state.read, state.past)
            logits = out.logits[0]
            state.read = state.read + level
            forwards += 1
        tree, state.origin, state.own = graph.unroll(self.cfg.max_nodes, state.draft_budget)
        t = state.tally
        t["graph_nodes"] += len(graph) - 1
        t["tree_nodes"] += len(tree) - 1
        t["copies"] += state.own.count(False)  # nodes scored under a link: the draft did not compute them there
        t["merges"] += graph.merges
        t["draft_forwards"] += forwards
        return Proposal(tree)

    def expand(self, graph: Graph, level: list[int], logits: torch.Tensor) -> list[int]:
        """Add each node of ``level``'s candidates (``logits (len(level), vocab)``, the draft's after each);
        returns the new nodes, in order."""
        probs = logits.float().softmax(-1)
        top = probs.topk(min(self.cfg.top_k, probs.shape[-1]), dim=-1)
        new = []
        for v, values, tokens in zip(level, top.values.tolist(), top.indices.tolist()):
            for p, tok in zip(values, tokens):
                if p < self.cfg.sibling_ratio * values[0] or len(graph) >= self.cfg.max_nodes:
                    break  # sorted: the rest are below the ratio too
                node = graph.add(v, tok, p)
                if node is not None:
                    new.append(node)
        return new

    # ------------------------------------------------------------------------------------------- after a step

    def verify(self, state: State, proposal: Proposal, logits: torch.Tensor) -> tuple[list[int], int]:
        path, nxt = super().verify(state, proposal, logits)
        if proposal.depth:
            state.tally["steps"] += 1
            state.tally["accepted_through_link"] += not all(state.own[v] for v in path)
            # The draft's cache keeps the accepted nodes it computed in their own context, in order, before the
            # commit cuts it to the committed text; the rest of the accepted text it reads at the next step.
            slot = {g: i + 1 for i, g in enumerate(state.read)}  # cache slot after the pending token's
            kept = [0]
            for v in path[1:]:
                if not state.own[v] or state.origin[v] not in slot:
                    break
                kept.append(slot[state.origin[v]])
            keep_path(state.dcache, state.past, kept)
        return path, nxt

    def extra(self, state: State) -> dict:
        t = state.tally
        steps = max(t["steps"], 1)
        return {"graph_nodes_per_step": t["graph_nodes"] / steps,
                "tree_nodes_per_step": t["tree_nodes"] / steps,
                "merges_per_step": t["merges"] / steps,
                # tokens the target scored that the draft did not compute in that context: copies under merge links
                "reused_nodes_per_step": t["copies"] / steps,
                "draft_forwards_per_step": t["draft_forwards"] / steps,
                "steps_accepted_through_a_link": t["accepted_through_link"] / steps}
