"""The GPU path: every method on the tiny pairs of every family, on CUDA (marked ``gpu``; skipped without CUDA).

On a machine with a GPU: ``.venv/bin/python -m pytest -m gpu`` (a few minutes on an H100; the trained parts train
on the GPU under ``recipe=smoke``). What it checks:

- the pair lands on the device in the asked dtype, and the packed CPU kernels stay off there;
- fp32: every method of the registry on ``pair=tiny`` and the four ``tiny_<family>`` pairs decodes greedily and
  by sampling, and a lossless method's greedy output equals ``ar``'s token for token (the walk of
  ``tests/test_families.py`` and ``tests/methods/test_methods.py``, moved to the device);
- bf16 (the harness's CUDA default): every method decodes; greedy outputs are not asserted equal, since a
  multi-token forward may round differently from one-token steps, which the harness's ``divergence`` column
  names per record (near-tie or not);
- a batch of 3 (issue 41), eager and compiled: GliDe's draft reading the target's batch cache, graphs per batch size;
- the harness end to end: the clock, the CUDA peak memory (``torch.cuda.max_memory_allocated``) and the decode's own
  peak within it, each method's own bytes, the GPU's name, and the compiled reference ``reference=auto`` times there.

``BENCH_GPU_TEST_DEVICE=cpu`` runs the same tests on the CPU (a dry run of this file where no GPU is lent).
Tensors created on an implicit device are caught without a GPU by ``tests/test_device.py``.
"""

import json
import os

import pytest
import torch

from methods.registry import get_method, known_methods
from tests.helpers import assert_greedy_equal_to_ar, build, prompts_for, run, trained_pair
from tests.test_families import REFUSED

DEVICE = os.environ.get("BENCH_GPU_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                                  reason="no CUDA device (BENCH_GPU_TEST_DEVICE=cpu for a dry run)")]
FAMILIES = {"tiny": "llama", "tiny_gpt2": "gpt2", "tiny_qwen2": "qwen2", "tiny_mistral": "mistral",
            "tiny_gemma": "gemma"}
MAX_NEW = 16


@pytest.fixture(scope="module")
def on_device(compose_cfg, tmp_path_factory):
    """``(pair name, dtype) -> (pair, prompts)`` loaded once each on the device, with a cache of their own: every
    trained part (heads, drafts, masks, verifiers, datastores) is trained here, on the device, not read back
    from the CPU tests' cache."""

    loaded, cache = {}, tmp_path_factory.mktemp("gpu-cache")

    def get(name, dtype="float32"):
        if (name, dtype) not in loaded:
            pair = trained_pair(compose_cfg(f"pair={name}", f"device={DEVICE}", f"dtype={dtype}", f"cache_dir={cache}"))
            loaded[name, dtype] = pair, prompts_for(pair, 2)
        return loaded[name, dtype]

    return get


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_pair_is_on_the_device_without_packed_kernels(dtype, on_device):
    from core.kernels import PackedLinear

    pair, _ = on_device("tiny", dtype)
    assert pair.device.type == torch.device(DEVICE).type and pair.dtype == getattr(torch, dtype)
    for lm in (pair.target, *pair.drafts):
        params = list(lm.module.parameters())
        assert {p.device.type for p in params} == {pair.device.type} and {p.dtype for p in params} == {pair.dtype}
        packed = any(isinstance(m, PackedLinear) for m in lm.module.modules())
        assert packed == (pair.device.type == "cpu" and dtype == "float32")


@pytest.mark.parametrize("pair_name", list(FAMILIES))
@pytest.mark.parametrize("name", known_methods())
def test_every_method_in_fp32_is_ars_output(name, pair_name, on_device):
    if (name, FAMILIES[pair_name]) in REFUSED:
        return  # refused before any model loads (tests/test_families.py asserts the sentence)
    pair, prompts = on_device(pair_name)
    method = build(pair, name)
    if get_method(name).lossless:
        assert_greedy_equal_to_ar(method, prompts, max_new=MAX_NEW)
    out = run(method, prompts[0], MAX_NEW, temperature=0.8)
    assert 0 < len(out.output_ids) <= MAX_NEW


@pytest.mark.parametrize("name", known_methods())
def test_every_method_decodes_in_bf16(name, on_device):
    pair, prompts = on_device("tiny", "bfloat16")
    method = build(pair, name)
    for temperature in (0.0, 0.8):
        out = run(method, prompts[0], MAX_NEW, temperature)
        assert 0 < len(out.output_ids) <= MAX_NEW and len(out.accept_lengths) == len(out.drafted)


def test_the_harness_on_the_device(compose_cfg, on_device, tmp_path):
    """The clock, the memory figures and, on CUDA, the optimised reference the default ``reference=auto`` times there
    (``ar_compiled``: static cache, torch.compile; its warm-up compiles it): ar's tokens, and a speedup against it in
    every record."""
    from bench.runner import run as harness_run

    harness_run(compose_cfg("pair=tiny", "method=sd", f"device={DEVICE}", "dtype=float32", "max_new_tokens=8",
                            "dataset.n_prompts=2", "warmup=1"), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    prov = json.loads((tmp_path / "run.json").read_text())
    cuda = DEVICE.startswith("cuda")
    assert prov["device"].startswith(DEVICE) and (prov["gpu"] is not None) == cuda
    assert (prov["cuda"] is not None) == cuda
    assert {r["method"] for r in records} == {"sd", "ar"} | ({"ar_compiled"} if cuda else set())
    assert all(r["wall_s"] > 0 and r["peak_mem_bytes"] > 0 and r["new_tokens"] > 0 for r in records)
    assert all(r["matches_baseline"] for r in records if r["method"] == "sd")
    pair, _ = on_device("tiny")
    draft = pair.drafts[0].module
    draft_bytes = sum(t.numel() * t.element_size() for t in [*draft.parameters(), *draft.buffers()])
    own = {r["method"]: r["method_param_bytes"] for r in records}
    assert own == {"ar": 0, "sd": draft_bytes, **({"ar_compiled": 0} if cuda else {})}
    if cuda:  # the allocator's peak since its reset holds at least the pair's weights; the decode's own peak is in it
        weights = sum(p.numel() * p.element_size() for lm in (pair.target, *pair.drafts) for p in lm.module.parameters())
        assert all(r["peak_mem_bytes"] >= weights for r in records)
        assert all(0 < r["peak_decode_bytes"] <= r["peak_mem_bytes"] - weights for r in records)
        assert prov["reference"]["compiled"] and all(r["speedup_vs_ref"] > 0 for r in records)
        # fp32: the compiled step's argmax is eager ar's, but for a rounding flip at a near-tie, which the record names
        assert all(r["matches_baseline"] or r["divergence"]["tie"] for r in records if r["method"] == "ar_compiled")
    else:  # no per-decode peak on the CPU, and no reference unless asked for
        assert all(r["peak_decode_bytes"] is None and "speedup_vs_ref" not in r for r in records)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_batch_on_the_device(compose_cfg, tmp_path, compiled):
    """Issue 41 on the device: ``glide`` (its draft reads the target's batch cache) against ``ar`` at B = 3, eager, then
    compiled (CUDA graphs per token bucket and per batch size, 1, 2 and 3 rows, the finished rows left out): every
    row is ``ar``'s at the same B, but for a rounding flip at a near-tie, which the record names."""
    from bench.runner import run as harness_run

    harness_run(compose_cfg("pair=tiny", "method=glide", f"device={DEVICE}", "dtype=float32", "max_new_tokens=8",
                            "dataset.n_prompts=4", "warmup=1", "batch_size=3", f"compile={str(compiled).lower()}",
                            "compile_buckets=[1,4,16]"), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    prov = json.loads((tmp_path / "run.json").read_text())
    assert {r["method"] for r in records} == {"glide", "ar"} and len(records) == 8
    assert all(r["batch_size"] == 3 for r in records)
    assert all(r["matches_baseline"] or r["divergence"]["tie"] for r in records if r["method"] == "glide")
    assert prov["compile"]["target"]["compiled"] == compiled
    if compiled:  # graphs per batch size by default on CUDA; on the CPU (a dry run) the batch's only
        assert prov["compile"]["target"]["batch_sizes"] == ([1, 2, 3] if DEVICE.startswith("cuda") else [3])


def test_the_static_reference_on_the_device(compose_cfg, tmp_path):
    """``reference=static`` (not compiled) on the device: ar's tokens exactly (the same eager kernels), counted as ar."""
    from bench.runner import run as harness_run

    harness_run(compose_cfg("pair=tiny", "method=ar", f"device={DEVICE}", "dtype=float32", "max_new_tokens=8",
                            "dataset.n_prompts=2", "warmup=0", "reference=static"), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    ref = [r for r in records if r["method"] == "ar_static"]
    assert len(ref) == 2 and all(r["matches_baseline"] and r["speedup_vs_ref"] == 1.0 for r in ref)


def test_a_distilled_draft_trains_on_the_device(compose_cfg, tmp_path, monkeypatch):
    """A missing distilled draft is trained beside the fp32 target on the run's device, then cast to the run's
    dtype; under ``sd`` it is ``ar``'s output (fp32)."""
    from training import distill

    seen = []
    real = distill.train_draft

    def spy(target, *args, **kwargs):
        seen.append((next(target.parameters()).device.type, next(target.parameters()).dtype))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(distill, "train_draft", spy)
    pair = trained_pair(compose_cfg("pair=tiny", f"device={DEVICE}", "dtype=float32", f"cache_dir={tmp_path}",
                                 "pair.drafts=[{source: distilled, recipe: {layers: [0, 1]}}]"))
    assert seen == [(torch.device(DEVICE).type, torch.float32)]
    assert type(pair.draft.module).__name__ == "DraftLM"
    assert next(pair.draft.module.parameters()).device.type == torch.device(DEVICE).type
    assert_greedy_equal_to_ar(build(pair, "sd"), prompts_for(pair, 2), max_new=MAX_NEW)


@pytest.mark.parametrize("name", ["medusa", "hydra_pp", "eagle", "eagle3", "glide"])
def test_published_drafters_load_on_the_device_and_equal_ar(name, on_device, tmp_path):
    """The authors' published layouts (tiny checkpoints written as the CPU tests write them) converted, moved to the
    device and decoding greedy-equal to ``ar`` in fp32."""
    from tests.methods.heads.test_published import hydra_file, medusa_file
    from tests.methods.eagle.test_published3 import eagle3_file
    from tests.methods.eagle.test_published import eagle_file
    from tests.methods.glide.test_published import glide_file

    pair, prompts = on_device("tiny")
    target = pair.target.module
    H, V = target.config.hidden_size, target.config.vocab_size
    cpu_target = type(target)(target.config).eval()
    cpu_target.load_state_dict({k: v.cpu() for k, v in target.state_dict().items()})
    folder = {"medusa": lambda: medusa_file(tmp_path / name, H, V),
              "hydra_pp": lambda: hydra_file(tmp_path / name, cpu_target, heads=4),
              "eagle": lambda: eagle_file(tmp_path / name, cpu_target)[0],
              "eagle3": lambda: eagle3_file(tmp_path / name, cpu_target, torch.arange(0, V, 2))[0],
              "glide": lambda: glide_file(tmp_path / name, cpu_target, layers=2)[0]}[name]()
    method = build(pair, name, weights=str(folder))
    role = "heads" if name in ("medusa", "hydra_pp") else name
    assert next(method.pair.roles[role].module.parameters()).device.type == torch.device(DEVICE).type
    assert_greedy_equal_to_ar(method, prompts, max_new=MAX_NEW)
