"""core/clock.py: ``sync`` waits for a CUDA device only, ``clocked`` reads the clock between two syncs and runs the
function under inference mode. No GPU needed: torch.cuda.synchronize is replaced by a recorder."""

import time
import types

import pytest
import torch

from core import clock


# Release-independent (no transformers model is loaded or called here): CI's oldest-transformers leg skips it.
pytestmark = pytest.mark.newest_only


@pytest.fixture
def cuda_syncs(monkeypatch):
    """The devices torch.cuda.synchronize is called with."""
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(device))
    return seen


def test_sync_on_cpu_does_nothing(cuda_syncs):
    clock.sync(torch.device("cpu"))
    assert cuda_syncs == []


@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_sync_on_cuda_synchronises_that_device(cuda_syncs, name):
    device = torch.device(name)
    clock.sync(device)
    assert cuda_syncs == [device]


def test_clocked_returns_the_result_and_the_time_it_took():
    def slow_sum(a, b, *, pause):
        time.sleep(pause)
        return a + b

    out, seconds = clock.clocked(torch.device("cpu"), slow_sum, 2, 3, pause=0.05)
    assert out == 5
    assert 0.05 <= seconds < 5.0


def test_clocked_runs_under_inference_mode():
    seen = {}

    def probe():
        seen["inference"] = torch.is_inference_mode_enabled()
        return torch.ones(2) * 2

    out, _ = clock.clocked(torch.device("cpu"), probe)
    assert seen["inference"] and out.is_inference()
    assert not torch.is_inference_mode_enabled()  # and leaves it after


def test_clocked_syncs_before_each_clock_read(monkeypatch):
    """The order is sync, read, run, sync, read; the time is the difference of the two reads."""
    events = []
    readings = iter([10.0, 12.5])
    device = torch.device("cuda")

    def fake_sync(d):
        assert d is device
        events.append("sync")

    def perf_counter():
        events.append("read")
        return next(readings)

    monkeypatch.setattr(clock, "sync", fake_sync)
    monkeypatch.setattr(clock, "time", types.SimpleNamespace(perf_counter=perf_counter))
    out, seconds = clock.clocked(device, lambda: events.append("run") or "done")
    assert events == ["sync", "read", "run", "sync", "read"]
    assert (out, seconds) == ("done", 2.5)


def test_clocked_on_cuda_calls_torch_cuda_synchronize(cuda_syncs):
    device = torch.device("cuda")
    clock.clocked(device, lambda: None)
    assert cuda_syncs == [device, device]
