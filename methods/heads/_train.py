"""Training Medusa / Hydra / Amphista heads (and Hydra++'s prefix layer) from the teacher store, and caching them:
the losses (the target's greedy token, or its whole distribution: Hydra++'s teacher distillation; KOALA's
adversarial term beside either), the heads' agreement with the target, and the cached artifact ``heads.pt``.
The modules themselves are in :mod:`methods.heads._heads`."""

from __future__ import annotations

import logging

import torch
from torch import nn

from core.artifacts import Artifact, jsonable, model_fingerprint
from core.errors import BenchError
from training.adversarial import Adversary, AdversaryRecipe
from methods.heads._amphista import AmphistaHeads
from methods.heads._heads import Heads, HeadsRecipe, PrefixLayer
from training.kit import (
    answer_rows,
    budget,
    feature_stores,
    fit_and_measure,
    part_artifact,
    part_epochs,
    part_key,
    store_data,
    store_vocab,
    sub_index,
    training_start,
    untrained_vocab,
    vocab_coverage,
)
from training.teacher import Teacher

log = logging.getLogger(__name__)


def new_heads(kind: str, target_config, num_heads: int, vocab_map: torch.Tensor, layers: int = 1,
              stages: int = 0) -> Heads:
    """Untrained heads of ``kind`` (Amphista's with ``stages`` adaptation layers) for a target of ``target_config``."""
    if kind == "amphista":
        return AmphistaHeads(target_config, num_heads, vocab_map, layers, stages)
    return Heads(kind, target_config.hidden_size, num_heads, vocab_map, layers)


def untrained_heads(target_config, kind: str, recipe: HeadsRecipe) -> tuple[Heads, PrefixLayer | None]:
    """The heads (and the prefix layer) :func:`train_heads` would train, untrained: a synthetic pair's
    (:func:`training.kit.untrained_if_synthetic`)."""
    vocab_map = untrained_vocab(recipe.vocab, target_config.vocab_size)
    heads = new_heads(kind, target_config, recipe.num_heads, vocab_map, recipe.layers, getattr(recipe, "stages", 0))
    return heads.eval(), (PrefixLayer(target_config).eval() if recipe.prefix_layer else None)


def heads_loss(heads: Heads, batch: dict, to_sub, loss: str, embed, decay: float, prefix: PrefixLayer | None = None,
               teacher_head: nn.Linear | None = None, adversary: Adversary | None = None) -> torch.Tensor:
    """Sum over heads of ``decay**k`` times head k's cross-entropy against the target at position t + k + 1,
    restricted to the reduced vocabulary, over positions where both t and t + k + 1 are text (not padding).

    ``batch``: a store's ``ids (B, T)``, ``idx (B, T, k)``, ``mask (B, T)`` and ``hidden (B, T, H)``. ``loss``
    ``top1``: the target's greedy token (labels outside the vocabulary are dropped); ``teacher``: the target's
    whole distribution over the heads' vocabulary, ``softmax(teacher_head(h_{t+k+1}))`` (the target's own output
    rows over its stored hidden state, so nothing is cut to a top-k). With a ``prefix`` layer the heads read its
    output over the hidden states (trained jointly, through this loss).
    """
    hidden, ids, mask = batch["hidden"], batch["ids"], batch["mask"]
    T = hidden.shape[1]
    inputs = prefix(hidden) if prefix is not None else hidden
    total = hidden.new_zeros(())
    for k, logits in enumerate(heads.teacher_forced(inputs, ids, embed)):
        logq = torch.log_softmax(logits.float(), -1)
        keep = mask[:, : T - k - 1] & mask[:, k + 1 :]
        later = hidden[:, k + 1 :]  # the target's hidden state where head k's label is its next token

        def target_probs(rows=(slice(None),)) -> torch.Tensor:
            with torch.no_grad():
                return torch.softmax(teacher_head(later[rows]).float(), -1)

        if loss == "top1":
            label = to_sub[batch["idx"][:, k + 1 :, 0]]  # -1 outside the reduced vocabulary
            keep = keep & (label >= 0)
            ce = -logq.gather(-1, label.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        else:
            ce = -(target_probs() * logq).sum(-1)
        total = total + decay**k * (ce * keep).sum() / keep.sum().clamp_min(1)
        if adversary is not None:  # the target's distributions at the positions it draws are the real ones
            total = total + decay**k * adversary.term(logq, target_probs, keep)
    return total


def heads_judge(heads: Heads, store, embed, prefix: PrefixLayer | None = None, device=None):
    """:func:`training.kit.agreement`'s judge for K heads: per head k, is its greedy token the target's greedy
    token k + 1 steps after its next one (teacher-forced: the acceptance of a depth-(k+1) chain node whose
    ancestors were accepted)?"""

    def judge(rows: torch.Tensor) -> list[tuple]:
        b = {n: t.to(device) for n, t in store.rows(rows, ("ids", "idx", "mask", "hidden", "answer")).items()}
        h = b["hidden"] if prefix is None else prefix(b["hidden"])
        T = h.shape[1]
        out = []
        for k, logits in enumerate(heads.teacher_forced(h, b["ids"], embed)):
            counted = b["mask"][:, : T - k - 1] & b["mask"][:, k + 1 :]
            hit = heads.vocab_map[logits.argmax(-1)] == b["idx"][:, k + 1 :, 0]
            out.append((hit, counted, counted & b["answer"][:, k + 1 :]))
        return out

    return judge


def train_heads(target, tokenizer, kind: str, recipe: HeadsRecipe, teacher: Teacher) -> tuple[Heads, PrefixLayer | None, dict]:
    """Train K heads of ``kind`` (and the prefix layer, when the recipe asks for one) from the teacher store of
    the frozen target: its stored hidden states are the heads' input, its labels their targets. Returns them
    (on the CPU) and a report (figures per head)."""
    target, device = training_start(target, recipe.seed)
    embed = target.get_input_embeddings()
    K = recipe.num_heads
    settings = teacher.recipe.store
    if settings.seq_len <= K + 1:  # also checked with the config (TreeHeadsMethod.check_recipe)
        raise BenchError(f"recipe.store.seq_len ({settings.seq_len}) must exceed method.recipe.num_heads + 1 ({K + 1}).")
    train, held = feature_stores(target, tokenizer, teacher, "heads read")
    cols = store_data(train, ("ids", "idx", "mask"))
    vocab_map = store_vocab(tokenizer, cols, recipe.vocab, target.config.vocab_size)
    to_sub = sub_index(vocab_map, target.config.vocab_size).to(device)

    heads = new_heads(kind, target.config, K, vocab_map, recipe.layers,
                      getattr(recipe, "stages", 0))  # stages: Amphista's recipe only
    heads = heads.to(device)
    heads.init_from(target)
    teacher_head = None
    adversarial = recipe.adversarial
    adversary = (Adversary(len(vocab_map), AdversaryRecipe.model_validate(jsonable(adversarial)), device)
                 if adversarial else None)
    if recipe.loss == "teacher" or adversary is not None:  # the target's own output rows over the heads' vocabulary, frozen
        teacher_head = nn.Linear(target.config.hidden_size, len(vocab_map), bias=False).to(device).requires_grad_(False)
        teacher_head.weight.data.copy_(target.get_output_embeddings().weight.data[vocab_map.to(device)])
    prefix = PrefixLayer.from_target(target).to(device) if recipe.prefix_layer else None

    def step(rows: torch.Tensor) -> torch.Tensor:
        batch = {n: t.to(device) for n, t in train.rows(rows, ("ids", "idx", "mask", "hidden")).items()}
        return heads_loss(heads, batch, to_sub, recipe.loss, embed, recipe.decay, prefix, teacher_head, adversary)

    report = fit_and_measure(
        [heads] + ([prefix] if prefix is not None else []), step, examples=len(train),
        judge=lambda: heads_judge(heads, held, embed, prefix, device), held=len(held),
        answer_rows=answer_rows(held),
        epochs=part_epochs("heads", recipe, teacher), batch_size=recipe.batch_size, lr=recipe.lr,
        desc=f"{kind}: training {K} heads" + (" and the prefix layer" if prefix is not None else "")
        + (" against a discriminator" if adversary is not None else ""))
    held_top1 = held.rows(range(len(held)), ("idx", "mask"))
    report.update(
        prefix_layer=prefix is not None,
        layers=heads.layers,
        **({"stages": len(heads.stages)} if kind == "amphista" else {}),
        **(adversary.report() if adversary is not None else {}),
        recipe=teacher.recipe.name,
        train_tokens=int(cols["mask"].sum()),
        heldout_tokens=int(held_top1["mask"].sum()),
        vocab=int(vocab_map.numel()),
        vocab_coverage=vocab_coverage(to_sub, held_top1),
    )
    return heads.cpu(), (prefix.cpu() if prefix is not None else None), report


# --------------------------------------------------------------------------------------------- caching


def heads_artifact(target, tokenizer, kind: str, recipe: HeadsRecipe, teacher: Teacher, method: str | None = None) -> Artifact:
    """The heads of (target, kind, recipe, the run's training recipe) as a cached artifact: ``heads.pt`` (heads
    and prefix layer).

    ``prefix_layer`` is keyed as a bool (absent = false), so a cached file always has the prefix layer its
    recipe asks for; loading checks it anyway, since a mismatch would decode with the wrong heads' input.
    """
    keyed = {**part_key(recipe, adversarial=None), "prefix_layer": recipe.prefix_layer}
    ident = model_fingerprint(target)

    def train() -> tuple[tuple[Heads, PrefixLayer | None], dict]:
        heads, prefix, report = train_heads(target, tokenizer, kind, recipe, teacher)
        return (heads, prefix), report

    def save(made: tuple[Heads, PrefixLayer | None]) -> dict:
        heads, prefix = made
        return {"kind": kind, "hidden": heads.blocks[0].linear.out_features, "num_heads": heads.num_heads,
                "layers": heads.layers, "stages": len(getattr(heads, "stages", ())), "state": heads.state_dict(),
                "prefix": prefix.state_dict() if prefix is not None else None}

    def load(blob: dict) -> tuple[Heads, PrefixLayer | None]:
        has_prefix = blob.get("prefix") is not None
        if has_prefix != keyed["prefix_layer"]:
            # Not a BenchError: a file that does not fit its key is broken, rebuilt when building is allowed.
            raise ValueError(f"it {'has' if has_prefix else 'lacks'} a prefix layer, unlike method.recipe.prefix_layer")
        heads = new_heads(blob["kind"], target.config, blob["num_heads"], blob["state"]["vocab_map"],
                          blob.get("layers", 1), blob.get("stages", 0))
        heads.load_state_dict(blob["state"])
        prefix = None
        if has_prefix:
            prefix = PrefixLayer(target.config)
            prefix.load_state_dict(blob["prefix"])
            prefix.eval()
        return heads.eval(), prefix

    key = {"target": ident, "kind": kind, "recipe": keyed, "teacher": budget(teacher, part_epochs("heads", recipe, teacher))}
    return part_artifact("heads", f"{kind}-{ident['name']}", key, train, save, load, "heads.pt",
                         trained_by=method or kind,
                         description=f"{kind} heads")
