"""scripts/gpu_check.py, dry-run on the CPU with the tiny synthetic shape: the command the docs give for the day a GPU is
lent runs end to end and writes its tables and figure (on the device it runs the same code with a real shape)."""

import json

from scripts import gpu_check


def test_the_device_check_dry_runs_on_the_cpu(tmp_path):
    status = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--shape", "tiny", "--dtype", "float32",
                             "--prompts", "1", "--tokens", "8", "--methods", "sd,pld,recycling", "--walk", "quick",
                             "--batch-methods", "sd,pld", "--batch-size", "2",
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
    # A batch of 2 on the synthetic pair at the last rate, each method against ar at B = 2 (a synthetic pair's tokens are
    # not ar's by design: the walk's test_a_batch_on_the_device checks a batch's rows on the device).
    assert {(r["method"], r["batch_size"], r["acceptance_set"]) for r in check["batch"]} == {("sd", 2, 0.9), ("pld", 2, 0.9)}
    assert all(r["throughput"] > 0 and r["ar_throughput"] > 0 and r["speedup_median"] > 0 for r in check["batch"])
    batch = [json.loads(line) for line in (tmp_path / "synthetic" / "sd-a0.9-b2" / "records.jsonl").read_text().splitlines()]
    assert {r["batch_size"] for r in batch} == {2} and len(batch) == 4  # two prompts, one batch, sd and ar
    assert check["walk"]["status"] == "passed", (tmp_path / "walk.log").read_text()[-2000:]
    assert check["gqa"] == {"skipped": "CUDA only"}  # GQA's copy on CUDA: the CPU's figures are in the docs
    assert {"summary.md", "synthetic.csv", "synthetic.png"} <= {p.name for p in tmp_path.iterdir()}
    records = [json.loads(line) for line in (tmp_path / "synthetic" / "sd-a0.9" / "records.jsonl").read_text().splitlines()]
    assert all(r["synthetic"] and r["pair"] == "synthetic-tiny-a0.9" for r in records)
