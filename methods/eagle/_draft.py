"""EAGLE's draft (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"): one
decoder layer that extrapolates the target's features, read by the target's own (frozen) output head.

At position t the draft reads the target's last hidden state f_t (the *feature*: what the target's output head
reads) and the input embedding of the token after it, e(x_{t+1}), fused by one linear layer ``fc`` (2H -> H),
and runs one decoder layer of the target's own class over the sequence of such inputs (a KV cache of its own
while decoding). Its output is its guess of f_{t+1}; the target's output head turns that into a distribution
over x_{t+2}. Drafting deeper feeds the draft its own guessed features (EAGLE's autoregression over features).

Training (EAGLE, Sec. 3.2-3.3), from the teacher store's stored features, the target never running:
``v_weight * SmoothL1(f^_{t+1}, f_{t+1}) + p_weight * CE(softmax(head(f_{t+1})), softmax(head(f^_{t+1})))``
(the paper's weights: 1.0 and 0.1), with uniform noise U(-noise, noise) added to the input features (the paper's 0.1)
so the draft learns to read features that are slightly off, as its own are when it drafts deeper.

Where this differs from the paper, and why (the README's table says it too):

- the head is the target's output rows over a reduced vocabulary (``recipe.vocab`` most frequent stored tokens,
  as the harness's heads and distilled drafts; EAGLE-3 does the same): on a CPU the full 49k-row head would
  cost the draft four times its decoder layer. Candidates outside it are never proposed; verification stays
  lossless;
- the decoder layer is built by transformers from the target's config, so it keeps its input norm (EAGLE drops
  the first layer's) and a final norm;
- the cross-entropy weighs 1.0, not 0.1: from ~10^5 teacher tokens (ShareGPT gives the paper ~10^7) the
  token loss is what teaches acceptance (README: measured), the feature loss still shapes deeper drafting.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from core.artifacts import Artifact, jsonable
from core.counting import CountedLM
from core.kv_cache import lm_forward
from core.model_parts import body_config, copy_last_layers
from training.adversarial import Adversary, AdversaryRecipe
from training.kit import (
    answer_rows,
    budget,
    feature_stores,
    fit_and_measure,
    module_artifact,
    part_epochs,
    part_key,
    store_data,
    store_vocab,
    trained_part,
    training_start,
    untrained_vocab,
)
from training.loop import TrainRecipe
from training.store import tokenizer_key
from training.teacher import Teacher


@trained_part("eagle")
class EagleRecipe(TrainRecipe):
    """How EAGLE's draft layer is trained (cached under cache_dir/eagle/, keyed by the target, this recipe, the
    tokenizer and the run's training recipe)."""

    EPOCHS = {"smoke": 1, "quick": 6, "full": 8}  # the paper: 20

    lr: float = Field(2.0e-3, gt=0, description="AdamW learning rate (one-cycle schedule)")
    vocab: int = Field(8192, ge=1, description="the draft proposes from the most frequent stored tokens only "
                       "(verification stays lossless; the paper uses the whole vocabulary)")
    v_weight: float = Field(1.0, ge=0, description="weight of the feature regression (smooth L1)")
    p_weight: float = Field(1.0, ge=0, description="weight of the cross-entropy against the target's distribution "
                            "(the paper: 0.1; 1.0 learns faster from 10^5 teacher tokens, README)")
    noise: float = Field(0.1, ge=0, description="uniform noise U(-noise, noise) on the input features")
    init: Literal["random", "target"] = Field("random", description="the decoder layer starts from random "
                                              "weights (the paper), or from the target's last layer")
    layers: int = Field(1, ge=1, description="decoder layers of the draft (EAGLE: 1; KOALA: K)")
    adversarial: AdversaryRecipe | None = Field(None, description="KOALA's adversarial learning beside the "
                                                "supervised loss (koala's default; null: none)")


class EagleDraft(nn.Module):
    """``fc`` (2H -> H), a ``body`` of ``layers`` decoder layers (the target's class; its final norm included;
    EAGLE's is one, KOALA's K) and the frozen ``head`` (the target's output rows of ``vocab_map``,
    ``LongTensor (V',)`` of full-vocabulary ids).

    ``published``: the authors' layer as their ``cnets.py`` builds it (their weights, ``method.weights``): the
    ``body`` from their ``config.json`` (given as ``config``), no input norm in its first layer and no final norm,
    ``fc`` with a bias or not as their config says, and a token embedding of its own (``embed``, the copy their
    file holds) instead of the target's.
    """

    def __init__(self, target_config, vocab_map: torch.Tensor, layers: int = 1, config=None, bias: bool = True,
                 published: bool = False):
        super().__init__()
        from transformers import AutoModel

        hidden = target_config.hidden_size
        self.config = config if config is not None else body_config(target_config, layers)
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        self.body = AutoModel.from_config(self.config).float()
        self.published = published
        self.embed = None
        if published:
            self.body.layers[0].input_layernorm = nn.Identity()
            self.body.norm = nn.Identity()
            self.embed = nn.Embedding(target_config.vocab_size, hidden).requires_grad_(False)
        self.head = nn.Linear(hidden, vocab_map.numel(), bias=False).requires_grad_(False)
        self.register_buffer("vocab_map", vocab_map.long(), persistent=True)

    @classmethod
    def from_target(cls, target, vocab_map: torch.Tensor, init: str = "random", layers: int = 1) -> EagleDraft:
        draft = cls(target.config, vocab_map, layers)
        if init == "target":
            copy_last_layers(draft.body, target)
        draft.head.weight.data.copy_(target.get_output_embeddings().weight.data[vocab_map.to(target.device)].cpu())
        return draft

    # What core.compiled.CompiledLM reads of a causal LM, so that a batch runs the draft's forwards on a batch cache:
    # the decoder (the body), its output head, and token embeddings, which every real row of its forwards replaces by
    # ``fc``'s fused input (``swap``); the body's own embedding table is read only by padding rows and by the check.

    def get_decoder(self) -> nn.Module:
        return self.body

    def get_input_embeddings(self) -> nn.Embedding:
        return self.body.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def fused(self, feats: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``fc``'s input for the body, ``(..., H)``, from ``feats`` and ``emb`` ``(..., H)`` each (in a batch it is
        swapped in for the body's token embeddings; counted with the forward that reads it: ``fc`` is in the role's
        FLOP formula)."""
        return self.fc(torch.cat([feats, emb], dim=-1))

    def forward(self, feats: torch.Tensor, emb: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
        """``feats (B, n, H)`` the features at n positions and ``emb (B, n, H)`` the embeddings of the tokens after
        them -> ``(B, n, H)`` the guessed features one position later. ``cache``: the layer's KV cache of the
        earlier positions, extended in place (``None``: the whole sequence at once, as in training);
        ``kwargs``: ``attention_mask`` / ``position_ids`` (a draft tree)."""
        out = lm_forward(self.body, None, cache, inputs_embeds=self.fused(feats, emb), **kwargs)
        return out.last_hidden_state


class CountedEagle(CountedLM):
    """The ``eagle`` role: ``draft(feats (1, n, H), emb (1, n, H), cache, rows, **kw)`` returns the guessed
    features ``(1, n, H)`` and the head's logits ``(1, rows, V')`` of the last ``rows`` positions (a catch-up
    over the committed positions needs only the last), counted as such (FLOPs by :mod:`core.flops`: ``fc``, the
    body, the head). In a batch its forwards run as a causal LM's on its batch cache (:meth:`CountedLM.forward_rows`,
    each row's input ``fc``'s fused features in place of token embeddings: :meth:`EagleDraft.fused`)."""

    def __init__(self, draft: EagleDraft):
        super().__init__(draft, "eagle")  # its head's weights: CountedLM reads them from get_output_embeddings

    def fused(self, feats: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """:meth:`EagleDraft.fused` (``fc`` is in the role's formula: counted with the forward that reads it)."""
        return self.module.fused(feats, emb)

    def __call__(self, feats, emb, cache, rows: int, **kwargs):
        n = feats.shape[1]
        self._count(1, n, cache.get_seq_length() + n, head_rows=rows)
        out = self.module(feats, emb, cache, **kwargs)
        return out, self.module.head(out[:, n - rows :])


# --------------------------------------------------------------------------------------------- training


def eagle_loss(draft: EagleDraft, batch: dict, embed, recipe, adversary: Adversary | None = None) -> torch.Tensor:
    """EAGLE's loss over a store batch (``ids (B, T)``, ``mask (B, T)``, ``hidden (B, T, H)``): at every position t
    where t and t + 1 are text, the guess of f_{t+1} from (f_t + noise, x_{t+1}); with an ``adversary``
    (KOALA), plus its term on the draft's next-token distribution (the target's being real)."""
    hidden, ids, mask = batch["hidden"].float(), batch["ids"], batch["mask"]
    feats = hidden[:, :-1]
    if recipe.noise > 0:
        feats = feats + (torch.rand_like(feats) * 2 - 1) * recipe.noise
    with torch.no_grad():  # the target's embedding is frozen: no gradient for it (a vocabulary-sized one)
        emb = embed(ids[:, 1:])
    guess = draft(feats, emb)  # (B, T - 1, H)
    true = hidden[:, 1:]
    keep = (mask[:, :-1] & mask[:, 1:]).float()
    reg = nn.functional.smooth_l1_loss(guess, true, reduction="none").mean(-1)
    with torch.no_grad():
        p = torch.softmax(draft.head(true), -1)
    logq = torch.log_softmax(draft.head(guess), -1)
    ce = -(p * logq).sum(-1)
    per_pos = recipe.v_weight * reg + recipe.p_weight * ce
    loss = (per_pos * keep).sum() / keep.sum().clamp_min(1)
    if adversary is not None:
        loss = loss + adversary.term(logq, lambda rows: p[rows], keep.bool())
    return loss


def eagle_judge(draft: EagleDraft, store, embed, device=None):
    """:func:`training.kit.agreement`'s judge for EAGLE's draft: is its greedy token from (f_t, x_{t+1}) the
    target's greedy token after t + 1 (the acceptance of a depth-1 draft token)?"""

    def judge(rows: torch.Tensor) -> list[tuple]:
        b = {n: t.to(device) for n, t in store.rows(rows, ("ids", "idx", "mask", "hidden", "answer")).items()}
        guess = draft(b["hidden"][:, :-1].float(), embed(b["ids"][:, 1:]))
        hit = draft.vocab_map[draft.head(guess).argmax(-1)] == b["idx"][:, 1:, 0]
        counted = b["mask"][:, :-1] & b["mask"][:, 1:]
        return [(hit, counted, counted & b["answer"][:, 1:])]

    return judge


def train_eagle(target, tokenizer, recipe: EagleRecipe, teacher: Teacher) -> tuple[EagleDraft, dict]:
    """Train EAGLE's draft layer from the teacher store's features of the frozen target; returns it (on the
    CPU, fp32) and a report (held-out depth-1 agreement before and after, on all text and on the target's own
    answers)."""
    target, device = training_start(target, recipe.seed)
    train, held = feature_stores(target, tokenizer, teacher, "EAGLE reads")
    cols = store_data(train, ("ids", "idx", "mask"))
    vocab_map = store_vocab(tokenizer, cols, recipe.vocab, target.config.vocab_size)
    layers = recipe.layers
    draft = EagleDraft.from_target(target, vocab_map, recipe.init, layers).to(device)
    adversarial = recipe.adversarial
    adversary = (Adversary(len(vocab_map), AdversaryRecipe.model_validate(jsonable(adversarial)), device)
                 if adversarial else None)
    embed = target.get_input_embeddings()

    def step(rows: torch.Tensor) -> torch.Tensor:
        batch = {n: t.to(device) for n, t in train.rows(rows, ("ids", "mask", "hidden")).items()}
        return eagle_loss(draft, batch, embed, recipe, adversary)

    what = "the draft layer" if layers == 1 else f"the draft's {layers} layers"
    report = fit_and_measure(
        [draft], step, examples=len(train), judge=lambda: eagle_judge(draft, held, embed, device), held=len(held),
        answer_rows=answer_rows(held),
        epochs=part_epochs("eagle", recipe, teacher), batch_size=recipe.batch_size, lr=recipe.lr,
        desc=f"eagle: training {what}" + (" against a discriminator" if adversary is not None else ""))
    report.update(
        layers=layers,
        **(adversary.report() if adversary is not None else {}),
        recipe=teacher.recipe.name,
        train_tokens=int(cols["mask"].sum()),
        vocab=int(vocab_map.numel()),
    )
    return draft.cpu(), report


# --------------------------------------------------------------------------------------------- caching


def eagle_artifact(target, tokenizer, recipe: EagleRecipe, teacher: Teacher, method: str = "eagle") -> Artifact:
    """EAGLE's draft of (target, recipe, tokenizer, the run's training recipe) as a cached artifact: ``eagle.pt``.
    ``method``: what trains it, as a missing draft's message names it (``koala method.base=eagle`` trains a KOALA draft here too)."""
    key = {"recipe": part_key(recipe, layers=1, adversarial=None),
           "teacher": budget(teacher, part_epochs("eagle", recipe, teacher)), **tokenizer_key(tokenizer)}
    return module_artifact("eagle", target, key, lambda: train_eagle(target, tokenizer, recipe, teacher),
                          lambda vocab_map, layers: EagleDraft(target.config, vocab_map, layers),
                          trained_by=method,
                          description="EAGLE draft layer" if recipe.layers == 1 else "EAGLE draft")


def untrained_eagle(target_config, recipe: EagleRecipe) -> EagleDraft:
    """The draft :func:`train_eagle` would train, untrained: a synthetic pair's (:func:`training.kit.untrained_if_synthetic`)."""
    return EagleDraft(target_config, untrained_vocab(recipe.vocab, target_config.vocab_size), recipe.layers).eval()
