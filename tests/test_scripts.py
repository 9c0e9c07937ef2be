"""The benchmark scripts under scripts/, end to end on the tiny random pair (seconds)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    script("bench_spine.py", "--out", str(tmp_path), "pair=tiny", "dataset.n_prompts=2", "max_new_tokens=12",
           "method.gamma=3", cache_dir=cache_dir)
    summary = only_json(tmp_path)["summary"]
    assert summary["all_outputs_equal"] is True and summary["prompts"] == 2
    assert set(summary["tokens_per_s"]) == {"ours_ar", "hf_generate", "ours_sd", "hf_assisted"}
    assert 0 <= summary["alpha"] <= 1 and summary["c"] > 0


def test_draft_frontier_reports_every_depth(tmp_path, cache_dir):
    script("draft_frontier.py", "--out", str(tmp_path), "--prompts", "4", "--held-out", "2", "--news-tokens", "256",
           "--depths", "1,2", "--max-gamma", "2", "--repeats", "2", "pair=tiny", "max_new_tokens=8",
           cache_dir=cache_dir)
    summary = only_json(tmp_path)["summary"]
    assert [row["k"] for row in summary["rows"]] == [1, 2]
    assert summary["r"]["1"] == 1.0 and set(summary["r"]) == {"1", "2", "3"}
    for row in summary["rows"]:
        assert 0 <= row["alpha_tuned_lens"] <= 1 and 0 <= row["alpha_logit_lens"] <= 1
        assert row["c"] > 0 and row["best_speedup"] > 0 and row["best_gamma"] in (1, 2)


def test_teacher_throughput_reports_both_rates(cache_dir):
    res = script("teacher_throughput.py", "--prompts", "4", "--batch", "4", "--new-tokens", "4", "--seqs", "2",
                 "pair=tiny", "recipe.store.seq_len=32", cache_dir=cache_dir)
    out = json.loads(res.stdout[res.stdout.index("{"):])
    answers = out["answers"]
    assert answers["one_at_a_time"]["batch"] == 1 and answers["batched"]["batch"] == 4
    assert answers["one_at_a_time"]["tokens"] > 0 and answers["batched"]["tokens"] > 0
    assert out["teacher_forced"]["tokens"] == 64 and out["teacher_forced"]["tokens_per_s"] > 0
