"""The one small training loop every trained part runs (AdamW, a progress bar), and the settings every trainer
has. How many teacher tokens a part reads is the run's recipe (:class:`training.recipes.RecipeSettings`); how many
passes it makes over them under each recipe, the part declares itself (``TrainRecipe.EPOCHS``)."""

from __future__ import annotations

from typing import Callable, ClassVar, Iterable

import torch
from pydantic import Field
from tqdm.auto import tqdm

from core.artifacts import jsonable
from core.schema import Settings


class TrainRecipe(Settings):
    """What every trainer's recipe holds (a subclass sets its own defaults and adds its model's settings).

    ``EPOCHS``: the passes the part makes over its examples under each preset run recipe (``recipe=smoke|quick|
    full``; a recipe of another name takes quick's), declared by the part next to its code; ``epochs`` overrides
    it for one run."""

    EPOCHS: ClassVar[dict[str, int]] = {"smoke": 1, "quick": 1, "full": 1}

    batch_size: int = Field(8, ge=1, description="sequences per training step")
    lr: float = Field(1.0e-3, gt=0, description="AdamW learning rate")
    seed: int = Field(0, ge=0, description="seeds initialisation and data order")
    epochs: int | None = Field(None, ge=1, description="passes over the training examples; null: the part's own "
                               "count for the run's recipe (smoke, quick, full)")

    @classmethod
    def epochs_for(cls, recipe, run_recipe: str) -> int:
        """The passes ``recipe`` (this class's settings, as a dict or config) makes under the run recipe named
        ``run_recipe``."""
        given = jsonable(recipe).get("epochs")
        if given is not None:
            return int(given)
        return cls.EPOCHS.get(run_recipe, cls.EPOCHS["quick"])


def fit(
    params: list[torch.nn.Parameter],
    epoch: Callable[[], Iterable],
    step_loss: Callable[..., torch.Tensor],
    *,
    epochs: int,
    steps_per_epoch: int,
    lr: float,
    desc: str,
    weight_decay: float = 0.0,
    one_cycle: bool = True,
    clip: float | None = 1.0,
) -> float:
    """Run ``epochs`` passes of ``step_loss(batch)`` over the batches ``epoch()`` yields; returns the last loss.

    ``one_cycle`` warms the learning rate up over the first 10% of steps and anneals it after (short
    distillation runs from a warm start are less brittle that way); ``clip`` bounds the gradient norm.
    """
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.1) if one_cycle else None
    last = float("nan")
    with tqdm(total=total, desc=desc, unit="step") as bar:
        for _ in range(epochs):
            for batch in epoch():
                loss = step_loss(batch)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, clip)
                opt.step()
                if sched is not None:
                    sched.step()
                last = loss.item()
                bar.update()
                bar.set_postfix(loss=f"{last:.3f}")
    return last
