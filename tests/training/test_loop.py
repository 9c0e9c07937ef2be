"""training/loop.py: ``fit`` (steps, returned loss, clipping, the learning-rate schedule) and ``TrainRecipe``'s
checks."""

import math

import pytest
import torch
from pydantic import ValidationError

from core.errors import BenchError
from core.schema import check
from training.loop import TrainRecipe, fit


# Release-independent (no transformers model is loaded or called here): CI's oldest-transformers leg skips it.
pytestmark = pytest.mark.newest_only


def _batches(n, size=16, seed=0):
    """``n`` batches ``(x, y)`` of y = x·(2, -3, 0.5) + 1, fixed across epochs. x: (size, 3), y: (size, 1)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(size, 3, generator=g) for _ in range(n)]
    w, b = torch.tensor([[2.0], [-3.0], [0.5]]), 1.0
    return [(x, x @ w + b) for x in xs]


def test_fit_converges_on_linear_regression():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = _batches(4)
    last = fit(list(model.parameters()), lambda: iter(data), lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1]),
               epochs=60, steps_per_epoch=4, lr=0.1, desc="regression")
    assert last < 1e-3
    assert model.weight.detach().flatten().tolist() == pytest.approx([2.0, -3.0, 0.5], abs=0.02)
    assert model.bias.item() == pytest.approx(1.0, abs=0.02)


def _scalar_fit(losses, **kw):
    """Fits one parameter p (starting at 0) with loss = scale·p + offset for each ``(scale, offset)`` in ``losses``
    per epoch; returns fit's result and, per step_loss call, p's value and the gradient the step before it left."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    seen = []

    def step_loss(batch):
        scale, offset = batch
        seen.append((p.item(), None if p.grad is None else p.grad.norm().item()))
        return scale * p.sum() + offset

    kw = {"epochs": 1, "steps_per_epoch": len(losses), "lr": 0.01, "desc": "scalar", **kw}
    return fit([p], lambda: iter(losses), step_loss, **kw), seen


def test_fit_takes_epochs_times_batches_steps():
    calls = {"epoch": 0}

    def epoch():
        calls["epoch"] += 1
        return iter([(1.0, 0.0)] * 4)

    p = torch.nn.Parameter(torch.zeros(1))
    steps = []
    fit([p], epoch, lambda b: steps.append(b) or p.sum() * b[0], epochs=3, steps_per_epoch=4, lr=0.01, desc="count")
    assert (calls["epoch"], len(steps)) == (3, 12)


def test_fit_returns_the_last_loss():
    last, _ = _scalar_fit([(1.0, 5.0), (1.0, 3.0), (1.0, 7.25)], one_cycle=False)
    assert last == pytest.approx(7.25 - 2 * 0.01)  # the last loss is taken after two steps of lr each
    last, _ = _scalar_fit([(0.0, 5.0), (0.0, 3.0), (0.0, 7.25)])
    assert last == 7.25


def test_fit_with_no_steps_returns_nan():
    last, seen = _scalar_fit([], epochs=0, steps_per_epoch=0, one_cycle=False)
    assert math.isnan(last) and seen == []


@pytest.mark.parametrize("clip", [1.0, 0.25])
def test_clip_bounds_the_gradient_norm(clip):
    """A loss of 1e6·p has gradient 1e6; the optimizer sees it clipped to ``clip``."""
    _, seen = _scalar_fit([(1e6, 0.0)] * 3, clip=clip)
    grads = [g for _, g in seen if g is not None]
    assert len(grads) == 2 and all(g == pytest.approx(clip) for g in grads)


def test_no_clip_leaves_the_gradient():
    _, seen = _scalar_fit([(1e6, 0.0)] * 3, clip=None)
    assert [g for _, g in seen if g is not None] == [1e6, 1e6]


def _step_sizes(seen):
    """How far each step moved p. Under a constant gradient Adam moves by the learning rate (to 1e-8)."""
    values = [v for v, _ in seen]
    return [a - b for a, b in zip(values, values[1:], strict=False)]


def test_without_one_cycle_the_learning_rate_is_constant():
    _, seen = _scalar_fit([(1.0, 0.0)] * 20, lr=0.01, one_cycle=False)
    assert _step_sizes(seen) == pytest.approx([0.01] * 19, rel=1e-6)


def test_one_cycle_warms_up_then_anneals():
    """The first step takes max_lr / 25 (OneCycleLR's start); steps grow, then shrink to near zero. (OneCycleLR
    also cycles Adam's beta1, so later steps are the learning rate only roughly.)"""
    _, seen = _scalar_fit([(1.0, 0.0)] * 20, lr=0.01)
    sizes = _step_sizes(seen)
    peak = max(range(len(sizes)), key=sizes.__getitem__)
    assert sizes[0] == pytest.approx(0.01 / 25, rel=1e-6)
    assert 0.005 < sizes[peak] <= 0.01 and sizes[-1] < 0.01 / 50
    assert sizes[:peak + 1] == sorted(sizes[:peak + 1]) and sizes[peak:] == sorted(sizes[peak:], reverse=True)


def test_weight_decay_shrinks_parameters_without_a_gradient():
    p = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
    fit([p], lambda: iter([0] * 10), lambda _: p.sum() * 0, epochs=1, steps_per_epoch=10, lr=0.1, desc="decay",
        weight_decay=0.5, one_cycle=False)
    assert p.item() == pytest.approx((1 - 0.1 * 0.5) ** 10)


def test_train_recipe_defaults():
    r = TrainRecipe()
    assert (r.batch_size, r.lr, r.seed, r.epochs) == (8, 1e-3, 0, None)


@pytest.mark.parametrize("bad", [
    {"batch_size": 0}, {"batch_size": -4}, {"batch_size": 2.5}, {"batch_size": "8"}, {"batch_size": True},
    {"lr": 0.0}, {"lr": -1e-3}, {"lr": math.nan}, {"lr": math.inf}, {"lr": "1e-3"},
    {"seed": -1}, {"seed": 1.5},
    {"epochs": 0}, {"epochs": -1},
    {"epoch": 3},  # unknown key
])
def test_train_recipe_refuses_bad_values(bad):
    with pytest.raises(ValidationError):
        TrainRecipe(**bad)
    with pytest.raises(BenchError, match=f"recipe.{next(iter(bad))}"):  # one sentence naming the key
        check(TrainRecipe, bad, "recipe")


def test_train_recipe_takes_good_values():
    r = TrainRecipe(batch_size=1, lr=5e-4, seed=3, epochs=2)
    assert (r.batch_size, r.lr, r.seed, r.epochs) == (1, 5e-4, 3, 2)


def test_epochs_for_a_run_recipe():
    class Part(TrainRecipe):
        EPOCHS = {"smoke": 1, "quick": 4, "full": 9}

    assert Part.epochs_for({"epochs": None}, "full") == 9
    assert Part.epochs_for({}, "smoke") == 1
    assert Part.epochs_for({"epochs": None}, "my_recipe") == 4  # a recipe of another name takes quick's
    assert Part.epochs_for({"epochs": 2}, "full") == 2  # the setting overrides the part's count
