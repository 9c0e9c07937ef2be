"""A draft made by the harness: a few of the target's own layers with its embedding and final norm, and an
output head over a reduced drafting vocabulary, distilled to match the target's next-token distribution.

Why this design (measured on 2 CPU cores, SmolLM2-135M, fp32): a forward of one token through the target
costs ~65 ms, of which ~9 ms is the 49,152-way output head and ~1.8 ms each of the 30 layers. A draft of
a few layers with the full head would spend most of its time in the head, so it drafts over the V most
frequent tokens only (8,192 by default: ~1/6 of the head's cost). The draft's logits are scattered back
into the full vocabulary (-inf elsewhere), so verification stays exactly lossless: greedily the target
just rejects a token the draft cannot propose, and for sampling q(x) = 0 outside the subset, which the
rejection rule handles exactly.
"""

from __future__ import annotations

import logging

import torch
from pydantic import Field, NonNegativeInt
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from core.artifacts import (
    Artifact,
    model_fingerprint,
    report_of,
)
from core.errors import BenchError
from core.kv_cache import cache_of, lm_forward, output_with_cache
from core.model_parts import copy_from
from training.kit import (
    answer_rows,
    budget,
    fit_and_measure,
    part_artifact,
    part_epochs,
    part_key,
    store_data,
    store_vocab,
    sub_index,
    trained_part,
    training_start,
    vocab_coverage,
)
from training.loop import TrainRecipe
from training.store import tokenizer_key
from training.teacher import Teacher

log = logging.getLogger(__name__)


@trained_part("draft")
class DistillRecipe(TrainRecipe):
    """How a draft is distilled from the target (cached under cache_dir/drafts/, keyed by the target, this
    recipe and the run's training recipe: how many teacher tokens, how many epochs)."""

    EPOCHS = {"smoke": 1, "quick": 2, "full": 2}

    layers: list[NonNegativeInt] = Field([0, 1, 2, 3], min_length=1, description="which target layers the draft "
                                         "starts from (renumbered 0..k-1)")
    vocab: int = Field(8192, ge=1, description="drafting vocabulary: the most frequent tokens (verification stays "
                       "lossless)")
    batch_size: int = Field(8, ge=1, description="sequences per training step")
    lr: float = Field(5.0e-4, gt=0, description="AdamW learning rate")
    answer_weight: float = Field(1.0, ge=0, description="loss weight of positions followed by a token of the "
                                 "target's own answer (the contexts greedy SD drafts in) against 1 for the rest")


class DraftLM(PreTrainedModel, GenerationMixin):
    """A small causal LM with a reduced output vocabulary; its logits come back over the full vocabulary.

    ``forward(input_ids (B, T), cache, ...)`` returns ``logits`` of shape ``(B, T, full_vocab)``
    (``-inf`` outside ``vocab_map``) and ``hidden_states = (last_hidden (B, T, hidden),)``. It is a
    Hugging Face ``PreTrainedModel`` with ``generate``, so transformers' own assisted generation can use it
    as ``assistant_model`` (the benchmark script compares against that).
    """

    _supports_sdpa = True
    _can_compile_fullgraph = False

    def __init__(self, config, vocab_map: torch.Tensor):
        super().__init__(config)
        from transformers import AutoModel

        self.body = AutoModel.from_config(config)
        self.head = nn.Linear(config.hidden_size, vocab_map.numel(), bias=False)
        self.register_buffer("vocab_map", vocab_map.long(), persistent=True)

    def sub_logits(self, input_ids):
        """Logits over the drafting vocabulary only: ``(B, T, len(vocab_map))``, and the last hidden state (no
        cache: training reads whole sequences)."""
        out = lm_forward(self.body, input_ids)
        hidden = out.last_hidden_state
        return self.head(hidden), hidden

    def get_input_embeddings(self):
        return self.body.get_input_embeddings()

    def get_output_embeddings(self):
        return self.head

    def get_decoder(self):
        return self.body

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., full_vocab)`` logits of last hidden states ``(..., hidden)``: the head's over the drafting
        vocabulary, ``-inf`` elsewhere (a compiled forward, core.compiled, runs this on its decoder's output too)."""
        sub = self.head(hidden)
        logits = sub.new_full((*sub.shape[:-1], self.config.vocab_size), float("-inf"))
        logits[..., self.vocab_map] = sub
        return logits

    def forward(self, input_ids, output_hidden_states=False, logits_to_keep: int = 0, **kwargs):
        # kwargs: the cache and use_cache as core.kv_cache.lm_forward passes them, positions, masks.
        kwargs = {k: v for k, v in kwargs.items() if k not in ("return_dict", "output_attentions")}
        out = self.body(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state
        logits = self.logits_of(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        return output_with_cache(CausalLMOutputWithPast, cache_of(out), logits=logits, hidden_states=(hidden,))


def draft_from_target(target, layers: list[int], vocab_map: torch.Tensor) -> DraftLM:
    """Initialise a draft from the target: its embeddings (token, and GPT-2's positions), the chosen layers
    (renumbered), final norm and head rows."""
    n_layer = target.config.num_hidden_layers
    bad = [i for i in layers if not 0 <= i < n_layer and not -n_layer <= i < 0]
    if bad or not layers:
        raise BenchError(f"draft layers {list(layers)} are not layers of a {n_layer}-layer target.")
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = len(layers)
    for attr in ("layer_types",):  # per-layer lists must shrink with the layer count
        if getattr(config, attr, None) is not None:
            setattr(config, attr, [getattr(config, attr)[i] for i in layers])
    draft = DraftLM(config, vocab_map)
    # Every family alike (core.model_parts): GPT-2's wte, wpe and ln_f as Llama's embed_tokens and norm.
    copy_from(draft.body, target, [i % n_layer for i in layers])
    draft.head.weight.data.copy_(target.get_output_embeddings().weight.data[vocab_map])
    return draft


def distill_loss(draft: DraftLM, x, idx, prob, to_sub, weight=None):
    """Cross-entropy of the draft against the target's top-k distribution, restricted to the draft vocab.

    ``x``: ``(B, T)`` token ids; ``idx`` / ``prob``: ``(B, T, k)`` the target's top-k at each position, with
    ``prob`` all zero where a position has no label (prompt text, padding); ``weight``: ``(B, T)`` each
    position's weight in the mean (default 1).
    """
    sub_logits, _ = draft.sub_logits(x)
    logq = torch.log_softmax(sub_logits.float(), -1)
    sub_idx = to_sub[idx]  # (B, T, k); -1 where the target's token is outside the drafting vocabulary
    w = prob * (sub_idx >= 0)
    mass = w.sum(-1, keepdim=True)
    labelled = (mass.squeeze(-1) > 0).float()
    if weight is not None:
        labelled = labelled * weight
    w = w / mass.clamp_min(1e-9)
    per_pos = -(w * logq.gather(-1, sub_idx.clamp_min(0))).sum(-1)
    return (per_pos * labelled).sum() / labelled.sum().clamp_min(1e-9)  # weights below 1 must not be clamped


def draft_judge(draft: DraftLM, data: dict):
    """:func:`training.kit.agreement`'s judge for a distilled draft over ``data`` (a store's ``ids``, ``idx``,
    ``mask``, ``answer`` in memory): at every labelled position, is the draft's greedy token the target's (the
    acceptance greedy SD sees at a drafted position whose prefix matched)?"""
    device = draft.vocab_map.device

    def judge(rows: torch.Tensor) -> list[tuple]:
        sub, _ = draft.sub_logits(data["ids"][rows].to(device))
        counted = data["mask"][rows].to(device)
        hit = draft.vocab_map[sub.argmax(-1)] == data["idx"][rows][..., 0].to(device)
        return [(hit, counted, counted & data["answer"][rows].to(device))]

    return judge


def train_draft(target, tokenizer, recipe: DistillRecipe, teacher: Teacher) -> tuple[DraftLM, dict]:
    """Distil a draft from the frozen target on the teacher store (packaged text and the target's own answers,
    interleaved at random); returns the draft and its training report (held-out agreement, by kind of text)."""
    target, device = training_start(target, recipe.seed)  # trained where the target is (the run's device)
    train = store_data(teacher.store(target, tokenizer, "train"), ("ids", "idx", "prob", "mask", "answer"))
    held_store = teacher.store(target, tokenizer, "test")
    held = store_data(held_store, ("ids", "idx", "mask", "answer"))
    m = train["mask"]
    vocab_map = store_vocab(tokenizer, train, recipe.vocab, target.config.vocab_size)
    to_sub = sub_index(vocab_map, target.config.vocab_size)
    train["prob"] = train["prob"] * m.unsqueeze(-1)  # padding is no label
    # Answer positions weigh answer_weight, the rest 1 (the mean is over the weights, so only the ratio counts).
    train["weight"] = 1.0 + (recipe.answer_weight - 1.0) * train.pop("answer").float()

    draft = draft_from_target(target, list(recipe.layers), vocab_map).to(device)
    on = to_sub.to(device)
    draft.get_input_embeddings().weight.requires_grad_(False)  # the input embedding stays the target's
    report = fit_and_measure(
        [draft], lambda b: distill_loss(draft, *(train[f][b].to(device) for f in ("ids", "idx", "prob")), on,
                                        train["weight"][b].to(device)),
        examples=len(train["ids"]), judge=lambda: draft_judge(draft, held), held=len(held["ids"]),
        answer_rows=answer_rows(held_store),
        epochs=part_epochs("draft", recipe, teacher), batch_size=recipe.batch_size, lr=recipe.lr,
        desc="draft: distilling")
    report.update(
        recipe=teacher.recipe.name,
        train_tokens=int(m.sum()),
        heldout_tokens=int(held["mask"].sum()),
        vocab=int(vocab_map.numel()),
        vocab_coverage=vocab_coverage(to_sub, held),
    )
    return draft.cpu(), report


def draft_artifact(target, tokenizer, recipe: DistillRecipe, teacher: Teacher) -> Artifact:
    """The distilled draft of (target, recipe, the run's training recipe) as a cached artifact: ``draft.pt``
    (config and weights). Trained where the target is (the run's device), beside it in fp32.

    Keyed by the target's weights, not its path: the same target found elsewhere keeps its draft.
    """
    ident = model_fingerprint(target)

    def train() -> tuple[DraftLM, dict]:
        return train_draft(target, tokenizer, recipe, teacher)

    def load(blob: dict) -> DraftLM:
        draft = DraftLM(target.config.__class__.from_dict(blob["config"]), blob["state"]["vocab_map"])
        draft.load_state_dict(blob["state"])
        return draft.eval()

    key = {"target": ident, "recipe": part_key(recipe, answer_weight=1.0),
           "teacher": budget(teacher, part_epochs("draft", recipe, teacher)), **tokenizer_key(tokenizer)}
    return part_artifact("drafts", ident["name"], key, train,
                         lambda draft: {"config": draft.config.to_dict(), "state": draft.state_dict()}, load,
                         "draft.pt", trained_by="draft",
                         description="distilled draft")


def draft_report(target, tokenizer, recipe: DistillRecipe, teacher: Teacher) -> dict:
    """The training report of the cached draft for (target, recipe, teacher.recipe) ({} when there is none)."""
    return report_of(draft_artifact(target, tokenizer, recipe, teacher), teacher.cache)
