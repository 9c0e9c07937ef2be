"""Spec-Bench interop (``bench/specbench_io.py``): a run exported as Spec-Bench answer files and imported back
gives the same table figures; answer files that are not Spec-Bench's are one sentence each."""

import json

import pytest

from bench.__main__ import main
from bench.summary import run_summary


@pytest.fixture(scope="module")
def run_dir(compose_cfg, tmp_path_factory):
    from bench.runner import run

    out = tmp_path_factory.mktemp("run")
    run(compose_cfg("pair=tiny", "method=sd", "max_new_tokens=12", "dataset.n_prompts=3", "warmup=0"), out)
    return out


def test_export_then_import_gives_the_same_figures(run_dir, tmp_path, capsys):
    answers = tmp_path / "answers"
    assert main(["export-specbench", str(run_dir), "--out", str(answers)]) == 0
    files = sorted(p.name for p in answers.glob("*.jsonl"))
    assert files == ["tiny-ar.jsonl", "tiny-sd.jsonl"]
    rows = [json.loads(line) for line in (answers / "tiny-sd.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    sd = {r["prompt_id"]: r for r in records if r["method"] == "sd"}
    assert len(rows) == 3
    for row in rows:
        rec, choice = sd[row["question_id"]], row["choices"][0]  # builtin prompt ids are kept as they are
        assert choice["new_tokens"] == [rec["new_tokens"]] and choice["wall_time"] == [rec["wall_s"]]
        assert choice["accept_lengths"] == rec["accept_lengths"] and choice["turns"] == [rec["output_text"]]
        assert choice["decoding_steps"] == [rec["target_calls"]] and row["model_id"] == "tiny-sd"

    imported = tmp_path / "imported"
    assert main(["import-specbench", str(answers), "--out", str(imported), "--baseline", "tiny-ar",
                 "--max-new-tokens", "12"]) == 0
    mine, theirs = run_summary(run_dir).set_index("method"), run_summary(imported).set_index("method")
    for col in ("speedup_median", "speedup_pooled", "mean_accepted", "target_calls_per_token", "new_tokens"):
        assert theirs.loc["tiny-sd", col] == pytest.approx(mine.loc["sd", col]), col
    assert theirs.loc["tiny-ar", "speedup_median"] == 1.0


def test_spec_bench_question_ids_go_back_to_integers():
    from bench.specbench_io import question_id

    assert question_id("sb-81") == 81 and question_id("default-3") == "default-3" and question_id("sb-x") == "sb-x"


@pytest.mark.parametrize("content, words", [
    (None, "holds no Spec-Bench answer files"),
    ("", "is empty"),
    ("{not json\n", "line 1 is not JSON"),
    ('{"question_id": 1, "choices": [{"turns": ["a"]}]}\n', "line 1 is not a Spec-Bench answer"),
])
def test_bad_answer_files_are_one_sentence(tmp_path, capsys, content, words):
    folder = tmp_path / "answers"
    folder.mkdir()
    if content is not None:
        (folder / "m.jsonl").write_text(content)
    assert main(["import-specbench", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "out" / "records.jsonl").exists()


def test_an_unknown_baseline_names_the_files(run_dir, tmp_path, capsys):
    answers = tmp_path / "answers"
    main(["export-specbench", str(run_dir), "--out", str(answers)])
    capsys.readouterr()
    assert main(["import-specbench", str(answers), "--baseline", "vanilla"]) == 2
    err = capsys.readouterr().err
    assert "no answer file vanilla.jsonl" in err and "(there are: tiny-ar, tiny-sd)" in err, err


def test_speedup_specbench_is_what_spec_benchs_speed_py_computes_from_the_exported_answers(run_dir, tmp_path,
                                                                                           tiny_pair):
    """Spec-Bench's evaluation/speed.py, step by step on the answer files the export writes: per question the
    method's sum(new_tokens) / sum(wall_time), the baseline's answer text tokenized again less one over its
    wall time; the ratio of the two means. The summary's speedup_specbench must be that number (and it is
    neither the median nor the pooled figure, which a test that cannot tell them apart would not show)."""
    import numpy as np

    answers = tmp_path / "answers"
    assert main(["export-specbench", str(run_dir), "--out", str(answers)]) == 0
    rows = {name: [json.loads(line) for line in (answers / f"tiny-{name}.jsonl").read_text().splitlines()]
            for name in ("sd", "ar")}
    speeds = [sum(r["choices"][0]["new_tokens"]) / sum(r["choices"][0]["wall_time"]) for r in rows["sd"]]
    base = [sum(len(tiny_pair.tokenizer(t).input_ids) - 1 for t in r["choices"][0]["turns"])
            / sum(r["choices"][0]["wall_time"]) for r in rows["ar"]]
    theirs = np.array(speeds).mean() / np.array(base).mean()
    mine = run_summary(run_dir).set_index("method").loc["sd"]
    assert mine["speedup_specbench"] == pytest.approx(theirs, rel=1e-9)
    assert mine["speedup_specbench"] != pytest.approx(mine["speedup_pooled"], rel=1e-6)
