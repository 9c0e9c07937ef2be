"""Datasets, sweeps and resuming, and the table / plot / report commands.

Runs use the tiny random pair with a few prompts and tokens; tables and figures use synthetic records
whose expected numbers are known.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from bench.data import Prompt, encode, load_prompts, select
from bench.results import read_records
from core.errors import BenchError
from tests.helpers import ROOT

SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
needs_spec_bench = pytest.mark.skipif(not SPEC_BENCH.exists(), reason=f"Spec-Bench file not found at {SPEC_BENCH} (not shipped)")


def bench(*args, cache_dir, timeout=300, **popen):
    env = {**os.environ, "BENCH_CACHE": str(cache_dir), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench", *args]
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------- datasets


@needs_spec_bench
def test_spec_bench_all_questions_categories_and_first_turn(compose_cfg, tiny_pair):
    cfg = compose_cfg("dataset=spec_bench", f"dataset.path={SPEC_BENCH}")
    prompts = load_prompts(cfg.dataset, seed=0)
    assert len(prompts) == 480 and len({p.prompt_id for p in prompts}) == 480
    cats = pd.Series([p.category for p in prompts]).value_counts()
    assert {"translation", "summarization", "qa", "math_reasoning", "rag"} <= set(cats.index)
    assert cats["translation"] == 80 and cats["writing"] == 10 and len(cats) == 13
    multi = [p for p in prompts if len(p.turns) > 1]
    assert len(multi) == 80
    # Multi-turn questions are decoded on their first turn only.
    p = multi[0]
    assert encode(p, tiny_pair.tokenizer) == encode(Prompt("x", p.category, p.turns[:1]), tiny_pair.tokenizer)


@needs_spec_bench
def test_spec_bench_selection_is_reproducible_and_grows_as_a_superset(compose_cfg):
    cfg = compose_cfg("dataset=spec_bench", f"dataset.path={SPEC_BENCH}")
    prompts = load_prompts(cfg.dataset, seed=0)
    a, b, c = select(prompts, 26, 0), select(prompts, 26, 0), select(prompts, 26, 1)
    assert [p.prompt_id for p in a] == [p.prompt_id for p in b] != [p.prompt_id for p in c]
    assert pd.Series([p.category for p in a]).value_counts().eq(2).all()  # round-robin over the 13 categories
    # A larger selection keeps the smaller one, so a resumed sweep with more prompts only fills gaps.
    assert {p.prompt_id for p in a} <= {p.prompt_id for p in select(prompts, 52, 0)}


def test_spec_bench_format_from_url_and_missing_file(tmp_path, compose_cfg):
    rows = [{"question_id": 1, "category": "qa", "turns": ["Why?", "And then?"], "reference": ["Because.", "Then."]},
            {"question_id": 2, "category": "rag", "turns": ["Where?"]}]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose_cfg("dataset=spec_bench", f"dataset.path={path.as_uri()}")  # file:// goes through the URL path
    prompts = load_prompts(cfg.dataset, seed=0)
    assert [(p.prompt_id, p.category, p.reference) for p in prompts] == [("sb-1", "qa", "Because."), ("sb-2", "rag", None)]
    from bench.validate import validate

    with pytest.raises(BenchError, match="does not exist"):
        validate(compose_cfg("dataset=spec_bench", f"dataset.path={tmp_path / 'nope.jsonl'}"))


def test_gsm8k_references_are_final_answers_and_budget(compose_cfg, tiny_pair):
    cfg = compose_cfg("dataset=gsm8k", "dataset.n_prompts=null")
    prompts = load_prompts(cfg.dataset, seed=0)
    assert len(prompts) == 1319 and all(p.category == "math_reasoning" for p in prompts)
    assert prompts[0].reference == "18"  # Janet's ducks
    assert all(p.reference and "####" not in p.reference for p in prompts)
    text = tiny_pair.tokenizer.decode(encode(prompts[0], tiny_pair.tokenizer, cfg.dataset.template))
    assert "step by step" in text and "Janet" in text
    # The dataset's budget applies unless the command line gives one.
    from bench.validate import validate

    assert validate(cfg).max_new_tokens == 256
    assert validate(compose_cfg("dataset=gsm8k", "max_new_tokens=32")).max_new_tokens == 32
    assert validate(compose_cfg("dataset=default")).max_new_tokens == 128


def test_news_is_lee_test_articles(compose_cfg, tiny_pair):
    from core.corpus import lee_articles

    cfg = compose_cfg("dataset=news", "dataset.n_prompts=null")
    prompts = load_prompts(cfg.dataset, seed=0)
    assert [p.turns[0] for p in prompts] == list(lee_articles("test")) and len(prompts) == 50
    assert tiny_pair.tokenizer.decode(encode(prompts[0], tiny_pair.tokenizer, cfg.dataset.template)).find("Summarize") >= 0


@pytest.mark.parametrize("name,fields,fmt,streaming", [
    ("cnn_dailymail", {"article": "text of article {i}", "highlights": "summary {i}", "id": "id{i}"}, "json", True),
    ("wiki_summaries", {"full_text": "wiki article {i}", "summary": "short {i}"}, "parquet", False),
    ("lm1b", {"text": "a sentence {i}"}, "json", False),
])
def test_hub_datasets_load_through_load_dataset_on_local_files(tmp_path, compose_cfg, name, fields, fmt, streaming):
    rows = [{k: v.format(i=i) for k, v in fields.items()} for i in range(5)]
    path = tmp_path / f"data.{fmt}"
    if fmt == "json":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        pd.DataFrame(rows).to_parquet(path)
    cfg = compose_cfg(f"dataset={name}", f"dataset.hub.path={fmt}", f"dataset.hub.data_files={path}",
                      "dataset.hub.name=null", "dataset.hub.split=train", f"dataset.hub.streaming={streaming}",
                      "dataset.hub.limit=4", "dataset.n_prompts=3")
    prompts = load_prompts(cfg.dataset, seed=0)
    assert len(prompts) == 3
    text_field = cfg.dataset.text_field
    assert all(p.turns[0] in {r[text_field] for r in rows[:4]} for p in prompts)  # limit=4 rows read
    ref = cfg.dataset.reference_field
    for p in prompts:
        row = next(r for r in rows if r[text_field] == p.turns[0])
        assert p.reference == (row[ref] if ref else None)
        assert p.prompt_id == f"{name}-{row['id']}" if cfg.dataset.id_field else p.prompt_id.startswith(f"{name}-")
    bad = compose_cfg(f"dataset={name}", f"dataset.hub.path={fmt}", f"dataset.hub.data_files={path}",
                      "dataset.hub.name=null", "dataset.hub.split=train", "dataset.text_field=nope")
    with pytest.raises(BenchError, match="has no field 'nope'; its fields are"):
        load_prompts(bad.dataset, seed=0)


# ------------------------------------------------------------------------------------------- sweeps


def test_sweep_axes_compose(compose_cfg):
    for method in ("ar", "sd"):
        for dataset in ("default", "gsm8k", "news"):
            for temperature in (0.0, 0.7):
                extra = ["method.gamma=2"] if method == "sd" else []
                cfg = compose_cfg(f"method={method}", "pair=tiny", f"dataset={dataset}", f"temperature={temperature}", *extra)
                assert (cfg.method.name, cfg.pair.name, cfg.dataset.name, cfg.temperature) == (method, "tiny", dataset, temperature)
                assert cfg.method.get("gamma") == (2 if method == "sd" else None)


def test_launcher_configs_compose(compose_cfg):
    from bench.cli import compose

    assert compose(["hydra/launcher=joblib"], hydra=True).hydra.launcher._target_.endswith("JoblibLauncher")
    slurm = compose(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], hydra=True).hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher") and slurm.gpus_per_node == 1 and slurm.partition == "gpu"
    assert compose(["hydra/launcher=submitit_local"], hydra=True).hydra.launcher._target_.endswith("LocalLauncher")
    # resume=DIR names the run and sweep directories.
    cfg = compose(["resume=/tmp/some/sweep"], hydra=True)
    assert cfg.hydra.run.dir == cfg.hydra.sweep.dir == "/tmp/some/sweep"


def _needs_ray():
    try:
        import hydra_plugins.hydra_ray_launcher  # noqa: F401
    except ImportError:
        pytest.skip("hydra-ray-launcher is not installed (the `ray` extra: it pins cloudpickle 2.2.1, so it is "
                    "opt-in; .ci/run installs it)")


def test_ray_launcher_config_composes():
    _needs_ray()
    from bench.cli import compose

    assert compose(["hydra/launcher=ray"], hydra=True).hydra.launcher._target_.endswith("RayLauncher")


@pytest.mark.newest_only
def test_local_ray_sweep_writes_every_job(tmp_path, cache_dir):
    """Two jobs on a local Ray cluster started by the launcher itself (seconds on 2 cores)."""
    _needs_ray()
    res = bench("run", "-m", "hydra/launcher=ray", "method=sd,pld", "pair=tiny", "max_new_tokens=8",
                "dataset.n_prompts=2", f"hydra.sweep.dir={tmp_path}", cache_dir=cache_dir, timeout=400)
    assert res.returncode == 0, res.stderr[-2000:]
    found = sorted(p.parent.parent.name for p in tmp_path.glob("*/*/records.jsonl"))
    assert found == ["pld_tiny_default", "sd_tiny_default"]


def _records(path):
    return {r["run_key"]: r for r in read_records(path)}


@pytest.mark.newest_only
def test_joblib_sweep_then_resume_skips_complete_and_fills_gaps(tmp_path, cache_dir):
    sweep = tmp_path / "sweep"
    common = ["pair=tiny", "max_new_tokens=6", "warmup=0", f"resume={sweep}"]
    res = bench("run", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "method=ar,sd",
                "dataset.n_prompts=2", *common, cache_dir=cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    files = sorted(sweep.rglob("records.jsonl"))
    assert [f.parent.parent.name for f in files] == ["ar_tiny_default", "sd_tiny_default"]
    first = {f: _records(f) for f in files}
    assert [len(r) for r in first.values()] == [2, 4]  # ar alone; ar + sd on 2 prompts

    # The same sweep again (basic launcher, one more prompt): kept records are untouched, one prompt is new.
    res = bench("run", "-m", "method=ar,sd", "dataset.n_prompts=3", *common, cache_dir=cache_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(sweep.rglob("records.jsonl")) == files
    for f, before in first.items():
        after = _records(f)
        assert len(after) == len(before) * 3 // 2
        assert all(after[k]["wall_s"] == rec["wall_s"] for k, rec in before.items())  # not re-measured
        prov = json.loads((f.parent / "run.json").read_text())
        assert prov["resumed"] == {"kept_prompts": 2, "decoded_prompts": 1} and prov["status"] == "complete"


@pytest.mark.newest_only
def test_killed_run_loses_nothing_finished_and_resumes(tmp_path, cache_dir, compose_cfg):
    from bench.runner import run

    out = tmp_path / "run"
    args = ["method=sd", "pair=tiny", "recipe=smoke", "max_new_tokens=32", "dataset.n_prompts=12", "warmup=0", f"resume={out}"]
    proc = bench("run", *args, cache_dir=cache_dir, popen=True)
    partial = out / "records.partial.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if partial.exists() and len(partial.read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "records.jsonl").exists()  # nothing half-finished is published
    before = {r["run_key"]: r for r in read_records(partial)}
    assert len(before) >= 3
    run(compose_cfg(*args), out)  # the same command again, in-process
    after = _records(out / "records.jsonl")
    assert not partial.exists() and len(after) == 24
    assert len({(r["method"], r["prompt_id"]) for r in after.values()}) == 24
    kept = json.loads((out / "run.json").read_text())["resumed"]["kept_prompts"]
    assert kept == len(before) // 2  # every prompt with both records kept; a lone one is decoded again
    assert sum(after[k]["wall_s"] == r["wall_s"] for k, r in before.items()) == 2 * kept


def test_torn_partial_file_is_resumed_in_process(tmp_path, compose_cfg):
    from bench.runner import run

    out = tmp_path / "run"
    cfg = compose_cfg("method=sd", "pair=tiny", "max_new_tokens=6", "dataset.n_prompts=3", "warmup=0", f"resume={out}")
    run(cfg, out)
    lines = (out / "records.jsonl").read_text().splitlines()
    # As if killed mid-write: no records.jsonl, a partial file whose last line is cut short.
    (out / "records.jsonl").unlink()
    (out / "records.partial.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    run(cfg, out)
    assert json.loads((out / "run.json").read_text())["resumed"] == {"kept_prompts": 2, "decoded_prompts": 1}
    again = (out / "records.jsonl").read_text().splitlines()
    assert len(again) == 6 and set(lines[:4]) <= set(again)  # kept records, byte for byte
    # Without resume, the same directory starts over (the old records are replaced, not mixed in).
    run(OmegaConf.merge(cfg, {"resume": None}), out)
    fresh = (out / "records.jsonl").read_text().splitlines()
    assert len(fresh) == 6 and not set(fresh) & set(again)


# ------------------------------------------------------------------------------------------- tables


def _record(method, prompt_id, category, wall_s, new_tokens=10, accept=None, drafted=None, quality=None, **cfg):
    accept = accept or [1] * (new_tokens - 1)
    return {
        "method": method, "pair": "tiny", "dataset": "synthetic", "prompt_id": prompt_id, "category": category,
        "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 16, "seed": 0, "method_cfg": {"name": method, **cfg},
        "new_tokens": new_tokens, "wall_s": wall_s, "ttft_s": wall_s / 10, "tokens_per_s": new_tokens / wall_s,
        "accept_lengths": accept, "drafted": drafted or [0] * len(accept), "target_calls": len(accept) + 1,
        "draft_calls": sum(1 for d in (drafted or []) if d), "flops": {"target": 1e9 * (len(accept) + 1), "total": 2e9 * (len(accept) + 1)},
        "output_ids": [1] * new_tokens, "lossless": quality is None, "cost_ratio_c": 0.1,
        **({"quality": quality} if quality else {}),
    }


def _write_run(run_dir: Path, records, summary=None):
    run_dir.mkdir(parents=True)
    (run_dir / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "run.json").write_text(json.dumps({
        "config": {"method": {"name": records[-1]["method"]}, "pair": {"name": "tiny"}, "dataset": {"name": "synthetic"}},
        "git": {"commit": "0123456789abcdef", "dirty": False}, "versions": {"torch": "2.13.0"}, "device": "cpu",
        "cpu": "Test CPU", "threads": 1, "status": "complete", "cost_ratio_c": 0.1, "summary": summary or []}))


@pytest.fixture
def synthetic(tmp_path):
    """Sweep dir: run A = ar + sd (speedups 2, 2, 3, 3, 4, 4 on prompts in two categories);
    runs B, C = ar + sprinter at thresholds 0.5 and 0.9 with a quality score. Run B's ar is 10x slower,
    so pairing sd against it (wrongly, across runs) would show."""
    root = tmp_path / "sweep"
    a = []
    for i, s in enumerate([2, 2, 3, 3, 4, 4]):
        cat = "qa" if i < 3 else "rag"
        a.append(_record("ar", f"p{i}", cat, 1.0))
        a.append(_record("sd", f"p{i}", cat, 1.0 / s, accept=[3, 3, 4], drafted=[4, 4, 4], gamma=4))
    _write_run(root / "a", a, summary=[{"method": "sd", "speedup": 3.0, "analytic_speedup": 2.5}])
    for name, thr, q in (("b", 0.5, 0.8), ("c", 0.9, 0.6)):
        recs = []
        for i in range(4):
            recs.append(_record("ar", f"p{i}", "qa", 10.0, quality={"rougeL_vs_baseline": 1.0}))
            recs.append(_record("sprinter", f"p{i}", "qa", 10.0 / (1 + thr), accept=[2, 2, 2, 2], drafted=[3, 3, 3, 3],
                                quality={"rougeL_vs_baseline": q}, threshold=thr))
        _write_run(root / name, recs)
    return root


@pytest.mark.newest_only
def test_table_paired_speedups_ci_and_files(synthetic, tmp_path, capsys):
    from bench.report_cli import table_main
    from bench.saved import load
    from bench.summary import summary_table

    df, runs = load([str(synthetic)])
    t = summary_table(df).set_index("label")
    assert list(t.index)[0].startswith("ar")
    sd = t.loc["sd"]
    assert sd["speedup_median"] == pytest.approx(3.0)  # paired within run a only
    assert 2.0 <= sd["speedup_lo"] <= 3.0 <= sd["speedup_hi"] <= 4.0
    assert sd["mean_accepted"] == pytest.approx(10 / 3) and sd["target_calls_per_token"] == pytest.approx(0.4)
    assert sd["gflops_per_token"] == pytest.approx(0.8) and sd["prompts"] == 6
    thr = {lab: row for lab, row in t.iterrows() if lab.startswith("sprinter")}
    assert set(thr) == {"sprinter (threshold=0.5)", "sprinter (threshold=0.9)"}
    assert thr["sprinter (threshold=0.5)"]["speedup_median"] == pytest.approx(1.5)
    assert thr["sprinter (threshold=0.9)"]["q_rougeL_vs_baseline"] == pytest.approx(0.6)
    assert pd.isna(sd["q_rougeL_vs_baseline"])
    by_cat = summary_table(df, by_category=True)
    sd_cat = by_cat[by_cat["label"] == "sd"].set_index("category")["speedup_median"]
    assert sd_cat.to_dict() == {"qa": pytest.approx(2.0), "rag": pytest.approx(4.0)}

    out = tmp_path / "tables"
    assert table_main([str(synthetic), "--by-category", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3.00 [" in printed and "sprinter (threshold=0.9)" in printed and "rougeL_vs_baseline" in printed
    for stem in ("summary", "by_category"):
        for ext in ("csv", "md", "tex"):
            assert (out / f"{stem}.{ext}").stat().st_size > 0
    assert pd.read_csv(out / "summary.csv").set_index("label").loc["sd", "speedup_median"] == pytest.approx(3.0)
    assert "\\begin{tabular}" in (out / "summary.tex").read_text()
    # A records file named directly works too.
    assert table_main([str(synthetic / "a" / "records.jsonl"), "--out", str(out)]) == 0


def test_table_bad_input(tmp_path):
    from bench.__main__ import main

    assert main(["table", str(tmp_path / "nope")]) == 2
    assert main(["table", str(tmp_path)]) == 2  # no records.jsonl under it


@pytest.mark.newest_only
def test_plot_draws_present_figures_and_skips_absent(synthetic, tmp_path, capsys):
    from bench.report_cli import plot_main

    out = tmp_path / "plots"
    assert plot_main([str(synthetic), "--out", str(out)]) == 0
    names = ["speedup_by_category", "latency_vs_quality", "setting_tradeoff", "accepted_histogram",
             "measured_vs_analytic", "flops_vs_latency", "acceptance_by_position"]
    for name in names:
        for ext in ("pdf", "png"):
            assert (out / "figures" / f"{name}.{ext}").stat().st_size > 1000, name
    # Only run a (no quality, no swept setting): those two figures are skipped, with the reason printed.
    out2 = tmp_path / "plots2"
    assert plot_main([str(synthetic / "a"), "--out", str(out2)]) == 0
    printed = capsys.readouterr().out
    assert "skipped latency_vs_quality" in printed and "skipped setting_tradeoff" in printed
    assert not (out2 / "figures" / "setting_tradeoff.png").exists()
    assert (out2 / "figures" / "speedup_by_category.pdf").exists()


def _chromium():
    return next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


REPORT_FIGURES = 8  # the figures of bench.plots.FIGURES that the synthetic runs fill


@pytest.mark.newest_only
def test_report_is_one_self_contained_page(synthetic, tmp_path):
    from bench.report_cli import report_main

    assert report_main([str(synthetic), "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "report.html").read_text()
    assert page.count("<table") == 3  # summary, by category, provenance
    assert page.count("data:image/png;base64,") == REPORT_FIGURES
    assert "src='http" not in page and 'src="http' not in page and "<link" not in page  # nothing external
    assert "0123456789" in page and "Test CPU" in page  # provenance


@pytest.mark.newest_only
@pytest.mark.skipif(_chromium() is None, reason="no chromium binary (apt-get install -y chromium; .ci/run does)")
def test_report_renders_in_headless_chromium(synthetic, tmp_path):
    from bench.report_cli import report_main

    report_main([str(synthetic), "--out", str(tmp_path / "rep")])
    page = tmp_path / "rep" / "report.html"
    res = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    dom = res.stdout
    assert dom.count("<table") == 3, res.stderr[-2000:]
    assert "sprinter (threshold=0.9)" in dom and "speedup_by_category" in dom
    # The page's script counts images the browser actually decoded (naturalWidth > 0).
    assert f'data-images-loaded="{REPORT_FIGURES}"' in dom, res.stderr[-2000:]


def test_labels_name_the_recipe_behind_trained_methods(tmp_path):
    """Records of a trained method under two recipes are two rows, each label naming its recipe; untrained
    methods (recipe null) keep their plain name."""
    from bench import saved, summary

    recs = []
    for recipe, wall in (("quick", 0.8), ("full", 0.5)):
        recs += [{**_record("ar", "p1", "qa", 1.0), "recipe": None},
                 {**_record("sd", "p1", "qa", wall, accept=[1], drafted=[2]), "recipe": recipe}]
    _write_run(tmp_path / "a", recs[:2])
    _write_run(tmp_path / "b", recs[2:])
    df, _ = saved.load([str(tmp_path)])
    assert sorted(df["label"].unique()) == ["ar", "sd (recipe=full)", "sd (recipe=quick)"]
    table = summary.summary_table(df)
    assert len(table[table["method"] == "sd"]) == 2


def test_labels_name_the_compiled_batch_sizes_and_buckets_where_runs_differ(tmp_path):
    """Two compiled runs at B = 8, one with graphs for 8 rows only and one for 1, 2, 4 and 8, are two rows; a run at
    B = 1 beside them (no batch sizes) is not labelled with any; runs that differ in their buckets only are two rows
    too, and an eager run beside them names none."""
    from bench import saved

    runs = {"one": (8, "8"), "all": (8, "1,2,4,8"), "alone": (1, None)}
    for name, (batch, sizes) in runs.items():
        _write_run(tmp_path / name, [{**_record("pld", "p1", "qa", 1.0), "compile": True, "batch_size": batch,
                                      "compile_buckets": "1,4,16", "compile_batch_sizes": sizes}])
    df, _ = saved.load([str(tmp_path)])
    assert sorted(df["label"].unique()) == ["pld (batch_size=1)", "pld (batch_size=8, compile_batch_sizes=1,2,4,8)",
                                            "pld (batch_size=8, compile_batch_sizes=8)"]
    buckets = tmp_path / "buckets"
    for name, compiled, sizes in (("few", True, "1,4,16"), ("many", True, "1,2,4,8,16"), ("eager", False, None)):
        _write_run(buckets / name, [{**_record("pld", "p1", "qa", 1.0), "compile": compiled, "compile_buckets": sizes}])
    df, _ = saved.load([str(buckets)])
    assert sorted(df["label"].unique()) == ["pld (compile=False)", "pld (compile=True, compile_buckets=1,2,4,8,16)",
                                            "pld (compile=True, compile_buckets=1,4,16)"]


def test_batch_figures_draw_one_line_per_method_over_the_batch_sizes(tmp_path):
    """Issue 41's figures: sd's speedup at B = 1, 2, 4 (3x, 2x, 1x, over ar at the same B) is one line of three
    points, each at its batch size; throughput against per-token latency has one point per B per method; a single
    batch size draws neither, and says why."""
    import matplotlib.figure

    from bench import plots, saved, summary

    for b, s in ((1, 3.0), (2, 2.0), (4, 1.0)):
        recs = []
        for i in range(4):
            for method, wall in (("ar", 1.0), ("sd", 1.0 / s)):
                rec = _record(method, f"p{i}", "qa", wall * b ** 0.5, gamma=4) if method == "sd" else \
                    _record(method, f"p{i}", "qa", wall * b ** 0.5)
                rec.update(batch_size=b, batch={"size": b, "wall_s": wall * b ** 0.5, "new_tokens": 10 * b})
                recs.append(rec)
        _write_run(tmp_path / f"b{b}", recs)
    df, runs = saved.load([str(tmp_path)])
    table = summary.summary_table(df)
    points = plots._batch_points(df, table)
    sd = points[points["method"] == "sd"].sort_values("B")
    assert sd["line"].unique().tolist() == ["sd"] and sd["B"].tolist() == [1, 2, 4]
    assert sd["speedup_median"].tolist() == pytest.approx([3.0, 2.0, 1.0])
    with plt_context():
        for fn in (plots.speedup_by_batch, plots.throughput_vs_latency):
            assert isinstance(fn(df, runs, table), matplotlib.figure.Figure)
        one, runs1 = saved.load([str(tmp_path / "b2")])
        assert plots.speedup_by_batch(one, runs1, summary.summary_table(one)) == "the records hold one batch size"
    assert plots.pareto_front([(1, 5), (2, 4), (2, 7), (3, 6), (4, 9)]) == [(1, 5), (2, 7), (4, 9)]
    # One panel per input length, the shorter first (names compared as numbers, not as text).
    named = pd.DataFrame({"pair": "smollm2", "dataset": ["long_input-2048", "long_input-512", "default"]})
    assert [d for _, d in plots.panels(named)] == ["default", "long_input-512", "long_input-2048"]


def plt_context():
    from bench import plots

    return plots.plt.rc_context(plots.STYLE)
