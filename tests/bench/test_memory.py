"""Memory per method (bench/memory.py): what a method holds beyond the target, and the decode's own CUDA peak."""

import dataclasses

import pytest
import torch
from torch import nn

from bench import memory
from core.counting import CountedModule
from methods.base import Method
from tests.helpers import build
from tests.methods.heads.test_heads import TINY_RECIPE


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers as nn.Module lists them (a shared Parameter once)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.fixture()
def pair(tiny_pair):
    """The tiny pair (target and one draft) with a role table of its own."""
    return dataclasses.replace(tiny_pair, roles={})


def test_ar_holds_nothing_beyond_the_target_even_beside_a_loaded_draft(pair):
    assert pair.drafts and memory.method_param_bytes(build(pair, "ar")) == 0


def test_sd_holds_its_draft(pair):
    draft = pair.drafts[0].module
    assert module_bytes(draft) > 0
    assert memory.method_param_bytes(build(pair, "sd")) == module_bytes(draft)


def test_medusa_holds_its_heads_as_their_shapes_say(pair):
    """K heads, each one zero-started block ``W h + b`` (hidden x hidden, bias) and a projection onto V' tokens (no
    bias), plus the int64 map of those V' ids: computed from the shapes, not from the storages walked."""
    method = build(pair, "medusa", recipe=TINY_RECIPE)
    heads = method.heads.module
    h, k, v = pair.target.module.config.hidden_size, heads.num_heads, heads.vocab_map.numel()
    size = pair.dtype.itemsize
    expected = k * (h * h + h) * size + k * h * v * size + v * 8
    assert memory.method_param_bytes(method) == expected == module_bytes(heads)


def test_each_storage_counts_once_and_the_targets_never(pair):
    """Tensors a method keeps itself count (a nested method's too), a view or a second reference adds nothing, a
    module shared with the target (its embeddings) adds nothing, a registered role's module counts."""

    class Holder(Method):
        name = "holder"

    method = Holder({}, pair)
    method.table = torch.zeros(10)  # 40 bytes
    method.again = [method.table, method.table[:5]]  # the same storage twice more
    method.embed = pair.target.module.get_input_embeddings()  # the target's: not the method's
    method.inner = Holder({}, pair)
    method.inner.table = torch.zeros(3, dtype=torch.float64)  # 24 bytes, in a nested method
    head = nn.Linear(4, 2)  # 8 + 2 floats: 40 bytes
    method.head = pair.add(CountedModule(head, "head"))  # a role, and an attribute: once
    assert memory.method_param_bytes(method) == 40 + 24 + 40


def test_the_decode_peak_is_the_allocators_peak_above_the_start(monkeypatch):
    """On CUDA: the peak is reset and the allocation read before the decode, the peak read after; off CUDA: None."""
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 1700)
    cuda = torch.device("cuda")
    start = memory.decode_start(cuda)
    assert calls == ["reset"] and start == 1000 and memory.decode_peak(cuda, start) == 700
    cpu = torch.device("cpu")
    assert memory.decode_start(cpu) is None and memory.decode_peak(cpu, None) is None
