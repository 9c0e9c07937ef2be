"""The benchmark scripts under scripts/, end to end on the tiny random pair (seconds)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT


def script(name, *args, cache_dir):
    env = {**os.environ, "BENCH_CACHE": str(cache_dir), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def only_json(folder: Path) -> dict:
    files = list(folder.glob("*.json"))
    assert len(files) == 1
    return json.loads(files[0].read_text())


def test_bench_spine_paths_agree_token_for_token(tmp_path, cache_dir):
    """Ours ar, transformers generate(), ours sd and transformers' assisted generation: same greedy tokens."""
    script("bench_spine.py", "--out", str(tmp_path), "pair=tiny", "dataset.n_prompts=2", "method.gamma=3",
           cache_dir=cache_dir)  # max_new_tokens left to its default, as a user runs it
    summary = only_json(tmp_path)["summary"]
    assert summary["all_outputs_equal"] is True and summary["prompts"] == 2
    assert set(summary["tokens_per_s"]) == {"ours_ar", "hf_generate", "ours_sd", "hf_assisted"}
    assert 0 <= summary["alpha"] <= 1 and summary["c"] > 0


@pytest.mark.newest_only
def test_draft_frontier_reports_every_depth(tmp_path, cache_dir):
    script("draft_frontier.py", "--out", str(tmp_path), "--prompts", "4", "--held-out", "2", "--news-tokens", "256",
           "--depths", "1,2", "--max-gamma", "2", "--repeats", "2", "--recipe", "smoke", "pair=tiny",
           cache_dir=cache_dir)  # max_new_tokens left to its default, as a user runs it
    summary = only_json(tmp_path)["summary"]
    # the pair's draft sits on the same frontier as the linear exits
    assert [row["k"] for row in summary["rows"]] == [1, 2, "tiny draft (recipe=smoke)"]
    assert summary["r"]["1"] == 1.0 and set(summary["r"]) == {"1", "2", "3"}
    for row in summary["rows"]:
        assert 0 <= row["alpha_tuned_lens"] <= 1
        assert row["alpha_logit_lens"] is None or 0 <= row["alpha_logit_lens"] <= 1
        assert row["c"] > 0 and row["best_speedup"] > 0 and row["best_gamma"] in (1, 2)


@pytest.mark.newest_only
def test_draft_frontier_refuses_a_held_out_share_it_cannot_split(cache_dir):
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "draft_frontier.py"), "--prompts", "4",
                          "--held-out", "4", "pair=tiny"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "BENCH_CACHE": str(cache_dir), "PYTHONPATH": str(ROOT)})
    assert res.returncode == 1
    assert res.stderr.strip() == "error: --held-out (4) must be at least 1 and below --prompts (4)."


@pytest.mark.newest_only
def test_teacher_throughput_reports_both_rates(cache_dir):
    res = script("teacher_throughput.py", "--prompts", "4", "--batch", "4", "--new-tokens", "4", "--seqs", "2",
                 "pair=tiny", "recipe.store.seq_len=32", cache_dir=cache_dir)
    out = json.loads(res.stdout[res.stdout.index("{"):])
    answers = out["answers"]
    assert answers["one_at_a_time"]["batch"] == 1 and answers["batched"]["batch"] == 4
    assert answers["one_at_a_time"]["tokens"] > 0 and answers["batched"]["tokens"] > 0
    assert out["teacher_forced"]["tokens"] == 64 and out["teacher_forced"]["tokens_per_s"] > 0


@pytest.mark.newest_only
def test_learning_curve_trains_each_budget_and_the_report_draws_it(tmp_path, cache_dir):
    """Two budgets of the smoke recipe on the tiny pair with a distilled draft: the draft's and the heads'
    held-out agreement per budget, a figure, and the report's learning-curve figure from the folder."""
    draft = ["pair.drafts=[{source: distilled, recipe: {layers: [0], vocab: 64}}]"]
    script("learning_curve.py", "--tokens", "1024,2048", "--methods", "medusa", "--out", str(tmp_path / "lc"),
           "pair=tiny", "recipe=smoke", *draft, cache_dir=cache_dir)
    folder = next((tmp_path / "lc").iterdir())
    curve = json.loads((folder / "learning_curve.json").read_text())
    assert [r["tokens"] for r in curve["rows"]] == [1024, 2048] and curve["recipe"] == "smoke"
    for row in curve["rows"]:
        assert 0 <= row["draft_text"] <= 1 and 0 <= row["draft_answers"] <= 1 and len(row["medusa"]) == 4
        assert 0 <= row["draft_answer_tokens"] <= 1
    assert curve["rows"][0]["train_tokens"] < curve["rows"][1]["train_tokens"]
    assert (folder / "learning_curve.png").stat().st_size > 0 and (folder / "learning_curve.pdf").exists()

    from bench.report_cli import report_main
    from tests.bench.test_study import _record, _write_run

    runs = tmp_path / "runs"
    _write_run(runs / "a", [_record("ar", "p1", "qa", 1.0), _record("sd", "p1", "qa", 0.5, accept=[1], drafted=[2])])
    assert report_main([str(runs), str(tmp_path / "lc"), "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "id='fig-learning_curve'" in page


@pytest.mark.newest_only
def test_recipe_report_says_how_to_train_what_is_missing(tmp_path, cache_dir):
    env = {**os.environ, "BENCH_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "recipe_report.py"), "pair=tiny", "recipe=smoke",
                          "--out", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 2 and "python -m bench train method" in res.stderr.strip().splitlines()[-1]


@pytest.mark.newest_only
def test_answer_agreement_counts_answer_tokens_only(tmp_path, cache_dir, tiny_pair):
    """The target agrees with its own greedy answers everywhere on answer tokens (1.0), not on the prompt's; the
    script end to end writes one row per prompt set."""
    import importlib.util

    from training.labelling import target_answers

    spec = importlib.util.spec_from_file_location("answer_agreement", ROOT / "scripts" / "answer_agreement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    rows = [(p, a) for p, a, _, _ in target_answers(target, tok, ["Tell me a story.", "Why is it so?"], 2, 8, "t")]
    got = module.agreement(target, rows, 256)
    assert got["answer_agreement"] == 1.0 and got["row_agreement"] < 1.0 and got["answer_tokens"] == 16

    script("answer_agreement.py", "--out", str(tmp_path), "--prompts", "2", "pair=tiny", "recipe=smoke",
           cache_dir=cache_dir)
    rows = only_json(tmp_path)["rows"]
    assert [r["prompts"] for r in rows] == ["default prompts", "held-out, packaged text", "held-out, other kinds"]
    assert [r["n"] for r in rows] == [18, 2, 2] and all(0 <= r["answer_agreement"] <= 1 for r in rows)


@pytest.mark.newest_only
def test_results_page_holds_the_methods_of_one_sweep(tmp_path, cache_dir):
    """scripts/results_page.py: one resumable sweep of the methods asked (by default every registered one: each runs
    through the harness in tests/bench/test_synthetic.py), then its table and figure written between the page's
    markers (the text around them kept); run again, it finishes nothing new and rewrites the same rows."""
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nbefore\n\n<!-- results_page: begin -->\nold\n<!-- results_page: end -->\n\nafter\n")
    args = ["--sweep", str(tmp_path / "sweep"), "--page", str(page), "--figure", str(tmp_path / "img" / "all.png"),
            "--methods", "pld,sd", "pair=tiny", "recipe=smoke", "dataset.n_prompts=1", "max_new_tokens=4", "warmup=0"]
    script("results_page.py", *args, cache_dir=cache_dir)
    text = page.read_text()
    assert text.startswith("# Results\n\nbefore\n\n<!-- results_page: begin -->") and text.endswith("after\n")
    assert "\nold\n" not in text and (tmp_path / "img" / "all.png").stat().st_size > 0
    assert " --methods pld,sd pair=tiny" in text.split("Generated by", 1)[1].split("\n", 1)[0]
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    assert sorted({row.split(" ")[0] for row in rows} - {"label"}) == ["ar", "pld", "sd"]
    assert "![Median paired speedup of every method](img/all.png)" in text
    again = script("results_page.py", *args, "--no-run", cache_dir=cache_dir)
    assert "wrote" in again.stdout and [line for line in page.read_text().splitlines() if line.startswith("| ")] == \
        [line for line in text.splitlines() if line.startswith("| ")]


@pytest.mark.newest_only
def test_results_page_refuses_to_resume_jobs_from_another_commit(tmp_path, monkeypatch, capsys):
    """A sweep folder holding a job measured at another commit is not resumed silently (the page would mix code
    that times differently): one sentence naming the job, exit 2, nothing run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    page_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page_script)
    job = tmp_path / "sweep" / "pld_smollm2_default"
    job.mkdir(parents=True)
    (job / "run.json").write_text(json.dumps({"git": {"commit": "0123456789" * 4, "dirty": False}}))
    assert page_script.other_commits(tmp_path / "sweep", "f" * 40) == ["pld_smollm2_default at 0123456"]
    assert page_script.other_commits(tmp_path / "sweep", "0123456789" * 4) == []
    monkeypatch.setattr(page_script, "sweep", lambda *a: pytest.fail("the sweep must not run"))
    monkeypatch.setattr(page_script, "git_state", lambda: {"commit": "f" * 40, "dirty": False})
    assert page_script.main(["--sweep", str(tmp_path / "sweep"), "--page", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "holds jobs measured at another commit (pld_smollm2_default at 0123456)" in err
    assert err.count("\n") == 1
    assert page_script.main(["--sweep", str(tmp_path / "new"), "--page", str(tmp_path / "r.md"), "--methods", "pld,pdl"]) == 2
    assert capsys.readouterr().err.startswith("error: --methods names pdl, which no method is; the methods are amphista, ")
    assert page_script.main(["--sweep", str(tmp_path / "new"), "--page", str(tmp_path / "r.md"), "--methods", "ar"]) == 2
    assert capsys.readouterr().err == ("error: --methods names only the baseline (ar), which every job runs beside its "
                                       "method; name at least one other method.\n")


@pytest.mark.newest_only
def test_gqa_cost_times_every_variant_and_writes_its_rows(tmp_path, cache_dir):
    """scripts/gqa_cost.py on the tiny shape (4 query heads on 2 key/value heads), one round each: every column
    filled, the copy-free attention equal to transformers' sdpa."""
    import csv

    out = tmp_path / "gqa.csv"
    script("gqa_cost.py", "--shape", "tiny", "--contexts", "16", "--rows", "1,3", "--dtypes", "float32",
           "--repeats", "1", "--forward-repeats", "1", "--csv", str(out), cache_dir=cache_dir)
    rows = list(csv.DictReader(out.open()))
    assert [(r["context"], r["rows"]) for r in rows] == [("16", "1"), ("16", "3")]
    for row in rows:
        assert float(row["max_diff"]) < 1e-6
        for col in ("attn_repeat_kv_ms", "attn_sdpa_ms", "attn_grouped_ms", "attn_enable_gqa_ms", "attn_ar_row_ms",
                    "fwd_sdpa_ms", "fwd_sdpa_gqa_ms", "fwd_ar_ms"):
            assert float(row[col]) > 0, col


@pytest.mark.newest_only
def test_verify_cost_times_every_kernel_and_row_count(tmp_path, cache_dir):
    """The verification cost curve: each kernel at each k, its ratio to the one-token forward (1 at k = 1)."""
    import pandas as pd

    script("verify_cost.py", "--rows", "1,3", "--repeats", "2", "--csv", str(tmp_path / "c.csv"), "--compiled",
           "pair=tiny", cache_dir=cache_dir)  # two row counts: each compiles a graph twice (frozen, plain)
    table = pd.read_csv(tmp_path / "c.csv")
    assert table["k"].tolist() == [1, 3]
    for kernel in ("plain", "packed", "chosen", "compiled"):
        assert (table[f"{kernel}_ms"] > 0).all() and table[f"ratio_{kernel}"].iloc[0] == 1.0
    assert (table["compiled_plain_ms"] > 0).all()
    assert (table["bound_ms"] > 0).all() and table["bound_ms"].nunique() == 1  # the streaming bound: one per model


@pytest.mark.newest_only
def test_loop_overhead_times_each_method_per_token(monkeypatch, capsys):
    """scripts/loop_overhead.py (in-process): a positive time per token for each method named, printed."""
    import importlib.util

    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("loop_overhead", ROOT / "scripts" / "loop_overhead.py")
    loop_overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_overhead)
    import torch

    threads = str(torch.get_num_threads())  # as the test process has them (tests/conftest.py splits them per worker)
    times = loop_overhead.main(["--methods", "ar,pld", "--repeats", "1", "--max-new", "4", "--threads", threads])
    assert set(times) == {"ar", "pld"} and all(ms > 0 for ms in times.values())
    assert capsys.readouterr().out.strip() == f"ar={times['ar']:.3f}ms/token pld={times['pld']:.3f}ms/token"
