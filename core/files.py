"""Checks of the files a user hands the harness: question files, local model folders, saved results.

Files are inputs too: each bad one gets a :class:`BenchError` whose message is one sentence naming the file,
what is wrong with it and, where it helps, what is allowed. Every check here is cheap (it reads text and
JSON headers, never a model's weights), so config validation can call it before any model loads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from core.errors import BenchError

log = logging.getLogger(__name__)

# A run directory's records: complete (written last, whole) and in progress (appended per prompt).
RECORDS = "records.jsonl"
PARTIAL = "records.partial.jsonl"
# Spec-Bench's question.jsonl: the fields every line has (``reference`` is optional).
QUESTION_FIELDS = ("question_id", "category", "turns")
# Keys every record of this harness has (bench.runner.make_record); a file lacking them is someone else's.
RECORD_KEYS = ("method", "prompt_id", "wall_s", "new_tokens")
# Families named when a model_type is unknown, as examples of what works.
EXAMPLE_FAMILIES = ("llama", "gpt2", "qwen2", "mistral", "gemma")


# ------------------------------------------------------------------------------------------- text and JSON


def read_bytes(location: str, what: str) -> bytes:
    """Bytes of a local path or a URL (``http(s)://``, ``file://``, read with urllib); ``what`` names the
    file's role in the sentence (e.g. ``"dataset file"``)."""
    if "://" in location:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(location, timeout=60) as fh:
                return fh.read()
        except (OSError, ValueError) as err:  # URLError/HTTPError are OSErrors; a malformed URL is a ValueError
            # HTTPError reads "HTTP Error 404: Not Found"; other URLErrors are clearer by their reason alone.
            detail = err if isinstance(err, urllib.error.HTTPError) else getattr(err, "reason", err)
            raise BenchError(f"could not read {what} '{location}': {detail}.") from None
    path = Path(location).expanduser()
    if not path.exists():
        raise BenchError(f"{what} '{location}' does not exist.")
    if path.is_dir():
        raise BenchError(f"{what} '{location}' is a directory; name the file itself.")
    try:
        return path.read_bytes()
    except OSError as err:
        raise BenchError(f"could not read {what} '{location}': {err.strerror}.") from None


def decode_utf8(data: bytes, name: str, what: str) -> str:
    """``data`` as text; a byte that is not UTF-8 is named with its line and offset (a leading BOM is dropped)."""
    try:
        # The BOM goes after decoding ("utf-8-sig" would not count it in the error's offset).
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise BenchError(f"{what} '{name}' is not UTF-8 text: byte 0x{data[err.start]:02x} on line {line} "
                         f"(offset {err.start}) is not valid UTF-8; save the file as UTF-8.") from None


def json_lines(text: str) -> list[tuple[int, str]]:
    """``(line number from 1, line)`` of every non-blank line. Split on ``\\n`` only: ``str.splitlines``
    would also cut at U+2028 and similar characters, which a JSON string may hold unescaped."""
    return [(i, line) for i, line in enumerate(text.split("\n"), 1) if line.strip()]


def _not_json(err: json.JSONDecodeError) -> str:
    return f"{err.msg} at column {err.colno}"


# ------------------------------------------------------------------------------------------- question files


def read_question_file(location: str) -> list[dict]:
    """Rows of a Spec-Bench ``question.jsonl`` (a local path or a URL), checked: one JSON object per line with
    ``question_id`` (int or str, unique), ``category`` (str), ``turns`` (non-empty list of str) and an
    optional ``reference``; blank lines are skipped; at least one question."""
    what = "dataset file"
    text = decode_utf8(read_bytes(location, what), location, what)
    rows, first_seen = [], {}
    for n, line in json_lines(text):
        row = _question_row(line, n, location)
        qid = row["question_id"]
        if qid in first_seen:
            raise BenchError(f"{what} '{location}' line {n} repeats question_id {qid!r} (first on line "
                             f"{first_seen[qid]}); question ids must be unique.")
        first_seen[qid] = n
        rows.append(row)
    if not rows:
        raise BenchError(f"{what} '{location}' holds no questions (it is empty); each line must be one question, "
                         'e.g. {"question_id": 1, "category": "qa", "turns": ["Why is the sky blue?"]}.')
    return rows


def _question_row(line: str, n: int, location: str) -> dict:
    """Line ``n`` of a question file as a checked dict (see :func:`read_question_file`)."""
    where = f"dataset file '{location}' line {n}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise BenchError(f"{where} is not JSON ({_not_json(err)}); each line must be one question object.") from None
    if not isinstance(row, dict):
        raise BenchError(f"{where} is a JSON {type(row).__name__}, not an object with {', '.join(QUESTION_FIELDS)}.")
    missing = [k for k in QUESTION_FIELDS if k not in row]
    if missing:
        raise BenchError(f"{where} lacks {_fields(missing)}; every question has {', '.join(QUESTION_FIELDS)}.")
    # bool is an int to Python, but an id of true/false is surely a mistake.
    if isinstance(row["question_id"], bool) or not isinstance(row["question_id"], (int, str)):
        raise BenchError(f"{where}: question_id must be an integer or a string, got {row['question_id']!r}.")
    if not isinstance(row["category"], str):
        raise BenchError(f"{where}: category must be a string, got {row['category']!r}.")
    turns = row["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise BenchError(f"{where}: turns must be a non-empty list of strings (the user turns), got {_short(turns)}.")
    return row


def _fields(names: list[str]) -> str:
    return ("field " if len(names) == 1 else "fields ") + ", ".join(f"'{k}'" for k in names)


def _short(value, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------- model folders


def looks_local(source: str) -> bool:
    """Whether a model ``source`` means a local folder rather than a hub id: it starts with ``.``, ``/`` or
    ``~``, or it exists on disk (transformers, too, prefers an existing folder over a hub id of that name)."""
    return source.startswith((".", "/", "~")) or Path(source).expanduser().exists()


def check_model_folder(path: Path) -> None:
    """Raise unless ``path`` is a folder ``AutoModelForCausalLM.from_pretrained`` can load: a ``config.json``
    (JSON with a causal-LM ``model_type``) and weights (``model.safetensors``, ``pytorch_model.bin``, or an
    index of shards that are all there). Reads config.json and safetensors headers only, never the weights."""
    from transformers.utils import CONFIG_NAME

    if not path.exists():
        raise BenchError(f"model path '{path}' does not exist.")
    if not path.is_dir():
        raise BenchError(f"model path '{path}' is a file, not a model folder (a folder with config.json and weights, "
                         "as save_pretrained writes it).")
    config = path / CONFIG_NAME
    if not config.is_file():
        raise BenchError(f"model folder '{path}' has no {CONFIG_NAME}; a model folder holds {CONFIG_NAME} and the "
                         "weights, as save_pretrained writes them.")
    _check_model_type(_read_json(config, "model config"), config)
    _check_weights(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_tokenizer_folder(path: Path) -> None:
    """A local target folder must hold its tokenizer too (the pair's tokenizer is the target's): checked before
    any model loads, by file name only."""
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise BenchError(f"model folder '{path}' has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
                         "save the tokenizer into that folder (tokenizer.save_pretrained).")


def _read_json(path: Path, what: str):
    """The JSON value in ``path``; ``what`` names the file's role in the sentence."""
    text = decode_utf8(_read_local(path, what), str(path), what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise BenchError(f"{what} '{path}' is not JSON ({err.msg} at line {err.lineno} column {err.colno}).") from None


def _check_model_type(config, where: Path) -> None:
    """``config`` (config.json's content) must name a ``model_type`` transformers has a causal LM class for."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS,
    )

    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not model_type:
        raise BenchError(f"model config '{where}' has no 'model_type', so transformers cannot tell which "
                         "architecture it is (save_pretrained writes one, e.g. \"llama\").")
    if model_type not in CAUSAL_LMS:
        examples = [f for f in EXAMPLE_FAMILIES if f in CAUSAL_LMS]
        raise BenchError(f"model config '{where}' has model_type '{model_type}', which transformers "
                         f"{transformers.__version__} knows no causal language model for; it supports "
                         f"{', '.join(examples)} and {len(CAUSAL_LMS) - len(examples)} more.")


def _check_weights(path: Path) -> None:
    """Weights under the names transformers loads: a single file, or an index whose shards are all present.
    Safetensors headers are parsed (a cheap mmap), so a truncated or foreign file is named here too."""
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    files = [path / name for name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME) if (path / name).is_file()]
    for index in (path / SAFE_WEIGHTS_INDEX_NAME, path / WEIGHTS_INDEX_NAME):
        if index.is_file() and not files:
            files = _shards(index)
    if not files:
        raise BenchError(f"model folder '{path}' has no weights: no {SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME}, "
                         f"{SAFE_WEIGHTS_INDEX_NAME} or {WEIGHTS_INDEX_NAME}.")
    for f in files:
        if f.suffix == ".safetensors":
            _check_safetensors(f)


def _shards(index: Path) -> list[Path]:
    """The shard files a ``*.index.json`` names (its ``weight_map`` values); raises when any is missing."""
    weight_map = _read_json(index, "weights index")
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BenchError(f"weights index '{index}' has no 'weight_map' naming the shard files.")
    shards = [index.parent / name for name in dict.fromkeys(weight_map.values())]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise BenchError(f"weights index '{index}' names {len(missing)} shard file(s) that are missing: "
                         f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}.")
    return shards


def _check_safetensors(path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as err:
        raise BenchError(f"weights file '{path}' is not a readable safetensors file ({err}).") from None


# ------------------------------------------------------------------------------------------- saved results


def record_files(path: Path) -> list[Path]:
    """The finished ``records.jsonl`` files that one RESULTS argument means: the file itself, or every one
    under a directory. A run that never finished leaves only ``records.partial.jsonl``: naming it, or a
    directory holding nothing else, is an error that says how to finish the run."""
    if not path.exists():
        raise BenchError(f"results path '{path}' does not exist.")
    if path.is_file():
        if path.name == PARTIAL:
            raise _unfinished(path.parent)
        return [path]
    found = sorted(path.rglob(RECORDS))
    unfinished = [p.parent for p in sorted(path.rglob(PARTIAL)) if not (p.parent / RECORDS).exists()]
    if not found and unfinished:
        raise _unfinished(unfinished[0], len(unfinished) - 1)
    if not found:
        raise BenchError(f"no {RECORDS} found under '{path}'; name a run or sweep directory of 'python -m bench run'.")
    for run_dir in unfinished:  # beside finished runs (e.g. one failed job of a sweep): read the rest, but say so
        log.warning("skipping unfinished run '%s' (only %s); finish it with 'python -m bench run resume=%s ...'.",
                    run_dir, PARTIAL, run_dir)
    return found


def _unfinished(run_dir: Path, more: int = 0) -> BenchError:
    also = f" (and {more} more unfinished run{'s' if more > 1 else ''})" if more else ""
    # Hydra saves the command line's overrides beside the run; resuming needs the same ones (same run keys).
    saved = run_dir / ".hydra" / "overrides.yaml"
    where = f", listed in {saved}" if saved.is_file() else ""
    return BenchError(f"run directory '{run_dir}'{also} holds only {PARTIAL}, no {RECORDS}: the run did not finish; "
                      f"finish it with 'python -m bench run resume={run_dir}' and the run's original overrides{where} "
                      "(complete records are kept, the rest is decoded).")


def read_results_file(path: Path) -> list[dict]:
    """Records of a finished ``records.jsonl``, checked: not empty, every line a JSON object with the keys of
    :data:`RECORD_KEYS`. The file is published whole (written as a partial file, then renamed), so any bad
    line, the last included, means a damaged or foreign file, not a torn write."""
    text = decode_utf8(_read_local(path, "results file"), str(path), "results file")
    lines = json_lines(text)
    if not lines:
        raise BenchError(f"results file '{path}' is empty: it holds no records.")
    records = []
    for n, line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            if n == lines[0][0]:
                raise BenchError(f"results file '{path}' is not a records file of this harness: line {n} is not "
                                 f"JSON ({_not_json(err)}).") from None
            raise BenchError(f"results file '{path}' line {n} is not JSON ({_not_json(err)}); a finished "
                             "records file is written whole, so it was damaged or edited since.") from None
        if not isinstance(rec, dict):
            raise BenchError(f"results file '{path}' is not a records file of this harness: line {n} is a JSON "
                             f"{type(rec).__name__}, not a record object.")
        missing = [k for k in RECORD_KEYS if k not in rec]
        if missing:
            raise BenchError(f"results file '{path}' is not a records file of this harness: line {n} lacks "
                             f"{_fields(missing)} (every record has {', '.join(RECORD_KEYS)}).")
        records.append(rec)
    return records


def read_run_json(run_dir: Path) -> dict | None:
    """A run directory's provenance (``run.json``), or None when it has none; one that is not a JSON object
    is an error (tables read each run's baseline from it, so guessing would pair speedups wrongly)."""
    path, what = run_dir / "run.json", "run provenance"
    if not path.exists():
        return None
    fix = "fix it, or remove it to read the run's records without provenance (paired against ar)"
    try:
        prov = json.loads(decode_utf8(_read_local(path, what), str(path), what))
    except json.JSONDecodeError as err:
        raise BenchError(f"{what} '{path}' is not JSON ({err.msg} at line {err.lineno} column {err.colno}); {fix}.") from None
    if not isinstance(prov, dict):
        raise BenchError(f"{what} '{path}' is a JSON {type(prov).__name__}, not an object; {fix}.")
    return prov


def _read_local(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise BenchError(f"could not read {what} '{path}': {err.strerror}.") from None
