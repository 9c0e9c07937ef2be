"""scripts/gpu_check.py, dry-run on the CPU with the tiny synthetic shape: the command the docs give for the day a GPU is
lent runs end to end and writes its tables and figure (on the device it runs the same code with a real shape)."""

import json

from scripts import gpu_check


def test_the_device_check_dry_runs_on_the_cpu(tmp_path):
    status = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--shape", "tiny", "--dtype", "float32",
                             "--prompts", "1", "--tokens", "8", "--methods", "sd,pld,recycling", "--walk", "quick",
                             "--budget", "300"])
    check = json.loads((tmp_path / "check.json").read_text())
    assert status == 0, check
    assert [r["dtype"] for r in check["guard"]] == ["float32", "bfloat16", "float16"]
    assert all(r["guard"] == "passed" and r["ar_equals_cache_free"] for r in check["guard"])
    # The reference (uncompiled on the CPU) against eager ar on the synthetic pair: ar's tokens, its speedup over ar.
    ref = {r["label"]: r for r in check["reference"]}
    assert set(ref) == {"ar", "ar_static"} and ref["ar_static"]["matches_baseline"] == 1.0
    assert ref["ar_static"]["speedup_median"] > 0 and ref["ar"]["speedup_vs_ref"] > 0
    # compile=true against eager (sd and ar on the synthetic pair): both runs, the compiled one's buckets in its run.json.
    assert {(r["label"], r["compile"]) for r in check["compiled"]} == {(m, c) for m in ("ar", "sd") for c in (True, False)}
    assert json.loads((tmp_path / "compiled" / "run.json").read_text())["compile"]["target"]["buckets"] == [1, 8]
    rows = {(r["method"], r["acceptance_set"]) for r in check["synthetic"]}
    assert rows == {(m, a) for m in ("sd", "pld", "recycling") for a in (0.6, 0.9)}
    assert check["walk"]["status"] == "passed", (tmp_path / "walk.log").read_text()[-2000:]
    assert check["gqa"] == {"skipped": "CUDA only"}  # GQA's copy on CUDA: the CPU's figures are in the docs
    assert {"summary.md", "synthetic.csv", "synthetic.png"} <= {p.name for p in tmp_path.iterdir()}
    records = [json.loads(line) for line in (tmp_path / "synthetic" / "sd-a0.9" / "records.jsonl").read_text().splitlines()]
    assert all(r["synthetic"] and r["pair"] == "synthetic-tiny-a0.9" for r in records)
