"""Files are inputs too: every bad question file, model folder or results file gets one sentence naming the
file and what is wrong (``error: ...`` on stderr, exit status 2), no traceback and no results written."""

import json
import logging

import pytest

from bench.__main__ import main
from bench.results import previous_records
from core import files
from core.errors import BenchError
from tests.bench.test_study import _record, _write_run

GOOD_QUESTION = {"question_id": 1, "category": "qa", "turns": ["Why is the sky blue?"]}


def cli(argv, capsys) -> tuple[int, list[str]]:
    """Exit status and stderr lines of ``python -m bench ARGV``, run in-process (``run`` exits through Hydra)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err.splitlines()


def assert_one_sentence(code, err, names: str, needle: str) -> None:
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert names in err[0] and needle in err[0], err[0]


def jsonl(*rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# ------------------------------------------------------------------------------------------- question files

# kind -> (file content; None: no file at all, "dir": a directory; the needle of the sentence)
BAD_QUESTIONS = {
    "missing": (None, "does not exist"),
    "directory": ("dir", "is a directory"),
    "not_utf8": (jsonl(GOOD_QUESTION).encode() + '{"question_id": 2, "category": "qa", "turns": ["café"]}\n'.encode("latin-1"),
                 "is not UTF-8 text: byte 0xe9 on line 2"),
    "not_json": (jsonl(GOOD_QUESTION) + '{"question_id": 2, "category": "qa", "turns": ["hi"]\n', "line 2 is not JSON"),
    "not_object": ("[1, 2, 3]\n", "line 1 is a JSON list, not an object"),
    "missing_field": (jsonl({"question_id": 1, "turns": ["hi"]}), "line 1 lacks field 'category'"),
    "missing_fields": (jsonl({"question_id": 1}), "line 1 lacks fields 'category', 'turns'"),
    "turns_empty": (jsonl({**GOOD_QUESTION, "turns": []}), "turns must be a non-empty list of strings"),
    "turns_string": (jsonl({**GOOD_QUESTION, "turns": "hi"}), "turns must be a non-empty list of strings"),
    "turns_not_strings": (jsonl({**GOOD_QUESTION, "turns": ["hi", 2]}), "turns must be a non-empty list of strings"),
    "empty": ("", "holds no questions"),
    "blank_lines": ("\n \n", "holds no questions"),
    "duplicate_id": (jsonl(GOOD_QUESTION, {**GOOD_QUESTION, "turns": ["again"]}),
                     "line 2 repeats question_id 1 (first on line 1)"),
}


def question_file(tmp_path, kind):
    content, needle = BAD_QUESTIONS[kind]
    path = tmp_path / "question.jsonl"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    return path, needle


@pytest.mark.parametrize("kind", sorted(BAD_QUESTIONS))
def test_bad_question_file(tmp_path, kind):
    path, needle = question_file(tmp_path, kind)
    with pytest.raises(BenchError, match="dataset file") as err:
        files.read_question_file(str(path))
    assert str(path) in str(err.value) and needle in str(err.value)


@pytest.mark.parametrize("kind", sorted(BAD_QUESTIONS))
def test_bad_question_file_cli(tmp_path, cache_dir, capsys, kind):
    path, needle = question_file(tmp_path, kind)
    run_dir = tmp_path / "run"
    code, err = cli(["run", "pair=tiny", "dataset=spec_bench", f"dataset.path={path}", "max_new_tokens=2",
                     "dataset.n_prompts=1", f"cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"], capsys)
    # A missing file is caught earlier, by the config's validation, with its own sentence.
    assert_one_sentence(code, err, str(path), "does not exist" if kind == "missing" else needle)
    assert not list(run_dir.glob("records*.jsonl")) and not (run_dir / "run.json").exists()


def test_good_question_file(tmp_path):
    path = tmp_path / "question.jsonl"
    ref = {"question_id": "x7", "category": "writing", "turns": ["a", "b"], "reference": ["r1", "r2"]}
    path.write_text(jsonl(GOOD_QUESTION) + "\n" + jsonl(ref), encoding="utf-8")  # a blank line is skipped
    assert files.read_question_file(str(path)) == [GOOD_QUESTION, ref]
    assert files.read_question_file(path.as_uri()) == [GOOD_QUESTION, ref]  # file:// URLs read through urllib


# ------------------------------------------------------------------------------------------- model folders


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)


def _save_tiny_llama(folder):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(_tiny_llama_config()).save_pretrained(folder)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _shard_index(folder):
    _tiny_llama_config().save_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))


# kind -> (builder of the folder's content, needle); the folder is tmp_path / "model"
BAD_MODEL_FOLDERS = {
    "missing": (None, "does not exist"),
    "a_file": (lambda f: f.write_text("not a folder"), "is a file, not a model folder"),
    "no_config": (lambda f: f.mkdir(), "has no config.json"),
    "config_not_json": (lambda f: (f.mkdir(), (f / "config.json").write_text("{model_type: llama")), "is not JSON"),
    "config_no_model_type": (lambda f: (f.mkdir(), (f / "config.json").write_text('{"hidden_size": 8}')),
                             "has no 'model_type'"),
    "model_type_unknown": (lambda f: (f.mkdir(), (f / "config.json").write_text('{"model_type": "bogus"}')),
                           "model_type 'bogus', which transformers"),
    "no_weights": (lambda f: _tiny_llama_config().save_pretrained(f), "has no weights"),
    "missing_shards": (_shard_index, "names 2 shard file(s) that are missing"),
    "truncated_weights": (lambda f: (_save_tiny_llama(f), _truncate(f / "model.safetensors")),
                          "is not a readable safetensors file"),
}


def model_folder(tmp_path, kind):
    build, needle = BAD_MODEL_FOLDERS[kind]
    folder = tmp_path / "model"
    if build is not None:
        build(folder)
    return folder, needle


@pytest.mark.parametrize("kind", sorted(BAD_MODEL_FOLDERS))
def test_bad_model_folder(tmp_path, kind):
    folder, needle = model_folder(tmp_path, kind)
    with pytest.raises(BenchError) as err:
        files.check_model_folder(folder)
    assert str(folder) in str(err.value) and needle in str(err.value)


def test_unknown_model_type_names_supported_families(tmp_path):
    folder, _ = model_folder(tmp_path, "model_type_unknown")
    with pytest.raises(BenchError, match=r"it supports llama, gpt2, qwen2, mistral, gemma and \d+ more\.$"):
        files.check_model_folder(folder)


@pytest.mark.parametrize("kind", sorted(BAD_MODEL_FOLDERS))
def test_bad_model_folder_cli(tmp_path, cache_dir, capsys, kind):
    folder, needle = model_folder(tmp_path, kind)
    run_dir = tmp_path / "run"
    code, err = cli(["run", "pair=gpt2", "method=ar", f"pair.target.id={folder}", "max_new_tokens=2",
                     "dataset.n_prompts=1", f"cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"], capsys)
    assert_one_sentence(code, err, str(folder), needle)
    assert not list(run_dir.glob("records*.jsonl")) and not (run_dir / "run.json").exists()


def test_good_model_folder_loads(tmp_path):
    import torch

    from bench.models import hub_model

    folder = tmp_path / "model"
    _save_tiny_llama(folder)
    files.check_model_folder(folder)
    assert hub_model(str(folder), torch.float32, torch.device("cpu")).config.model_type == "llama"


def test_model_folder_without_tokenizer_cli(tmp_path, cache_dir, capsys):
    folder, run_dir = tmp_path / "model", tmp_path / "run"
    _save_tiny_llama(folder)  # weights and config, but no tokenizer files
    code, err = cli(["run", "pair=gpt2", "method=ar", f"pair.target.id={folder}", "max_new_tokens=2",
                     "dataset.n_prompts=1", f"cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"], capsys)
    # Checked by file name before any model loads: the sentence is all there is on stderr.
    assert_one_sentence(code, err, str(folder), "has no tokenizer files")
    assert err[-1].endswith("save the tokenizer into that folder (tokenizer.save_pretrained).")
    assert not list(run_dir.glob("records*.jsonl"))


def test_looks_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert all(map(files.looks_local, ["./m", "/abs/m", "~/m", "org/model"]))
    assert not files.looks_local("HuggingFaceTB/SmolLM2-135M")


# ------------------------------------------------------------------------------------------- results


def _good_records():
    return [_record(m, f"p{i}", "qa", w) for i in range(2) for m, w in (("ar", 1.0), ("sd", 0.5))]


def _results_with(tmp_path, name, content):
    """A run directory whose finished records are good, with file ``name`` replaced by ``content``."""
    run = tmp_path / "results" / "run"
    _write_run(run, _good_records())
    if name == "records.partial.jsonl":  # an unfinished run: the partial file instead of records.jsonl
        (run / "records.jsonl").rename(run / name)
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text("- method=sd\n")
    elif isinstance(content, bytes):
        (run / name).write_bytes(content)
    else:
        (run / name).write_text(content, encoding="utf-8")
    return run, run / name


_LINES = jsonl(*_good_records())
# kind -> (file replaced, its content, what RESULTS names ("dir" or "file"), the file the sentence names, needle)
BAD_RESULTS = {
    "empty_records": ("records.jsonl", "", "dir", "records.jsonl", "is empty: it holds no records"),
    "foreign_not_json": ("records.jsonl", "method,prompt_id,wall_s\nar,p0,1.0\n", "file", "records.jsonl",
                         "is not a records file of this harness: line 1 is not JSON"),
    "foreign_keys": ("records.jsonl", jsonl(GOOD_QUESTION), "dir", "records.jsonl",
                     "is not a records file of this harness: line 1 lacks fields 'method', 'prompt_id', 'wall_s', 'new_tokens'"),
    "foreign_not_object": ("records.jsonl", "[1, 2]\n", "dir", "records.jsonl",
                           "is not a records file of this harness: line 1 is a JSON list, not a record object"),
    "torn_last_line": ("records.jsonl", _LINES[: len(_LINES) - 40], "dir", "records.jsonl",
                       "line 4 is not JSON"),
    "not_utf8": ("records.jsonl", _LINES.encode() + b'{"method": "\xff"}\n', "dir", "records.jsonl",
                 "is not UTF-8 text: byte 0xff on line 5"),
    "partial_run": ("records.partial.jsonl", None, "dir", "run",
                    "the run did not finish; finish it with 'python -m bench run resume="),
    "partial_run_overrides": ("records.partial.jsonl", None, "dir", "run",
                              "original overrides, listed in "),
    "partial_file_named": ("records.partial.jsonl", None, "file", "run", "holds only records.partial.jsonl"),
    "run_json_not_json": ("run.json", '{"config": {"baseline": "ar"', "dir", "run.json", "is not JSON"),
    "run_json_not_object": ("run.json", "[]", "dir", "run.json", "is a JSON list, not an object"),
}


@pytest.mark.parametrize("kind", sorted(BAD_RESULTS))
def test_bad_results(tmp_path, capsys, kind):
    name, content, given, named, needle = BAD_RESULTS[kind]
    run, path = _results_with(tmp_path, name, content)
    out = tmp_path / "out"
    code, err = cli(["table", str(path if given == "file" else run.parent), "--out", str(out)], capsys)
    assert_one_sentence(code, err, str(run / named) if named != "run" else str(run), needle)
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("command", ["table", "plot", "report"])
def test_bad_results_every_command(tmp_path, capsys, command):
    run, path = _results_with(tmp_path, "run.json", "not json")
    code, err = cli([command, str(run), "--out", str(tmp_path / "out")], capsys)
    assert_one_sentence(code, err, str(path), "is not JSON")
    assert not (tmp_path / "out").exists()


def test_good_results(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run, _good_records())
    assert files.read_results_file(run / "records.jsonl") == _good_records()
    assert files.read_run_json(run)["status"] == "complete"
    (run / "run.json").unlink()  # provenance is optional
    assert files.read_run_json(run) is None
    code, err = cli(["table", str(run), "--out", str(tmp_path / "out")], capsys)
    assert code == 0 and not err


def test_unfinished_run_beside_finished_ones_is_skipped_with_a_warning(tmp_path, caplog):
    _write_run(tmp_path / "sweep" / "done", _good_records())
    _write_run(tmp_path / "sweep" / "killed", _good_records())
    (tmp_path / "sweep" / "killed" / "records.jsonl").rename(tmp_path / "sweep" / "killed" / "records.partial.jsonl")
    with caplog.at_level(logging.WARNING, logger="core.files"):
        assert files.record_files(tmp_path / "sweep") == [tmp_path / "sweep" / "done" / "records.jsonl"]
    assert "skipping unfinished run" in caplog.text and "killed" in caplog.text


def test_resume_still_tolerates_a_torn_last_line(tmp_path):
    """A kill -9 can tear the last line of records.partial.jsonl: resuming keeps the complete records."""
    recs = [{**r, "run_key": f"k{i}"} for i, r in enumerate(_good_records())]
    lines = jsonl(*recs)
    (tmp_path / "records.partial.jsonl").write_text(lines[: len(lines) - 40])
    assert sorted(previous_records(tmp_path)) == ["k0", "k1", "k2"]
