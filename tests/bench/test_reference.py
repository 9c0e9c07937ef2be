"""The optimised plain-decoding reference (bench/reference.py), dry-run on the CPU with the static cache uncompiled
(``reference=static``; ``compiled`` is the same loop with torch.compile, the default on CUDA: tests/test_gpu.py)."""

import json
import logging

import pytest
import torch
from omegaconf import OmegaConf

from bench import reference, saved
from bench.results import read_records
from core.errors import BenchError


@pytest.fixture(scope="module")
def static_run(compose_cfg, tmp_path_factory):
    """``method=sd reference=static`` on the tiny pair, 3 prompts, no warm-up asked for."""
    from bench.runner import run

    out = tmp_path_factory.mktemp("ref")
    rows = run(compose_cfg("pair=tiny", "method=sd", "reference=static", "max_new_tokens=10", "dataset.n_prompts=3",
                           "warmup=0"), out)
    return out, rows, read_records(out / "records.jsonl")


def by_method(records):
    out = {}
    for r in records:
        out.setdefault(r["method"], {})[r["prompt_id"]] = r
    return out


def test_the_reference_decodes_ar_s_tokens_and_is_counted_as_ar(static_run):
    """Each prompt is decoded by ar, sd and ar_static; the reference's tokens are ar's, its forwards and FLOPs are
    ar's for the same tokens, and it holds nothing beyond the target."""
    _, _, records = static_run
    m = by_method(records)
    assert set(m) == {"ar", "sd", "ar_static"} and len(m["ar_static"]) == 3
    for pid, ref in m["ar_static"].items():
        ar = m["ar"][pid]
        assert ref["output_ids"] == ar["output_ids"] and ref["matches_baseline"] is True and ref["divergence"] is None
        assert ref["target_calls"] == ar["target_calls"] == len(ar["output_ids"])
        assert ref["flops"]["target"] == pytest.approx(ar["flops"]["target"])
        assert ref["accept_lengths"] == ar["accept_lengths"] and ref["lossless"] and ref["recipe"] is None
        assert 0 < ref["ttft_s"] < ref["wall_s"] and ref["method_param_bytes"] == 0
        assert ref["method_cfg"] == {"name": "ar_static", "cache": "static", "compiled": False, "compile_mode": None}


def test_every_record_carries_its_speedup_against_the_reference(static_run):
    """Per prompt: the reference's seconds per token over the record's (1 for itself), beside the speedup against
    ar; the summary re-pairs them from the files and shows the reference's row after the baseline's."""
    out, rows, records = static_run
    m = by_method(records)
    for pid, ref in m["ar_static"].items():
        assert ref["speedup_vs_ref"] == 1.0
        for name in ("ar", "sd"):
            rec = m[name][pid]
            expected = (ref["wall_s"] / ref["new_tokens"]) / (rec["wall_s"] / rec["new_tokens"])
            assert rec["speedup_vs_ref"] == pytest.approx(expected)
    assert [r["label"] for r in rows] == ["ar", "ar_static", "sd"]
    sd = next(r for r in rows if r["label"] == "sd")
    assert sd["speedup_vs_ref"] == pytest.approx(sorted(r["speedup_vs_ref"] for r in m["sd"].values())[1])
    assert json.loads((out / "run.json").read_text())["reference"]["name"] == "ar_static"


def test_the_reference_is_warmed_up_even_without_warmup(compose_cfg, tmp_path, monkeypatch):
    """warmup=0: the methods start cold, as asked, but the reference decodes once before any timed prompt (compiling
    its step and recording its CUDA graph must never land in a timed decode)."""
    from bench import runner

    seen = []
    real = runner.timed_decode

    def spy(method, pair, prompt_ids, max_new, sampling, seed):
        seen.append((method.name, max_new))
        return real(method, pair, prompt_ids, max_new, sampling, seed)

    monkeypatch.setattr(runner, "timed_decode", spy)
    runner.run(compose_cfg("pair=tiny", "method=ar", "reference=static", "max_new_tokens=4", "dataset.n_prompts=1",
                           "warmup=0"), tmp_path)
    assert seen[0] == ("ar_static", reference.WARMUP_TOKENS)
    assert sorted(seen[1:]) == [("ar", 4), ("ar_static", 4)]


def test_a_reference_that_leaves_ar_is_recorded_and_said(compose_cfg, tmp_path, monkeypatch, caplog):
    """Never silently: a reference whose tokens differ from ar's says so in its record (matches_baseline false, where
    and how close the target's choice was) and in the log."""
    from bench.runner import run

    real = reference.Reference.decode

    def off_by_one(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        out.output_ids[-1] = (out.output_ids[-1] + 1) % 50
        return out

    monkeypatch.setattr(reference.Reference, "decode", off_by_one)
    with caplog.at_level(logging.WARNING, logger="bench.runner"):
        run(compose_cfg("pair=tiny", "method=ar", "reference=static", "max_new_tokens=6", "dataset.n_prompts=1",
                        "warmup=0"), tmp_path)
    ref = next(r for r in read_records(tmp_path / "records.jsonl") if r["method"] == "ar_static")
    assert ref["matches_baseline"] is False and ref["divergence"]["position"] == 5
    assert "ar_static's tokens leave ar's" in caplog.text and "position 5" in caplog.text
    row = next(r for r in json.loads((tmp_path / "run.json").read_text())["summary"] if r["label"] == "ar_static")
    assert row["matches_baseline"] == 0 and row["tie_flips"] + row["mismatches"] == 1


def test_no_reference_on_the_cpu_by_default(compose_cfg, tmp_path):
    from bench.runner import run

    run(compose_cfg("pair=tiny", "method=ar", "max_new_tokens=4", "dataset.n_prompts=1", "warmup=0"), tmp_path)
    records = read_records(tmp_path / "records.jsonl")
    assert [r["method"] for r in records] == ["ar"] and "speedup_vs_ref" not in records[0]
    assert records[0]["method_param_bytes"] == 0 and records[0]["peak_decode_bytes"] is None  # CPU: no per-decode peak


@pytest.mark.parametrize("setting,device,temperature,packed,expected", [
    ("auto", "cpu", 0.0, True, None),
    ("auto", "cuda", 0.0, False, "compiled"),
    ("auto", "cuda", 0.7, False, None),  # a sampling run: plain greedy decoding is no reference for it
    ("none", "cuda", 0.0, False, None),
    ("static", "cpu", 0.0, True, "static"),
    ("compiled", "cpu", 0.0, False, "compiled"),
])
def test_which_reference_a_run_times(setting, device, temperature, packed, expected):
    cfg = OmegaConf.create({"reference": setting, "temperature": temperature})
    assert reference.mode_for(cfg, torch.device(device), packed) == expected


@pytest.mark.parametrize("setting,temperature,packed,words", [
    ("static", 0.7, False, "reference=static is greedy plain decoding; run it with temperature=0"),
    ("compiled", 0.0, True, "reference=compiled on the CPU in float32 needs packed_linear=false"),
])
def test_a_reference_that_cannot_run_is_one_sentence(setting, temperature, packed, words):
    cfg = OmegaConf.create({"reference": setting, "temperature": temperature})
    with pytest.raises(BenchError, match=words):
        reference.mode_for(cfg, torch.device("cpu"), packed)


def test_saved_results_know_the_references_names():
    assert set(reference.NAMES.values()) == set(saved.REFERENCES)


def test_the_reference_lets_go_of_its_compiled_step_when_the_run_ends(compose_cfg, tmp_path, monkeypatch):
    """A compiled reference's step (kept on the model by transformers) and torch's compile caches (which hold the
    model's weights and, on CUDA, the CUDA graphs' pool) are released when the run ends, failed or not: a sweep's
    next run must not decode beside the last one's target."""
    from bench import runner

    resets, closed = [], []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    pair = runner.load_pair(compose_cfg("pair=tiny"))
    ref = reference.Reference("compiled", pair, [], 32)
    pair.target.module._compiled_call = object()  # what transformers' get_compiled_call leaves on the model
    ref.close()
    assert not hasattr(pair.target.module, "_compiled_call") and resets == [1] and ref.cache is None
    reference.Reference("static", pair, [], 32).close()
    assert resets == [1]  # nothing compiled, nothing to reset

    real = reference.Reference.close
    monkeypatch.setattr(reference.Reference, "close", lambda self: closed.append(self.name) or real(self))
    monkeypatch.setattr(reference.Reference, "decode", lambda self, *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.run(compose_cfg("pair=tiny", "method=ar", "reference=static", "max_new_tokens=4",
                               "dataset.n_prompts=1", "warmup=0"), tmp_path)
    assert closed == ["ar_static"]
