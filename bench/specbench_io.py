"""Spec-Bench interop: this harness's records as Spec-Bench answer files, and Spec-Bench answer files as records.

Spec-Bench (Xia et al. 2024, github.com/hemingkx/Spec-Bench, ``evaluation/eval.py``) writes one JSON line per
question to an answer file per model and method::

    {"question_id": 81, "category": "writing", "answer_id": "...", "model_id": "vicuna-7b-v1.3-sps",
     "choices": [{"index": 0, "turns": ["..."], "decoding_steps": [57], "new_tokens": [128],
                  "wall_time": [2.31], "accept_lengths": [3, 1, 2, ...]}], "tstamp": 1700000000.0}

and ``evaluation/speed.py`` reads ``new_tokens``, ``wall_time`` and ``accept_lengths`` of ``choices[0]``.

- ``python -m bench export-specbench RUN_DIR [--out DIR]``: one answer file per method setting of a run
  (``<model_id>.jsonl``, model_id ``<pair>-<label>``), a question per record; only the first turn is decoded
  here, so ``turns`` holds one answer.
- ``python -m bench import-specbench DIR [--out DIR] [--baseline STEM]``: every ``*.jsonl`` answer file of DIR
  becomes the records of one method (its file stem), written as a run directory (``records.jsonl`` and a
  ``run.json`` naming the baseline: the file whose stem contains ``vanilla`` or ``baseline``, or ``--baseline``),
  so ``python -m bench table IMPORTED_DIR MY_RUN`` shows a user's Spec-Bench GPU results beside this harness's,
  each paired against its own baseline prompt by prompt.

Imported records carry what an answer file holds: wall time, new tokens, accepted tokens per step (so target
calls), the answer text; not FLOPs, memory or token ids (those columns stay empty).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

from bench.results import RecordWriter, write_json_atomic, write_text_atomic
from core import files
from core.errors import BenchError, Parser

PROMPT_PREFIX = "sb-"  # this harness's prompt ids of Spec-Bench questions (bench.data's spec_bench source)


def question_id(prompt_id: str):
    """Spec-Bench's question id back from this harness's prompt id (``sb-81`` -> 81); other ids as they are."""
    rest = prompt_id[len(PROMPT_PREFIX):] if prompt_id.startswith(PROMPT_PREFIX) else None
    return int(rest) if rest is not None and rest.isdigit() else prompt_id


def answer(rec: dict, model_id: str) -> dict:
    """One record as one Spec-Bench answer line."""
    steps = list(rec.get("accept_lengths") or [])
    return {
        "question_id": question_id(str(rec["prompt_id"])),
        "category": rec.get("category"),
        "answer_id": hashlib.sha256(f"{model_id}/{rec['prompt_id']}/{rec.get('run_key')}".encode()).hexdigest()[:22],
        "model_id": model_id,
        "choices": [{"index": 0, "turns": [rec.get("output_text", "")],
                     "decoding_steps": [len(steps) + 1],  # target forwards: the prefill, then one per step
                     "new_tokens": [int(rec["new_tokens"])], "wall_time": [float(rec["wall_s"])],
                     "accept_lengths": steps}],
        "tstamp": rec.get("tstamp"),
    }


def export_answers(run_dir: Path, out: Path) -> list[Path]:
    """Write the answer files of ``run_dir``'s records into ``out``; returns them."""
    import pandas as pd

    from bench.saved import labels

    records = [rec for f in files.record_files(Path(run_dir)) for rec in files.read_results_file(f)]
    df = pd.DataFrame([{k: v for k, v in rec.items() if not isinstance(v, (list, dict)) or k == "method_cfg"}
                       for rec in records])
    df["method_cfg"] = [rec.get("method_cfg") or {"name": rec["method"]} for rec in records]
    df["label"] = labels(df)  # the table's row names: one answer file per row of `bench table`
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for label, idx in df.groupby("label").groups.items():
        pair = str(df.loc[idx[0], "pair"])
        model_id = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{pair}-{label}").strip("_")
        lines = [json.dumps(answer(records[i], model_id)) for i in idx]
        target = out / f"{model_id}.jsonl"
        write_text_atomic(target, "\n".join(lines) + "\n")  # whole files only
        written.append(target)
    return written


def _answer_rows(path: Path) -> list[dict]:
    """The answer lines of one Spec-Bench answer file, checked: one sentence on anything unreadable."""
    text = files.decode_utf8(path.read_bytes(), str(path), "Spec-Bench answer file")
    rows = []
    for n, line in files.json_lines(text):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise BenchError(f"Spec-Bench answer file '{path}' line {n} is not JSON ({err.msg}).") from None
        choice = (row.get("choices") or [None])[0] if isinstance(row, dict) else None
        if not isinstance(choice, dict) or "question_id" not in row or not all(
                k in choice for k in ("new_tokens", "wall_time", "turns")):
            raise BenchError(f"Spec-Bench answer file '{path}' line {n} is not a Spec-Bench answer (it needs "
                             "question_id and choices[0] with turns, new_tokens and wall_time).")
        rows.append(row)
    if not rows:
        raise BenchError(f"Spec-Bench answer file '{path}' is empty.")
    return rows


def record(row: dict, method: str, temperature: float = 0.0, max_new_tokens: int = 1024) -> dict:
    """One Spec-Bench answer line as a record of method ``method`` (the answer file's stem). Answer files do not
    say how they were sampled: ``temperature`` and ``max_new_tokens`` (Spec-Bench's defaults: greedy, 1024) are
    the user's word for it."""
    choice = row["choices"][0]
    steps = [int(a) for a in choice.get("accept_lengths") or []]
    new_tokens, wall = int(sum(choice["new_tokens"])), float(sum(choice["wall_time"]))
    calls = int(sum(choice.get("decoding_steps") or [])) or (len(steps) + 1 if steps else math.nan)
    return {
        "method": method, "method_cfg": {"name": method, "source": "spec-bench"}, "lossless": None,
        "pair": "spec-bench", "model_id": row.get("model_id"), "dataset": "spec_bench",
        "prompt_id": f"{PROMPT_PREFIX}{row['question_id']}", "category": row.get("category"),
        "output_text": "\n".join(str(t) for t in choice["turns"]), "new_tokens": new_tokens, "wall_s": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else math.nan, "ttft_s": math.nan,
        "accept_lengths": steps, "drafted": None, "target_calls": calls, "flops": None,  # drafted: not recorded
        "temperature": temperature, "top_p": 1.0, "max_new_tokens": max_new_tokens, "seed": None, "recipe": None,
    }


def import_answers(folder: Path, out: Path, baseline: str | None = None, temperature: float = 0.0,
                   max_new_tokens: int = 1024) -> Path:
    """Write the records of every answer file in ``folder`` into the run directory ``out``; returns it."""
    files = sorted(Path(folder).glob("*.jsonl")) if Path(folder).is_dir() else []
    if not files:
        raise BenchError(f"'{folder}' holds no Spec-Bench answer files (*.jsonl); name the folder of "
                         "Spec-Bench's data/spec_bench/model_answer/.")
    stems = [f.stem for f in files]
    if baseline is None:
        guesses = [s for s in stems if "vanilla" in s or "baseline" in s]
        baseline = guesses[0] if len(guesses) == 1 else None
    elif baseline not in stems:
        raise BenchError(f"--baseline {baseline}: no answer file {baseline}.jsonl in '{folder}' "
                         f"(there are: {', '.join(stems)}).")
    recs = [record(row, f.stem, temperature, max_new_tokens) for f in files for row in _answer_rows(f)]
    out.mkdir(parents=True, exist_ok=True)
    writer = RecordWriter(out)  # as a run writes its records: published whole, NaN as null
    for r in recs:
        writer.write(r)
    writer.close(publish=True)
    write_json_atomic(out / "run.json", {"config": {"baseline": baseline}, "source": {"spec_bench": str(folder)}})
    return out


def export_main(argv: list[str]) -> int:
    p = Parser(prog="python -m bench export-specbench", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run directory of 'python -m bench run'")
    p.add_argument("--out", help="where the answer files go (default: RUN/specbench)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.run) / "specbench"
    for path in export_answers(Path(args.run), out):
        print(path)
    return 0


def import_main(argv: list[str]) -> int:
    p = Parser(prog="python -m bench import-specbench", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a folder of Spec-Bench answer files (*.jsonl)")
    p.add_argument("--out", help="the run directory to write (default: FOLDER/imported)")
    p.add_argument("--baseline", help="the answer file (stem) every other is paired against (default: the one "
                   "whose name holds 'vanilla' or 'baseline')")
    p.add_argument("--temperature", type=float, default=0.0, help="how the answers were sampled (default 0: greedy)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="their token budget (Spec-Bench's default 1024)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.folder) / "imported"
    print(import_answers(Path(args.folder), out, args.baseline, args.temperature, args.max_new_tokens))
    return 0
