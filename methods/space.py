"""SPACE: the target guesses its next k tokens at k mask tokens, in the forward that verifies its last guesses.

Smart Parallel Auto-Correct dEcoding (Yi et al., ACL 2024 Findings, "Generation Meets Verification: Accelerating
Large Language Model Inference with Smart Parallel Auto-Correct Decoding"). No draft model: k mask tokens
appended to the target's input make it guess the next k tokens in the same forward that verifies the last step's
guesses.

What the paper does:

- SAR-SFT (Sec. 3.1): the LLM is fine-tuned semi-autoregressively: at a random point of an example, k [MASK]
  tokens replace the text and the model learns to predict the tokens they hide (the ordinary AR loss is kept on
  half the examples);
- auto-correct decoding (Sec. 3.2, Alg. 1): each forward feeds the pending token, a group of k masks, then for
  each of the k candidates of the last step the candidate followed by its own group of k masks: (k + 1)^2
  tokens. Candidate c_j attends to the pending token and c_0 .. c_{j-1}; the masks of the group after c_{j-1}
  attend to the same plus their own earlier masks, never to another group; positions are the number of tokens
  each one sees. The target's logits at the pending token and at c_0 .. c_{k-1} verify the candidates (the
  longest prefix equal to the target's choice, then its own token); the group that follows the accepted prefix
  already holds the next k candidates, computed over exactly the text now committed. The first forward is the
  prompt followed by one group. From 1 to k + 1 tokens per forward.

What this harness does (``methods._space`` trains, this file decodes):

- the target stays frozen; only the k mask embeddings are trained, through it, from the teacher store
  (:mod:`methods._space`), and cached by the artifact cache;
- each step is ONE counted target forward over the paper's layout, written as a token tree
  (:func:`layout`: a candidate's parent is the candidate before it, a mask's the mask before it or the
  candidate its group follows), so the shared tree attention mask and positions ``past + depth``
  (:mod:`decoding.tree`) are exactly the paper's; the masks' input embeddings replace the embedding lookup
  of their slots for that forward only (:mod:`core.swapped_embeddings`: a forward hook on the target's input
  embedding, removed after, or an input of a compiled target's graphs), so the target is still called, and
  counted, as every method calls it;
- the candidates are verified with the shared lossless chain verifier (one-hot q: they are the masks' argmax),
  the accepted ones' keys and values are kept (:func:`decoding.tree.keep_path`) and every mask's dropped: the
  target's KV cache holds only committed text. Greedy output equals ``ar``'s; sampled output follows the
  target's distribution.

Where this differs from the paper, and why:

- frozen target, trained mask embeddings (the issue's design): the paper's fine-tuned LLM is a different model
  from the one it started from; here the output must be the target's, and a 135M target cannot be fine-tuned
  on 2 CPU cores in a recipe's time anyway. A frozen model has far less capacity to guess ahead from a few input
  vectors than a fine-tuned one, so acceptance is lower than the paper's;
- k distinct mask embeddings by default (the paper: one [MASK] token; ``recipe.shared: true``);
- sampling: the candidates are the masks' argmax and verified by standard speculative sampling with one-hot q
  (lossless); the paper's sampling mode draws candidates from the masks' distributions and accepts with
  probability p(x) / q_mask(x) on the candidate's own draw, a test whose exactness it does not show;
- the layout shrinks with the budget: only as many candidates as fit in it are verified (and one mask group
  after each), the paper's code decodes past the budget and cuts after.
"""

from __future__ import annotations

import torch
from pydantic import Field

from core.errors import BenchError
from core.metrics import ratio
from decoding.sampling import next_token
from decoding.tree import Tree, keep_path, tree_request, tree_scores
from decoding.verify import verify_chain
from methods._space import SpaceRecipe, space_artifact, untrained_space
from methods.base import DraftVerify, MethodSettings, PromptState
from methods.registry import register
from training.kit import load_or_train, untrained_if_synthetic

MASK = -1  # the token a mask slot holds in a layout's tree (its input is a trained embedding, not a token)


class SpaceSettings(MethodSettings):
    """SPACE's settings (``method.*``)."""

    masks: int = Field(5, ge=1, le=15, description="k: mask tokens per group, candidates verified per target call at "
                       "most (the paper's 5); a call scores (k + 1)^2 tokens (at most 256)")
    recipe: SpaceRecipe = Field(default_factory=SpaceRecipe, description="how the mask embeddings are trained")


def layout(pending: int, candidates: list[int], masks: int) -> tuple[Tree, list[int], list[list[int]]]:
    """The paper's auto-correct input as a token tree: the pending token, then for j = 0 .. a (a =
    ``len(candidates)``) a group of ``masks`` mask slots and, for j < a, candidate c_j.

    Returns ``(tree, chain, groups)``: ``chain`` the nodes of the pending token and c_0 .. c_{a-1} (row v of the
    logits scores the token after node v); ``groups[j]`` the mask nodes of the group that follows c_0 .. c_{j-1}
    (its logits: the next candidates when exactly j are accepted). Mask nodes hold :data:`MASK`. Depths: c_j at
    j + 1, mask i of group j at j + 1 + i, so every node sits at position ``past + depth`` as in the paper.
    """
    tree, chain, groups = Tree(pending), [0], []
    for j in range(len(candidates) + 1):
        node, group = chain[-1], []
        for _ in range(masks):
            node = tree.add_child(node, MASK, source="mask", merge=False)
            group.append(node)
        groups.append(group)
        if j < len(candidates):
            chain.append(tree.add_child(chain[-1], candidates[j], source="candidate", merge=False))
    return tree, chain, groups


@register("space")
class Space(DraftVerify):
    lossless = True  # every candidate is verified by the target: greedy output equals ar's
    Config = SpaceSettings
    label_settings = ("masks",)

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.embeddings: torch.Tensor | None = None
        self.report: dict = {}

    @classmethod
    def has_trained_parts(cls, pair_spec, settings=None) -> bool:
        return True  # the mask embeddings

    @classmethod
    def check_recipe(cls, settings, recipe) -> None:
        k, seq_len = settings.masks, recipe.store.seq_len
        if seq_len < k + 1:  # one token of context, then the k positions the masks guess (_space.random_cuts)
            raise BenchError(f"method={cls.name} trains groups of method.masks={k} masks after at least one token of "
                             f"context; recipe.store.seq_len={seq_len} must be at least {k + 1}.")

    def setup(self, train_if_missing: bool = True) -> None:
        target = self.pair.target.module
        emb, self.report = untrained_if_synthetic(
            self.pair, lambda: untrained_space(target.config, self.cfg.masks, self.cfg.recipe),
            lambda: load_or_train(space_artifact(target, self.pair.tokenizer, self.cfg.masks, self.cfg.recipe,
                                                 self.pair.teacher), self.pair.teacher.cache, train_if_missing))
        with torch.no_grad():
            self.embeddings = emb().to(device=self.pair.device, dtype=self.pair.dtype)  # (k, hidden)

    def masked(self, tokens: list[int]) -> dict:
        """The forward's inputs for ``tokens`` (its ids; mask slots hold :data:`MASK`): ``input_ids (1, n)`` with each
        mask slot as token 0, and ``swap``, the slots and the mask embeddings that replace their lookup (mask i of each
        group, a run of k slots, its i-th): what a forward request carries (``core.swapped_embeddings``)."""
        slots = torch.tensor([t == MASK for t in tokens], device=self.pair.device)
        k = self.embeddings.shape[0]
        which = (torch.cumsum(slots.long(), 0) - 1) % k  # the i-th of its group: groups are whole runs of k
        ids = torch.tensor([[0 if t == MASK else t for t in tokens]], device=self.pair.device)
        return {"input_ids": ids, "swap": (slots, self.embeddings[which])}

    # ------------------------------------------------------------------------------------------- the loop

    class State(PromptState):
        """One prompt's tallies: per mask position the candidates tested and accepted, and the tokens per call."""

        tried: list[int]  # per mask position j: candidates j tested (offered with the j before it accepted)
        hits: list[int]  # ... and accepted
        scored: list[int]  # per target call after the prefill: tokens the target scored

    def steps(self, state: State):
        """Not the base's loop: the prefill itself carries a mask group, and each step's candidates come from the
        previous step's forward, not from a propose() before it. The commit and cache rules are the base's. A
        generator of the target's forwards (:meth:`DraftVerify.steps`), each with its mask slots' embeddings swapped
        in, so that a batch runs every row's in one forward."""
        # setup() loads the trained part before the timed decode; never lazily inside it.
        assert self.embeddings is not None, "call setup() before decode()"
        k = self.cfg.masks
        state.tried, state.hits, state.scored = [0] * k, [0] * k, []
        # The prefill: the prompt, then one group of masks (causal: each mask sees the prompt and the masks before
        # it). Its last k + 1 rows: the target's first token, then the first candidates.
        out = yield {**self.masked(state.seq + [MASK] * k), "logits_to_keep": k + 1}
        logits = out.logits[0]
        candidates = logits[1:].argmax(-1).tolist()
        state.commit([int(next_token(logits[0], state.sampling, state.generator))], drafted=None)  # masks' KV cut
        while not state.done:
            candidates = yield from self.step(state, candidates[: max(state.draft_budget, 0)])
        return state.output(self.extra(state))

    def step(self, state: State, candidates: list[int]):
        """ONE target forward over the layout of ``candidates`` (as many as the budget leaves room for): verify
        them, commit, and return the next candidates (the masks' argmax of the group after the accepted ones). A
        generator of that forward."""
        k, a = self.cfg.masks, len(candidates)
        # With no room left the target's own token is the last one: no candidates to verify, none to make.
        tree, chain, groups = layout(state.seq[-1], candidates, k if state.draft_budget > 0 else 0)
        past = state.cache.get_seq_length()
        inputs = self.masked(tree.tokens)
        filled = tree.fill(inputs["input_ids"][0].tolist())
        out = yield {**tree_request(self.pair.target, past, filled), "swap": inputs["swap"]}
        logits, _ = tree_scores(self.pair.target, filled, None, out, False)
        tokens = torch.tensor(candidates, dtype=torch.long, device=logits.device)
        # Lossless: the longest prefix the target accepts (greedy match, or speculative sampling with one-hot q:
        # the candidates are deterministic), then its own token.
        n, nxt = verify_chain(tokens, None, logits[chain], state.sampling, state.generator)
        for j in range(min(n + 1, a)):  # candidate j was tested when the j before it were accepted
            state.tried[j] += 1
            state.hits[j] += j < n
        state.scored.append(len(tree))
        keep_path(state.cache, past, chain[: n + 1])  # the pending token and the accepted candidates; no mask
        state.commit(candidates[:n] + [nxt], drafted=a)
        return logits[groups[n]].argmax(-1).tolist() if groups[n] else []

    def extra(self, state: State) -> dict:
        calls = len(state.accept_lengths)
        return {
            # candidates accepted per target call after the prefill (the target's own token not counted)
            "accepted_per_call": ratio(sum(state.accept_lengths) - calls, calls),
            # per mask position j: accepted / tested (tested: offered with c_0 .. c_{j-1} accepted)
            "acceptance_by_mask": [ratio(h, t) for h, t in zip(state.hits, state.tried)],
            # tokens the target scores per call after the prefill: (k + 1)^2 with a full set of candidates
            "tokens_per_call": ratio(sum(state.scored), len(state.scored)),
        }
