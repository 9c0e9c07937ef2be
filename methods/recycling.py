"""Token Recycling (Luo et al. 2024, "Turning Trash into Treasure: Accelerating Inference of Large Language Models
with Token Recycling"): no draft model and no training. The target's top-k next tokens at every position it
scores, which plain decoding throws away, are kept in an adjacency matrix ``M (vocab, k)``: row t holds the k
tokens the target last thought most likely after t. A static tree template of rank paths (the paper's 80-node
"2.2.2", Spec-Bench's; here "cpu-4" by default, measured on a CPU) is filled breadth-first from the matrix (node
``(r1, ..., rd)`` holds ``M[token of its parent, rd]``), rooted at the pending token, and scored in ONE target
forward; the shared tree verifier keeps the longest path the target agrees with. Then the row of every scored
node's token is overwritten with that node's top-k from the same forward, accepted or not (the recycled
"trash").

The matrix starts empty (every row token 0, as the authors' code starts it). The paper carries it from one query
to the next; here that would make a prompt's result depend on the prompts (and the warm-up) run before it, so
each prompt starts from an empty matrix by default and ``carry: true`` keeps one matrix across prompts (the
paper's setting). Rows in tables name which was used. With ``from_prompt`` (the default) the prefill's top-k at
every prompt position fills the rows of the prompt's tokens first, as the SAM-Decoding authors' Token Recycling
drafter does (their ``prefill``); Spec-Bench's own Token Recycling run does not (``from_prompt: false``). A token
scored at several positions of one forward keeps the last one's row, as both authors' updates leave it.

The drafter is deterministic, so for sampling its proposal distribution is one-hot and the tree verifier's
recursive rejection is exact: lossless (greedy output equals ``ar``).
"""

from __future__ import annotations

import torch
from pydantic import Field, NonNegativeInt, model_validator

from decoding.tree import Tree
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register

# The paper's tree template "2.2.2" (Spec-Bench's default): 80 rank paths in breadth-first order, depth 6; a
# node (r1, ..., rd) is the rd-th candidate of the token at (r1, ..., r(d-1)).
TEMPLATE_2_2_2 = [
    [0], [1], [2], [3], [4], [5], [6], [7],
    [0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 6], [0, 7], [1, 0], [1, 1], [1, 2], [1, 3], [2, 0], [2, 1],
    [2, 2], [3, 0], [3, 1], [4, 0], [5, 0], [6, 0], [7, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 0, 4], [0, 0, 5], [0, 0, 6], [0, 0, 7], [0, 1, 0], [0, 1, 1],
    [0, 1, 2], [0, 2, 0], [0, 2, 1], [0, 3, 0], [0, 4, 0], [0, 5, 0], [0, 6, 0], [0, 7, 0], [1, 0, 0], [1, 0, 1],
    [1, 1, 0], [2, 0, 0], [3, 0, 0], [4, 0, 0], [5, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 3], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 2, 0],
    [0, 0, 3, 0], [0, 0, 4, 0], [0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 0, 1, 0, 0],
    [0, 1, 0, 0, 0], [1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0],
]
# The CPU default (README, docs/methods/recycling.md): 4 nodes, the best of seven shapes measured on this harness's
# 2-core CPU with SmolLM2-135M, where every scored token costs (the 80-node template ran at 0.67x ar there).
TEMPLATE_CPU_4 = [[0], [1], [0, 0], [0, 0, 0]]
TEMPLATES = {"2.2.2": TEMPLATE_2_2_2, "cpu-4": TEMPLATE_CPU_4}


@register("recycling")
class Recycling(DraftVerify):
    lossless = True
    label_settings = ("tree", "carry")  # a row always says which tree ran and whether the matrix was carried

    class Config(MethodSettings):
        topk: int = Field(8, ge=1, description="candidates kept per token: the adjacency matrix's columns (the "
                          "paper: 8)")
        tree: str | list[list[NonNegativeInt]] = Field(
            "cpu-4", description="the tree template: a name (2.2.2: the paper's 80 nodes, Spec-Bench's; cpu-4: "
            "4 nodes, measured best on a 2-core CPU) or rank paths [[0], [1], [0, 0], ...], each rank below topk")
        carry: bool = Field(False, description="keep one matrix from prompt to prompt (the paper); false: each "
                            "prompt starts from an empty one, so its result does not depend on the prompts before")
        from_prompt: bool = Field(True, description="the prefill's top-k at every prompt position fills the "
                                  "matrix first (SAM-Decoding's Token Recycling; Spec-Bench's run: false)")

        @model_validator(mode="after")
        def template_fits_topk(self):
            if isinstance(self.tree, str) and self.tree not in TEMPLATES:
                raise ValueError(f"tree '{self.tree}' is not a known template ({', '.join(TEMPLATES)}); give rank "
                                 "paths for another shape")
            top = max(max(p) for p in self.paths()) if self.paths() else -1
            if top >= self.topk:
                raise ValueError(f"the tree uses rank {top} but the matrix keeps only topk={self.topk} candidates "
                                 "per token")
            return self

        def paths(self) -> list[list[int]]:
            return TEMPLATES[self.tree] if isinstance(self.tree, str) else self.tree

    class State(PromptState):
        """One prompt's matrix (the method's own when ``carry``) and the tree sizes scored."""

        matrix: torch.Tensor  # (vocab, topk) LongTensor on the device: row t = the target's last top-k after t
        nodes: list[int]  # tokens the target scored at each call

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.shape = Tree.from_paths(self.cfg.paths())
        self.shapes = {d: self.shape.prune(d) for d in range(self.shape.max_depth + 1)}  # pruned near the budget
        # Breadth-first shapes: a pruned one is a prefix of the nodes, so one index serves them all.
        device = pair.device
        self.parent = torch.tensor(self.shape.parent, device=device).clamp(min=0)  # (nodes,) the root's: itself
        self.rank = torch.tensor([p[-1] if p else 0 for p in self.shape.paths], device=device)  # (nodes,)
        depth = torch.tensor(self.shape.depth)
        self.levels = [torch.nonzero(depth == d).flatten().to(device) for d in range(1, self.shape.max_depth + 1)]
        self.carried: torch.Tensor | None = None  # the one matrix of every prompt when carry: true
        self.prompt_logits = self.cfg.from_prompt  # the base loop keeps the prefill's logits at every position

    def start(self, state: State) -> None:
        if self.cfg.carry and self.carried is not None:
            state.matrix = self.carried
        else:
            vocab = self.pair.target.module.get_output_embeddings().weight.shape[0]  # the logits' width
            state.matrix = torch.zeros(vocab, self.cfg.topk, dtype=torch.long, device=state.device)
            if self.cfg.carry:
                self.carried = state.matrix
        if self.cfg.from_prompt:
            recycle(state.matrix, state.seq, state.prompt_logits)
        state.nodes = []

    def propose(self, state: State) -> Proposal:
        shape = self.shapes[min(state.draft_budget, self.shape.max_depth)]
        state.nodes.append(len(shape))
        if len(shape) == 1:
            return Proposal(Tree(state.seq[-1]))
        return Proposal(shape.fill(self.fill(state.matrix, state.seq[-1], shape)))

    def fill(self, matrix: torch.Tensor, pending: int, shape: Tree) -> list[int]:
        """The tokens of ``shape``'s nodes (``pending`` at the root), breadth-first from ``matrix``: one gather
        per depth on the device, one transfer at the end."""
        tokens = torch.empty(len(shape), dtype=torch.long, device=matrix.device)
        tokens[0] = pending
        flat, k = matrix.view(-1), matrix.shape[1]
        for nodes in self.levels[: shape.max_depth]:
            tokens[nodes] = flat[tokens[self.parent[nodes]] * k + self.rank[nodes]]
        return tokens.tolist()

    def verify(self, state: State, proposal: Proposal, logits: torch.Tensor) -> tuple[list[int], int]:
        recycle(state.matrix, proposal.tree.tokens, logits)  # every scored node's top-k, accepted or not
        return super().verify(state, proposal, logits)

    def extra(self, state: State) -> dict:
        return {
            "tree_size": len(self.shape),  # tokens the target scores per call (root included), before budget pruning
            "tree_tokens_per_call": sum(state.nodes) / len(state.nodes) if state.nodes else float("nan"),
            "matrix": "carried" if self.cfg.carry else "per prompt",
        }


def recycle(matrix: torch.Tensor, tokens: list[int], logits: torch.Tensor) -> None:
    """Overwrite ``matrix`` (``(vocab, k)``) row ``tokens[i]`` with the top-k of ``logits[i]`` (``(len(tokens),
    vocab)``), for every i; a token at several positions keeps the last one's (deterministic, where an indexed
    write with repeated indices is not)."""
    last = {t: i for i, t in enumerate(tokens)}
    rows = torch.tensor(list(last.values()), device=logits.device)
    ids = torch.tensor(list(last.keys()), device=logits.device)
    matrix[ids] = logits[rows].topk(matrix.shape[1], dim=-1).indices
