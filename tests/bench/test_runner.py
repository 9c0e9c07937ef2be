"""The runner on the tiny pair: the baseline's own config, and what each record carries."""

import json
import math

import pytest

from bench.results import read_records


def test_baseline_gets_its_own_full_method_config(compose_cfg, tmp_path):
    """``baseline=sd method=pld``: the baseline is built from sd's declared settings (gamma and all), not
    from its name alone, and the method's speedups are paired against it."""
    from bench.runner import run

    cfg = compose_cfg("pair=tiny", "method=pld", "baseline=sd", "max_new_tokens=8", "dataset.n_prompts=2", "warmup=0")
    run(cfg, tmp_path)
    records = read_records(tmp_path / "records.jsonl")
    assert sorted(r["method"] for r in records) == ["pld", "pld", "sd", "sd"]
    sd = [r for r in records if r["method"] == "sd"]
    assert all(r["method_cfg"]["gamma"] == 4 and "confidence" in r["method_cfg"] for r in sd)
    assert all(r["draft_calls"] > 0 for r in sd)  # the baseline really drafted
    assert all(r["matches_baseline"] for r in records if r["method"] == "pld")  # both lossless, greedy


def test_a_method_and_its_baseline_count_their_own_parts(compose_cfg, tmp_path):
    """``method=amphista baseline=medusa``: both register a ``heads`` role; each record counts its own method's
    heads (medusa's calls were lost to amphista's role once), and amphista's adaptation layers only in its own."""
    from bench.runner import run

    cfg = compose_cfg("pair=tiny", "method=amphista", "baseline=medusa", "max_new_tokens=10", "dataset.n_prompts=2",
                      "warmup=0", "recipe=smoke", f"cache_dir={tmp_path / 'cache'}")
    cfg.method.recipe.vocab = cfg.method.recipe.batch_size = 64
    run(cfg, tmp_path / "run")
    records = read_records(tmp_path / "run" / "records.jsonl")
    assert sorted(r["method"] for r in records) == ["amphista", "amphista", "medusa", "medusa"]
    for r in records:
        assert r["calls"]["heads"] > 0 and r["flops"]["heads"] > 0
        assert (r["calls"].get("adapt1", 0) > 0) == (r["method"] == "amphista")  # its adaptation stages' roles


def test_declared_settings_inherit():
    """hydra_pp's settings extend hydra's declaration (a subclass): its own recipe defaults, hydra's tree."""
    from methods.registry import get_method

    hpp = get_method("hydra_pp").settings({})
    assert hpp.name == "hydra_pp" and hpp.recipe.loss == "teacher" and hpp.recipe.prefix_layer
    assert len(hpp.tree) == 19 and hpp.recipe.num_heads == 4  # from hydra's declaration
    assert json.loads(json.dumps(dict(get_method("ar").settings({})))) == {"name": "ar", "by_batch": None}


def test_lossy_mismatches_carry_their_divergence(compose_cfg, tmp_path):
    """sprinter with threshold 0 lets every drafted token through unchecked: its greedy outputs leave ar's.
    Each such record says where (the first differing index), with the target's finite top-1 − top-2 margin
    there and the fp32 ε; records equal to ar's (and ar's own) carry divergence null; the summary counts
    tie flips and mismatches apart."""
    import math

    from bench.runner import run
    from tests.methods.test_sprinter import TINY_RECIPE

    overrides = [f"method.verifier.{k}={v}" for k, v in TINY_RECIPE.items()]
    cfg = compose_cfg("pair=tiny", "method=sprinter", "method.threshold=0", "max_new_tokens=12", "dataset.n_prompts=4",
                      "warmup=0", "method.max_run=4", *overrides)
    rows = {r["method"]: r for r in run(cfg, tmp_path)}
    records = read_records(tmp_path / "records.jsonl")
    ar = {r["prompt_id"]: r for r in records if r["method"] == "ar"}
    spr = [r for r in records if r["method"] == "sprinter"]
    assert all(r["divergence"] is None for r in ar.values())
    differing = [r for r in spr if not r["matches_baseline"]]
    assert differing, "threshold 0 should make sprinter leave ar's tokens on the tiny pair"
    for r in spr:
        base = ar[r["prompt_id"]]["output_ids"]
        if r["matches_baseline"]:
            assert r["divergence"] is None
            continue
        d = r["divergence"]
        i = d["position"]
        assert r["output_ids"][:i] == base[:i] and (i == min(len(base), len(r["output_ids"])) or r["output_ids"][i] != base[i])
        assert math.isfinite(d["margin"]) and d["margin"] >= 0 and d["eps"] == 1e-3 and d["tie"] == (d["margin"] < 1e-3)
        assert r["target_calls"] == 1 + len(r["accept_lengths"])  # the margin's forward is not counted
    ties = sum(r["divergence"]["tie"] for r in differing)
    assert rows["sprinter"]["tie_flips"] == ties and rows["sprinter"]["mismatches"] == len(differing) - ties
    assert rows["sprinter"]["matches_baseline"] == 1 - len(differing) / len(spr)
    assert rows["ar"]["tie_flips"] is None and rows["ar"]["mismatches"] is None


@pytest.mark.newest_only  # the runner around compiled forwards, which tests/core/test_compiled.py checks in both legs
def test_a_compiled_run_says_what_it_compiled(compose_cfg, tmp_path):
    """``compile=true``: the baseline and the method decode through the same compiled forwards, the method's draft
    model through its own, greedy-equal; every record says so, and run.json names each model's buckets and each one's
    compile seconds (taken before any clock)."""
    from bench.runner import run

    cfg = compose_cfg("pair=tiny", "method=sd", "compile=true", "compile_buckets=[1,16]", "max_new_tokens=12",
                      "dataset.n_prompts=2", "warmup=1")
    run(cfg, tmp_path)
    records = read_records(tmp_path / "records.jsonl")
    assert sorted(r["method"] for r in records) == ["ar", "ar", "sd", "sd"]
    assert all(r["compile"] is True and r["compile_buckets"] == "1,16" and r["compile_batch_sizes"] is None
               for r in records)  # the target's graphs' buckets; no batch
    assert all(r["matches_baseline"] for r in records if r["method"] == "sd")
    # Every draft forward ran compiled but the prompt's (beyond 16 rows, as the target's): its one-token steps too.
    assert all(r["uncompiled_calls"] == {"target": 1, "draft": 1} and r["calls"]["draft"] > 1 for r in records
               if r["method"] == "sd")
    prov = json.loads((tmp_path / "run.json").read_text())
    assert set(prov["compile"]) == {"target", "draft"}
    for role in ("target", "draft"):
        assert prov["compile"][role]["buckets"] == [1, 16] and set(prov["compile"][role]["compile_s"]) == {"1", "16"}
    assert prov["kernels"] == {}  # no packed weights under compile: inductor's freezing packs per graph
    assert not any(prov["compile"][role]["reused"] for role in ("target", "draft"))

    # The next job of a sweep in this process (same pair, dataset and buckets): the models and their graphs kept,
    # nothing compiled again, each checked again; the method needs no draft, which stays kept for a later job. Its own
    # draft layer (EAGLE's) is compiled for this job alone (its two buckets), and let go with its code when it ends.
    from torch._dynamo.utils import counters
    from torch._inductor.codecache import PyCodeCache

    from bench import kept

    graphs, code = counters["stats"]["unique_graphs"], len(PyCodeCache.modules)
    run(compose_cfg("pair=tiny", "method=eagle", "compile=true", "compile_buckets=[1,16]", "max_new_tokens=12",
                    "dataset.n_prompts=2", "warmup=1"), tmp_path / "next")
    assert counters["stats"]["unique_graphs"] == graphs + 2 and len(PyCodeCache.modules) == code
    prov = json.loads((tmp_path / "next" / "run.json").read_text())
    assert set(prov["compile"]) == {"target", "eagle"} and prov["compile"]["target"]["reused"] is True
    assert prov["compile"]["eagle"]["reused"] is False and set(prov["compile"]["eagle"]["compile_s"]) == {"1", "16"}
    records = read_records(tmp_path / "next" / "records.jsonl")
    assert all(r["matches_baseline"] for r in records)
    assert all(r["uncompiled_calls"]["eagle"] <= 1 < r["calls"]["eagle"] for r in records if r["method"] == "eagle")
    assert set(kept.held()) == {"target", "draft"}
    # Other buckets: the same models, their forwards compiled anew; an eager run lets everything go first.
    run(compose_cfg("pair=tiny", "method=ar", "compile=true", "compile_buckets=[1,4]", "max_new_tokens=4",
                    "dataset.n_prompts=1", "warmup=0"), tmp_path / "other")
    prov = json.loads((tmp_path / "other" / "run.json").read_text())
    assert prov["compile"]["target"]["reused"] is False and counters["stats"]["unique_graphs"] > graphs
    run(compose_cfg("pair=tiny", "method=ar", "max_new_tokens=4", "dataset.n_prompts=1", "warmup=0"), tmp_path / "eager")
    assert kept.held() == {}
    assert all(r["compile_buckets"] is None and r["compile_batch_sizes"] is None
               for r in read_records(tmp_path / "eager" / "records.jsonl"))


@pytest.mark.newest_only  # the runner around compiled forwards, which tests/core/test_compiled.py checks in both legs
def test_a_compiled_batch_run_lets_go_of_its_frozen_weights(compose_cfg, tmp_path):
    """A compiled batch run keeps nothing for the next job of a sweep: when it ends, no module inductor generated for
    its graphs still holds a tensor (with freezing, each holds its graph's frozen weights; a sweep of such jobs grew
    by a copy of the pair per job until one was killed for memory)."""
    import sys

    import torch

    from bench.runner import run

    run(compose_cfg("pair=tiny", "method=pld", "batch_size=2", "compile=true", "compile_buckets=[1,16]",
                    "max_new_tokens=8", "dataset.n_prompts=2", "warmup=0"), tmp_path)
    records = read_records(tmp_path / "records.jsonl")
    assert all(r["matches_baseline"] is not False for r in records)
    # Graphs for the 2 rows only (the CPU's default: B alone, core.compiled.compiled_batch_sizes).
    assert all(r["compile_buckets"] == "1,16" and r["compile_batch_sizes"] == "2" for r in records)
    holding = [name for name, mod in list(sys.modules.items()) if name.startswith("torch._inductor.runtime.compile_tasks.")
               and any(isinstance(v, torch.Tensor) for v in vars(mod).values())]
    assert holding == []


def test_a_batch_run_records_each_prompt_as_its_decode_alone(compose_cfg, tmp_path):
    """``batch_size=2`` on 3 prompts (a last group of one): each record says its batch, its tokens are the same
    prompt's at batch_size=1 (lossless per row, the baseline's and the method's), its counts are its own row's, and
    the run key differs from batch_size=1's (a resumed run never mixes them)."""
    from bench.runner import run

    settings = ("pair=tiny", "method=sd", "max_new_tokens=12", "dataset.n_prompts=3", "warmup=1")
    run(compose_cfg(*settings), tmp_path / "one")
    run(compose_cfg(*settings, "batch_size=2"), tmp_path / "two")
    alone = {(r["method"], r["prompt_id"]): r for r in read_records(tmp_path / "one" / "records.jsonl")}
    batched = read_records(tmp_path / "two" / "records.jsonl")
    assert len(batched) == 6 and sorted(r["batch"]["size"] for r in batched) == [1, 1, 2, 2, 2, 2]
    for r in batched:
        ref = alone[(r["method"], r["prompt_id"])]
        assert r["batch_size"] == 2 and r["output_ids"] == ref["output_ids"] and r["matches_baseline"] is not False
        assert r["calls"]["target"] == len(r["accept_lengths"]) + 1 and r["run_key"] != ref["run_key"]
        assert 0 < r["ttft_s"] <= r["wall_s"] <= r["batch"]["wall_s"] + 1e-9
    assert all(r["calls"]["draft"] > 0 for r in batched if r["method"] == "sd")  # the drafts, row by row, counted
    prov = json.loads((tmp_path / "two" / "run.json").read_text())
    assert prov["compile"]["target"]["rows"] == 2 and prov["compile"]["target"]["compiled"] is False
    # The summary: throughput counts each group's seconds once; the two runs read together are labelled apart.
    from bench import saved, summary

    sd = [r for r in batched if r["method"] == "sd"]
    groups = {(r["batch"]["size"], r["batch"]["wall_s"]): r["batch"]["new_tokens"] for r in sd}
    row = summary.run_summary(tmp_path / "two").set_index("method").loc["sd"]
    assert row["batch_size"] == 2 and row["throughput"] == pytest.approx(
        sum(groups.values()) / sum(wall for _, wall in groups))
    assert math.isnan(row["throughput_vs_ar1"])  # one batch size: no ar at B = 1 to compare with
    df, _ = saved.load([str(tmp_path / "one"), str(tmp_path / "two")])
    both = summary.summary_table(df).set_index("label")
    assert set(both.index) == {f"{m} (batch_size={b})" for m in ("ar", "sd") for b in (1, 2)}
    # Throughput over ar's one prompt at a time, the B = 1 run's ar row in the same table.
    ar1 = both.loc["ar (batch_size=1)", "throughput"]
    assert both["throughput_vs_ar1"].to_dict() == pytest.approx({k: v / ar1 for k, v in both["throughput"].items()})
    # Each batch row's tokens against ar's for the prompt alone, read across the two runs: all of them here.
    assert both.loc["sd (batch_size=2)", "matches_ar1"] == both.loc["ar (batch_size=2)", "matches_ar1"] == 1.0
    assert math.isnan(both.loc["sd (batch_size=1)", "matches_ar1"])
