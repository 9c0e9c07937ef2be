"""KOALA's adversarial learning (Zhang et al. 2024, "KOALA: Enhancing Speculative Decoding for LLM via
Multi-Layer Draft Heads with Adversarial Learning", Sec. 3.2): the draft head is the generator, a
discriminator learns to tell the target's next-token distributions ("real") from the head's ("fake"), and the
head's supervised loss gains a term that rewards fooling it.

Each training step of the head (:func:`training.loop.fit`) first updates the discriminator once on
detached distributions (binary cross-entropy, real = 1), then returns the head's adversarial term, the
non-saturating ``-log D(q)``, computed through a frozen copy of the discriminator, weighted by ``weight`` (the head's
optimiser sees it through the shared loss; the discriminator has its own).

Where this follows the paper and where it fills a gap (the README's KOALA table says it too): the paper
describes the discriminator as telling the target's outputs from the head's, trained in alternation with it;
only its abstract and summaries could be read offline here, so the discriminator's input and size are this
harness's choice: the distribution over the head's reduced vocabulary (what the head is judged by: which token
wins), through a small MLP, on a random subset of the batch's positions (``positions``) to keep the step
cheap on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import Field
from torch import nn

from core.schema import Settings


class AdversaryRecipe(Settings):
    """KOALA's discriminator and the weight of its term in the head's loss (``recipe.adversarial.*``)."""

    weight: float = Field(0.1, gt=0, description="weight of the head's adversarial term -log D(q) beside its "
                          "supervised loss")
    hidden: int = Field(256, ge=1, description="the discriminator's width (an MLP of two hidden layers)")
    lr: float = Field(2.0e-4, gt=0, description="the discriminator's Adam learning rate")
    positions: int = Field(256, ge=1, description="positions per step (and per head) the discriminator reads, "
                           "drawn at random from the batch's text positions")


class Discriminator(nn.Module):
    """``(N, V')`` next-token distributions -> ``(N,)`` logits of "the target's"."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(vocab, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden),
                                 nn.LeakyReLU(0.2), nn.Linear(hidden, 1))

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        return self.net(probs).squeeze(-1)


class Adversary:
    """The discriminator, its optimiser and running tallies; :meth:`term` is called once per head per step."""

    def __init__(self, vocab: int, recipe: AdversaryRecipe, device=None):
        self.recipe = recipe
        self.disc = Discriminator(vocab, recipe.hidden).to(device)
        self.opt = torch.optim.Adam(self.disc.parameters(), lr=recipe.lr, betas=(0.5, 0.999))
        self.steps, self.auc_sum = 0, 0.0
        self.auc = self.d_loss = float("nan")

    def term(self, logq: torch.Tensor, real: Callable[[tuple], torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
        """The head's weighted adversarial term, after one discriminator update.

        Args:
            logq: ``(..., V')`` the head's log-probabilities (with gradients).
            real: the target's probabilities ``(N, V')`` at the positions an index tuple into ``keep`` names
                (computed for the drawn positions only: a whole batch's would cost a vocabulary-sized matmul).
            keep: ``(...)`` bool, the positions that count (text, with a label).
        Returns:
            A scalar: ``weight * mean(-log D(q))`` over the drawn positions (0 when none are kept).
        """
        rows = keep.nonzero(as_tuple=True)
        n = rows[0].numel()
        if n == 0:
            return logq.new_zeros(())
        pick = torch.randperm(n, device=keep.device)[: int(self.recipe.positions)]
        rows = tuple(r[pick] for r in rows)
        with torch.no_grad():
            real = real(rows).float()
        q = logq[rows].float().exp()
        fake = q.detach()
        self.disc.train()
        d_real, d_fake = self.disc(real), self.disc(fake)
        bce = nn.functional.binary_cross_entropy_with_logits
        loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.d_loss = loss.item()
        with torch.no_grad():  # the share of (real, fake) pairs it ranks right: its ROC-AUC on this batch
            self.auc = (d_real[:, None] > d_fake[None, :]).float().mean().item()
        self.auc_sum, self.steps = self.auc_sum + self.auc, self.steps + 1
        # The head's term moves the head only, through a frozen copy of the discriminator: later heads of the
        # same step update the discriminator in place before this term's backward runs.
        frozen = {name: w.detach().clone() for name, w in self.disc.named_parameters()}
        d_q = torch.func.functional_call(self.disc, frozen, (q,))
        return float(self.recipe.weight) * bce(d_q, torch.ones_like(d_q))

    def report(self) -> dict:
        """How well the discriminator told the target's distributions from the head's (ROC-AUC: 0.5 not at all,
        1 always), on average over training and at its last step, and its last loss."""
        return {"discriminator_auc_mean": round(self.auc_sum / max(self.steps, 1), 4),
                "discriminator_auc_last": round(self.auc, 4), "discriminator_last_loss": round(self.d_loss, 4)}
