"""core.counting: one place adds up calls, tokens and FLOPs; the wrappers of methods' own modules only declare
what a call runs."""

import ast

import pytest
import torch
from torch import nn

from core.counting import Counted
from tests.helpers import ROOT

PACKAGES = ("core", "decoding", "training", "methods", "bench")
COUNTS = {"calls", "tokens", "flops"}


class Fixed:
    """A formula of 10 FLOPs per new token plus 1 per key (stands in for core.flops.FlopFormula)."""

    def __call__(self, new_tokens, kv_len):
        return 10.0 * new_tokens + kv_len


@pytest.fixture()
def counted():
    c = Counted(nn.Linear(2, 2), "probe")
    c.formula, c.head_weights = Fixed(), 3
    return c


def test_a_call_is_counted_by_its_formula(counted):
    counted._count(2, 4, 7)
    assert counted.stats() == {"calls": 1, "tokens": 8, "flops": 2 * (40 + 7), "padded_tokens": 0, "padded_flops": 0,
                               "uncompiled_calls": 0}


def test_the_head_on_fewer_rows_the_whole_calls_flops_and_extra_flops(counted):
    counted._count(2, 4, 7, head_rows=1)  # the head skipped on 3 rows of each sequence: 2 * 3 weights each
    assert counted.flops == 2 * (40 + 7) - 2.0 * 3 * 2 * 3
    counted.reset()
    counted._count(1, 4, 7, head_rows=4)  # all rows: nothing saved
    assert counted.flops == 47
    counted.reset()
    counted._count(1, 5, 0, flops=12.0, extra_flops=0.5)  # a part of the module: its own FLOPs, plus extra
    assert counted.stats()["flops"] == 12.5 and counted.stats()["tokens"] == 5


def counted_classes(tree: ast.Module) -> list[ast.ClassDef]:
    """Classes of a module whose bases are counting wrappers (core.counting's ``Counted*``, by name)."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            and any(isinstance(b, ast.Name) and b.id.startswith("Counted") for b in node.bases)]


def writes_a_count(cls: ast.ClassDef) -> list[int]:
    """Lines of ``cls`` that assign to ``self.calls``, ``self.tokens`` or ``self.flops``."""
    lines = []
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in COUNTS and getattr(t.value, "id", None) == "self":
                lines.append(node.lineno)
    return lines


def test_no_wrapper_outside_core_counting_writes_a_count():
    """The wrappers of methods' modules (CountedEagle, CountedHeads, ...) pass what a call runs to _count; none
    adds to calls, tokens or FLOPs itself (the harness's counts stay comparable across methods)."""
    found, wrappers = [], 0
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "core" / "counting.py":
                continue
            for cls in counted_classes(ast.parse(path.read_text())):
                wrappers += 1
                found += [f"{path.relative_to(ROOT)}:{line} ({cls.name})" for line in writes_a_count(cls)]
    assert wrappers >= 6  # the walk sees the methods' wrappers (eagle, glide, heads, amphista, swift, ...)
    assert found == []


def test_the_rule_catches_a_wrapper_that_counts_for_itself():
    probe = ast.parse("class CountedProbe(Counted):\n    def __call__(self, x):\n        self.flops -= 1\n")
    assert [writes_a_count(c) for c in counted_classes(probe)] == [[3]]


def test_a_counted_lm_runs_the_head_on_the_rows_kept(tiny_pair):
    """logits_to_keep=1 (a prefill) counts the head on one row only: fewer FLOPs than the whole output."""
    from transformers import DynamicCache

    from core.counting import CountedLM

    lm = CountedLM(tiny_pair.target.module, "probe")
    ids = torch.tensor([[1, 2, 3, 4]])
    lm(ids, DynamicCache(), logits_to_keep=1)
    one = lm.flops
    lm.reset()
    lm(ids, DynamicCache())
    assert lm.flops - one == pytest.approx(2.0 * lm.head_weights * 3)
