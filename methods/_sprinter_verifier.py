"""SPRINTER's learned verifier (Zhong, Teku and Tandon 2025): its model, features, training and cache.

The verifier is trained once per (target, draft, recipe, training recipe) by :func:`train_verifier` and cached
under ``cache_dir/verifiers/``. Examples come from the teacher store (:mod:`training.teacher`): at every position
of its text and of the target's own answers the draft proposes its own token (its argmax, or a draw from q when
sampling: on-policy for the candidate), and the label says whether the target would accept that token (greedy:
it is the target's argmax, stored; sampling: q(x) <= p(x), the paper's rule, with p from the target's stored
hidden state through its output head). Under greedy decoding every accepted prefix is the target's own greedy
text, which is what the answer rows hold. Decoding is in :mod:`methods.sprinter`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch
from pydantic import Field
from torch import nn
from tqdm.auto import tqdm

from core.artifacts import Artifact, model_fingerprint
from core.errors import BenchError
from training.kit import budget, part_artifact, part_epochs, part_key, trained_part
from training.loop import TrainRecipe, fit

log = logging.getLogger(__name__)

Label = Literal["greedy", "sampling"]
LABELS = get_args(Label)


@trained_part("verifier")
class VerifierRecipe(TrainRecipe):
    """How SPRINTER's verifier is trained (its data: the run's recipe); the trained verifier is cached per (target,
    draft, this recipe, the run's recipe)."""

    EPOCHS = {"smoke": 2, "quick": 8, "full": 8}  # passes over its examples

    batch_size: int = Field(4, ge=1, description="sequences per draft forward when computing features")
    label: Label = Field("greedy", description="greedy: target argmax == draft token; sampling: q(x) <= p(x) "
                         "with x drawn from q")
    temperature: float = Field(1.0, gt=0, description="for sampling labels only")
    probs: bool = Field(True, description="add the draft's top probability and entropy to its last hidden state")
    width: int = Field(0, ge=0, description="0: the paper's linear layer + sigmoid; > 0: a one-hidden-layer MLP of "
                       "this width")
    train_batch: int = Field(512, ge=1, description="examples per optimiser step")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")


class Verifier(nn.Module):
    """Scores draft tokens: features ``(..., d_in)`` -> logit ``(...)`` of "the target accepts this token".

    Features are standardised with the training set's mean and std (stored as buffers, so the cached file
    is self-contained). ``width == 0`` gives logistic regression, otherwise a one-hidden-layer MLP.
    """

    def __init__(self, d_in: int, width: int):
        super().__init__()
        self.d_in, self.width = d_in, width
        self.register_buffer("mean", torch.zeros(d_in))
        self.register_buffer("std", torch.ones(d_in))
        self.net = nn.Sequential(nn.Linear(d_in, width), nn.GELU(), nn.Linear(width, 1)) if width else nn.Linear(d_in, 1)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.net((feats.float() - self.mean) / self.std).squeeze(-1)


def features(hidden: torch.Tensor, logits: torch.Tensor, use_probs: bool) -> torch.Tensor:
    """The verifier's input at each drafted position, the same in training and decoding.

    Args:
        hidden: ``(..., hidden)`` the draft's last hidden state at the position that proposed the token.
        logits: ``(..., vocab)`` the draft's logits there (``-inf`` allowed: a reduced-vocabulary draft).
    Returns:
        ``FloatTensor (..., hidden [+ 2])``: the hidden state, then (``use_probs``) the draft's top
        probability and entropy at temperature 1, which say how sure the draft is.
    """
    hidden = hidden.float()
    if not use_probs:
        return hidden
    p = torch.softmax(logits.float(), -1)
    top = p.max(-1).values
    entropy = torch.special.entr(p).sum(-1)  # entr(0) = 0, so -inf logits are harmless
    return torch.cat([hidden, top.unsqueeze(-1), entropy.unsqueeze(-1)], -1)


def draft_forward(draft, input_ids: torch.Tensor, cache=None, **kw):
    """One draft forward returning ``(logits (B, T, vocab), last hidden (B, T, hidden))``.

    ``draft`` is a :class:`core.counting.CountedLM` (decoding: counted) or a bare module (training).
    A distilled ``DraftLM`` returns ``hidden_states=(last,)``; a Hugging Face model returns every layer's,
    the last one last.
    """
    if hasattr(draft, "role"):
        out = draft(input_ids, cache, output_hidden_states=True, **kw)
    else:
        out = draft(input_ids=input_ids, output_hidden_states=True, **kw)
    return out.logits, out.hidden_states[-1]


@torch.no_grad()
def verifier_data(draft, target, store, recipe: VerifierRecipe, device, desc: str, generator):
    """Features and labels at every labelled position of ``store``: ``(FloatTensor (N, d_in), BoolTensor (N,))``.

    At each position the candidate is the draft's own next token (its argmax for ``label: greedy``; a draw from
    q at ``recipe.temperature`` for ``label: sampling``). The label says whether the target would accept it:
    greedy, the target's stored argmax equals it; sampling, q(x) <= p(x), the paper's rule (such a token is
    accepted with certainty by rejection sampling), p from the stored hidden state and the target's output head.
    """
    feats, labels = [], []
    fields = ("ids", "idx", "mask") + (("hidden",) if recipe.label == "sampling" else ())
    for part in tqdm(torch.arange(len(store)).split(recipe.batch_size), desc=desc, unit="batch"):
        b = {n: t.to(device) for n, t in store.rows(part, fields).items()}
        dlogits, hidden = draft_forward(draft, b["ids"])
        if recipe.label == "greedy":
            label = b["idx"][..., 0] == dlogits.argmax(-1)
        else:
            t = recipe.temperature
            q = torch.softmax(dlogits.float() / t, -1)
            p = torch.softmax(target.get_output_embeddings()(b["hidden"].to(target.dtype)).float() / t, -1)
            cand = torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(q.shape[:-1])
            label = (q.gather(-1, cand[..., None]) <= p.gather(-1, cand[..., None])).squeeze(-1)
        m = b["mask"]
        feats.append(features(hidden, dlogits, bool(recipe.probs))[m].cpu())
        labels.append(label[m].cpu())
    return torch.cat(feats), torch.cat(labels)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve = P(score of a positive > score of a negative), ties counted half
    (the Mann-Whitney U statistic over n_pos * n_neg); NaN when a class is absent."""
    labels = labels.astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based ranks, tied scores share their mean rank
    ranks = avg_rank[inverse]
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def classification_report(scores: np.ndarray, labels: np.ndarray, threshold: float = 0.5) -> dict:
    """Held-out figures of the verifier; "positive" = the target accepts the draft token.

    ``precision``: of the tokens the verifier lets through, the fraction the target would have accepted
    (1 - precision is the error rate of unchecked tokens); ``recall``: of the tokens the target accepts,
    the fraction let through (what saves target calls); ``reject_recall``: of the tokens the target
    rejects, the fraction flagged.
    """
    labels = labels.astype(bool)
    pred = scores >= threshold
    tp, fp = int((pred & labels).sum()), int((pred & ~labels).sum())
    fn, tn = int((~pred & labels).sum()), int((~pred & ~labels).sum())
    ratio = lambda a, b: a / b if b else math.nan
    return {
        "threshold": threshold,
        "accuracy": ratio(tp + tn, len(labels)),
        "precision": ratio(tp, tp + fp),
        "recall": ratio(tp, tp + fn),
        "reject_recall": ratio(tn, tn + fp),
        "roc_auc": roc_auc(scores, labels),
        "accept_rate": ratio(int(labels.sum()), len(labels)),
    }


def train_verifier(pair, recipe: VerifierRecipe) -> tuple[Verifier, dict]:
    """Train the verifier of ``pair``'s first draft from the teacher store; returns it and its held-out report."""
    torch.manual_seed(recipe.seed)
    gen = torch.Generator(device=pair.device).manual_seed(recipe.seed)
    draft, target, teacher = pair.draft.module, pair.target.module, pair.teacher
    if recipe.label == "sampling" and not teacher.recipe.store.hidden:
        raise BenchError("sampling labels need the target's stored hidden states; set recipe.store.hidden=true.")
    train = teacher.store(target, pair.tokenizer, "train")
    held = teacher.store(target, pair.tokenizer, "test")
    x, y = verifier_data(draft, target, train, recipe, pair.device, "verifier: labels", gen)
    xh, yh = verifier_data(draft, target, held, recipe, pair.device, "verifier: held-out labels", gen)

    model = Verifier(x.shape[1], recipe.width)
    model.mean.copy_(x.mean(0))
    model.std.copy_(x.std(0).clamp_min(1e-6))
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    # Class balance: accepted tokens are the minority for a weak draft; weigh them up to the rejections.
    pos_weight = torch.tensor(n_neg / n_pos if n_pos and n_neg else 1.0)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    yf = y.float()
    batch = recipe.train_batch
    model.train()
    final_loss = fit(list(model.parameters()), lambda: torch.randperm(len(x)).split(batch),
                     lambda b: loss_fn(model(x[b]), yf[b]), epochs=part_epochs("verifier", recipe, teacher),
                     steps_per_epoch=math.ceil(len(x) / batch), lr=recipe.lr,
                     weight_decay=recipe.weight_decay, one_cycle=False, clip=None, desc="verifier: training")
    model.eval()
    with torch.no_grad():
        scores = torch.sigmoid(model(xh)).numpy()
    report = classification_report(scores, yh.numpy())
    report.update(train_examples=len(x), heldout_examples=len(xh), train_accept_rate=n_pos / max(len(y), 1),
                  features=int(x.shape[1]), width=recipe.width, final_loss=final_loss, recipe=teacher.recipe.name,
                  epochs=part_epochs("verifier", recipe, teacher))
    return model, report


def verifier_artifact(pair, recipe: VerifierRecipe) -> Artifact:
    """The verifier of (pair, recipe) as a cached artifact: ``verifier.pt``.

    Keyed by the weights of both models, not only their specs: a retrained draft (same spec) must not reuse
    a verifier fitted to the old one.
    """
    key = {"target": model_fingerprint(pair.target.module), "draft": model_fingerprint(pair.draft.module),
           "draft_spec": pair.spec.drafts[0], "recipe": part_key(recipe),
           "teacher": budget(pair.teacher, part_epochs("verifier", recipe, pair.teacher))}

    def load(blob: dict) -> Verifier:
        model = Verifier(int(blob["d_in"]), int(blob["width"]))
        model.load_state_dict(blob["state"])
        return model.eval()

    return part_artifact("verifiers", pair.name, key, lambda: train_verifier(pair, recipe),
                         lambda model: {"d_in": model.d_in, "width": model.width, "state": model.state_dict()}, load,
                         "verifier.pt", description="SPRINTER verifier",
                         trained_by="sprinter")


def verifier_dir(pair, recipe: VerifierRecipe) -> Path:
    """Where the verifier of (pair, recipe) is cached."""
    return verifier_artifact(pair, recipe).folder(pair.cache)


def untrained_verifier(pair, recipe: VerifierRecipe) -> Verifier:
    """The verifier :func:`train_verifier` would fit, untrained (features unscaled): a synthetic pair's
    (:func:`training.kit.untrained_if_synthetic`)."""
    return Verifier(int(pair.draft.module.config.hidden_size) + (2 if recipe.probs else 0), recipe.width).eval()
