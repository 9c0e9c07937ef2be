"""SPACE's trained part: k mask-token input embeddings that make the frozen target semi-autoregressive.

Mask j (j = 0 .. k-1), placed at position n + j after a context of n tokens (the last one at n - 1), is a
placeholder for the unknown token x_{n+j}; the target's output there is read as a guess of x_{n+j+1}. The masks
of one group attend to the context and causally to each other (mask j sees masks 0 .. j), never to anything
after the context, so the target's own next token x_n (from position n - 1) and the k masks' guesses of
x_{n+1} .. x_{n+k} come from ONE forward.

Training (this harness's version of the paper's SAR-SFT, Sec. 3.1): the target is frozen and only the mask
embeddings learn. From the teacher store's rows (teacher-forced text and the target's own answers), ``recipe.cuts``
random cut points n per row; the row's prefix is run once without gradients (the target's KV cache of the
whole row), then every cut's mask group in one forward over that cache under a block mask (group i sees the
row's positions < n_i and its own earlier masks), and the loss is the cross-entropy of mask j's distribution
against the target's stored top-k distribution at position n + j (its next-token distribution after x_{n+j},
renormalised over the stored top-k): the distribution verification will compare the candidate with. The
gradient reaches the embeddings through the frozen target; no weight of the target changes.

Where this differs from the paper, and why:

- the target's weights stay frozen (the paper fine-tunes the whole LLM, 2 epochs on Alpaca-GPT4 + LIMA, with
  the AR loss kept on half the examples so its output does not change much): here the target must stay the
  target, so decoding is lossless with respect to it, and its greedy output equals ``ar``'s;
- k distinct mask embeddings by default (the paper's released recipe uses one [MASK] token for every mask,
  ``mask_diff=false``; ``recipe.shared: true`` does that here): with the target frozen, the embeddings are the
  only capacity there is, and distinct ones let each mask position learn its own offset;
- labels: the target's own stored distribution (as every trainer here reads the teacher store), not the
  training text's next tokens: it is what verification accepts;
- initialisation: every embedding starts at the mean of the target's input embeddings (what transformers'
  ``resize_token_embeddings`` gives a new token, which is how the paper adds its [MASK]).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn
from transformers import DynamicCache

from core.artifacts import Artifact, model_fingerprint
from core.kv_cache import lm_forward
from decoding.cache import truncate_cache
from training.kit import (
    answer_rows,
    budget,
    fit_and_measure,
    part_artifact,
    part_epochs,
    part_key,
    trained_part,
    training_start,
)
from training.loop import TrainRecipe
from training.store import TeacherStore, tokenizer_key
from training.teacher import Teacher

FIELDS = ("ids", "mask", "idx", "prob")  # what training reads of the store (no hidden states)


@trained_part("space")
class SpaceRecipe(TrainRecipe):
    """How SPACE's mask embeddings are trained (cached under cache_dir/space/, keyed by the target, ``method.masks``,
    this recipe, the tokenizer and the run's training recipe)."""

    EPOCHS = {"smoke": 2, "quick": 1, "full": 1}  # each a backward pass through the frozen target

    lr: float = Field(1.0e-2, gt=0, description="AdamW learning rate (one-cycle schedule): only k embedding "
                      "vectors learn, so a prompt-tuning rate")
    cuts: int = Field(16, ge=1, description="cut points (mask groups) per stored sequence per step, each k more "
                      "positions through the target with gradients")
    shared: bool = Field(False, description="one embedding for every mask position (the paper's single [MASK] "
                         "token) instead of k distinct ones")


class MaskEmbeddings(nn.Module):
    """The k mask tokens' input embeddings: ``forward() -> FloatTensor (k, hidden)`` (one row repeated when shared)."""

    def __init__(self, masks: int, hidden: int, shared: bool = False):
        super().__init__()
        self.masks = masks
        self.weight = nn.Parameter(torch.zeros(1 if shared else masks, hidden))

    @classmethod
    def from_target(cls, target, masks: int, shared: bool = False) -> MaskEmbeddings:
        """Every row at the mean of the target's input embeddings (a new token's start in the paper)."""
        emb = target.get_input_embeddings().weight.detach().float()
        out = cls(masks, emb.shape[1], shared)
        with torch.no_grad():
            out.weight.copy_(emb.mean(0).expand_as(out.weight))
        return out

    def forward(self) -> torch.Tensor:
        return self.weight.expand(self.masks, -1)


# --------------------------------------------------------------------------------------------- the forward


def group_mask(cuts: torch.Tensor, masks: int, past: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask ``(B, 1, m*k, past + m*k)`` for ``m`` mask groups of ``k = masks`` over a cache of
    ``past`` positions: the masks of group i (cut ``cuts[b, i]``) see the cached positions ``< cuts[b, i]`` and
    their own group's masks up to themselves. ``cuts``: ``LongTensor (B, m)``."""
    B, m = cuts.shape
    n = m * masks
    prefix = torch.arange(past, device=cuts.device)[None, None] < cuts.repeat_interleave(masks, 1)[..., None]
    own = torch.block_diag(*[torch.ones(masks, masks, dtype=torch.bool, device=cuts.device).tril()] * m)
    allowed = torch.cat([prefix, own.expand(B, n, n)], dim=-1)
    out = torch.zeros(allowed.shape, dtype=dtype, device=cuts.device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[:, None]


def row_cache(target, ids: torch.Tensor) -> DynamicCache:
    """The target's KV cache of ``ids (B, T)`` (causal; right padding changes nothing before it), no gradients;
    the output head is not run."""
    cache = DynamicCache()
    with torch.no_grad():
        lm_forward(target.base_model, ids, cache)
    return cache


def group_logits(target, cache: DynamicCache, cuts: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """Mask logits ``(B, m, k, vocab)`` of the groups at ``cuts (B, m)`` over ``cache`` (the rows' positions),
    embeddings ``emb (k, hidden)``; the cache is cropped back afterwards. Gradients reach ``emb`` when enabled."""
    B, m = cuts.shape
    k = emb.shape[0]
    past = cache.get_seq_length()
    x = emb.to(next(target.parameters()).dtype)[None, None].expand(B, m, k, -1).reshape(B, m * k, -1)
    pos = (cuts[..., None] + torch.arange(k, device=cuts.device)).reshape(B, m * k)
    mask = group_mask(cuts, k, past, x.dtype)
    try:
        out = lm_forward(target, None, cache, inputs_embeds=x, position_ids=pos, attention_mask=mask)
    finally:
        truncate_cache(cache, past)  # the masks' keys and values never stay
    return out.logits.view(B, m, k, -1)


def random_cuts(mask: torch.Tensor, masks: int, per_row: int, generator: torch.Generator | None = None):
    """``(cuts (B, m), valid (B, m))``: cut points n with the context x_0 .. x_{n-1} and the labels at n .. n+k-1
    inside the row's text (``mask (B, T)``: text, then padding); a row too short for one group is not valid."""
    length = mask.sum(-1, keepdim=True)  # (B, 1)
    span = (length - masks).clamp_min(1)  # cuts in [1, length - k]
    u = torch.rand(mask.shape[0], per_row, generator=generator).to(mask.device)
    cuts = 1 + (u * span).long().clamp_max(span - 1)
    return cuts, (length >= masks + 1).expand_as(cuts)


def label_positions(cuts: torch.Tensor, masks: int, length: int) -> torch.Tensor:
    """``(B, m * k)``: the positions ``cuts + j`` whose stored labels mask j guesses, inside rows of ``length``."""
    B, m = cuts.shape
    pos = (cuts[..., None] + torch.arange(masks, device=cuts.device)).reshape(B, m * masks)
    return pos.clamp_max(length - 1)


def labels_at(batch: dict, cuts: torch.Tensor, masks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored top-k ``(idx, prob)``, each ``(B, m, k, topk)``, at positions ``cuts + j``: the target's next-token
    distribution there, which mask j guesses."""
    B, m = cuts.shape
    pos = label_positions(cuts, masks, batch["idx"].shape[1])
    take = pos[..., None].expand(-1, -1, batch["idx"].shape[-1])
    return (batch["idx"].gather(1, take).view(B, m, masks, -1), batch["prob"].gather(1, take).view(B, m, masks, -1))


def space_loss(target, emb: MaskEmbeddings, batch: dict, cuts_per_row: int, generator=None) -> torch.Tensor:
    """Mean over valid groups and mask positions of the cross-entropy of mask j's distribution against the
    target's stored top-k distribution at n + j (renormalised)."""
    k = emb.masks
    cuts, valid = random_cuts(batch["mask"], k, cuts_per_row, generator)
    cache = row_cache(target, batch["ids"])
    logp = torch.log_softmax(group_logits(target, cache, cuts, emb()).float(), -1)  # (B, m, k, V)
    idx, prob = labels_at(batch, cuts, k)
    prob = prob / prob.sum(-1, keepdim=True).clamp_min(1e-9)
    ce = -(prob * logp.gather(-1, idx)).sum(-1)  # (B, m, k)
    w = valid[..., None].float().expand_as(ce)
    return (ce * w).sum() / w.sum().clamp_min(1)


def space_judge(target, emb: MaskEmbeddings, store: TeacherStore, cuts_per_row: int, seed: int = 0):
    """:func:`training.kit.agreement`'s judge for SPACE's masks, one output per mask j: at ``cuts_per_row`` seeded
    cuts n per row, is mask j's greedy token the target's greedy token after x_{n+j} (the chance that candidate
    j is right given that the ones before it were)? Fresh per measurement: the cuts follow its own generator."""
    device = next(target.parameters()).device
    k = emb.masks
    gen = torch.Generator().manual_seed(seed)

    def judge(rows: torch.Tensor) -> list[tuple]:
        batch = {n: t.to(device) for n, t in store.rows(rows, (*FIELDS, "answer")).items()}
        cuts, valid = random_cuts(batch["mask"].cpu(), k, cuts_per_row, gen)
        cuts, valid = cuts.to(device), valid.to(device)
        guess = group_logits(target, row_cache(target, batch["ids"]), cuts, emb().to(device)).argmax(-1)
        counted = valid[..., None].expand(-1, -1, k)  # (B, m, k)
        # Mask j's label sits at cut + j: the answer-token figure counts it where that label is the answer's.
        on_answer = counted & answer_at(batch["answer"], cuts, k)
        hit = guess == labels_at(batch, cuts, k)[0][..., 0]  # (B, m, k)
        return [(hit[..., j], counted[..., j], on_answer[..., j]) for j in range(k)]

    return judge


def answer_at(answer: torch.Tensor, cuts: torch.Tensor, masks: int) -> torch.Tensor:
    """``(B, m, k)``: whether the label of mask j at cut n (position n + j) is the target's own answer token
    (``answer (B, T)``, the store's answer mask)."""
    B, m = cuts.shape
    return answer.gather(1, label_positions(cuts, masks, answer.shape[1])).view(B, m, masks)


class frozen:
    """``with frozen(module):`` its parameters take no gradient inside (restored after): the embeddings' gradient
    passes through the target, but none is built for its weights (a vocabulary-sized one for its embedding)."""

    def __init__(self, module: nn.Module):
        self.params = list(module.parameters())

    def __enter__(self):
        self.flags = [p.requires_grad for p in self.params]
        for p in self.params:
            p.requires_grad_(False)

    def __exit__(self, *exc):
        for p, flag in zip(self.params, self.flags):
            p.requires_grad_(flag)


def train_space(target, tokenizer, masks: int, recipe: SpaceRecipe, teacher: Teacher) -> tuple[MaskEmbeddings, dict]:
    """Train the ``masks`` mask embeddings through the frozen ``target`` from the teacher store; returns them (CPU,
    fp32) and a report: held-out agreement per mask position before and after, on all text and on the target's
    own answers."""
    target, device = training_start(target, recipe.seed)
    train, held = teacher.store(target, tokenizer, "train"), teacher.store(target, tokenizer, "test")
    emb = MaskEmbeddings.from_target(target, masks, bool(recipe.shared)).to(device)
    bs, cuts = recipe.batch_size, recipe.cuts
    with frozen(target):
        report = fit_and_measure(
            [emb], lambda rows: space_loss(target, emb, {n: t.to(device) for n, t in train.rows(rows, FIELDS).items()},
                                           cuts),
            examples=len(train), judge=lambda: space_judge(target, emb, held, cuts), held=len(held),
            answer_rows=answer_rows(held),
            epochs=part_epochs("space", recipe, teacher), batch_size=bs, lr=recipe.lr,
            desc=f"space: training {masks} mask embeddings through the frozen target")
    report.update(masks=masks, recipe=teacher.recipe.name, train_tokens=int(train.tokens))
    return emb.cpu().eval(), report


# --------------------------------------------------------------------------------------------- caching


def space_artifact(target, tokenizer, masks: int, recipe: SpaceRecipe, teacher: Teacher) -> Artifact:
    """SPACE's mask embeddings of (target, masks, recipe, tokenizer, the run's training recipe): ``space.pt``."""
    ident = model_fingerprint(target)
    hidden = target.config.hidden_size

    def load(blob: dict) -> MaskEmbeddings:
        if blob["hidden"] != hidden or blob["masks"] != masks:
            raise ValueError(f"it holds {blob['masks']} masks of size {blob['hidden']}, not {masks} of {hidden}")
        emb = MaskEmbeddings(masks, hidden, blob["state"]["weight"].shape[0] == 1 and masks > 1)
        emb.load_state_dict(blob["state"])
        return emb.eval()

    key = {"target": ident, "masks": masks, "recipe": part_key(recipe),
           "teacher": budget(teacher, part_epochs("space", recipe, teacher)), **tokenizer_key(tokenizer)}
    return part_artifact("space", f"space-{ident['name']}", key,
                         lambda: train_space(target, tokenizer, masks, recipe, teacher),
                         lambda emb: {"hidden": hidden, "masks": masks, "state": emb.state_dict()}, load, "space.pt",
                         trained_by="space", same=("method.masks",),
                         description="SPACE mask embeddings")


def untrained_space(target_config, masks: int, recipe: SpaceRecipe) -> MaskEmbeddings:
    """The mask embeddings :func:`train_space` would train, untrained (at zero): a synthetic pair's
    (:func:`training.kit.untrained_if_synthetic`)."""
    return MaskEmbeddings(masks, target_config.hidden_size, bool(recipe.shared)).eval()
