"""The device check: one command for the day a GPU is lent, writing its tables and figures to one folder.

On the lent machine, through the device tool (its own torch and transformers, nothing of ours installed; the
missing wheels carried from ``scripts/gpu_wheels.sh``): ``bash scripts/gpu_check.sh`` (docs/gpu.md). Steps, in order
of what matters most, each skipped with a note once the time budget is spent:

1. the machine: versions, the GPU, the keyword the cache goes under (core.kv_cache);
2. the cache guard and ``ar`` against cache-free greedy decoding, on the tiny pair in fp32, bf16 and fp16;
3. the GPU test walk (tests/test_gpu.py: every method on the tiny pairs in fp32 and bf16, parts trained on the device,
   the published layouts), at most ``--walk-seconds``: correctness before speed;
4. eager ``ar`` against the optimised plain-decoding reference (bench/reference.py: transformers' ``generate`` on a
   static cache with ``torch.compile``, ``ar_compiled``; ``ar_static``, uncompiled, in the CPU dry run) on the
   synthetic pair of ``--shape`` in ``--dtype``, same prompts: its speedup over ``ar`` and whether its tokens are ar's;
5. ``compile=true`` (core/compiled.py: the target's and the draft's forwards compiled per row bucket, CUDA graphs on
   CUDA; never run on a GPU before): ``--compiled`` (default ``sd``) against ``ar``, both compiled, buckets 1 and 8
   only (``sd``'s chains of 5 rows pad to 8; prompts run uncompiled), on the synthetic pair at the first rate, then the same run
   eager, for what time is left: whether the CUDA path runs, stays ar's token for token, and what it changes;
6. the methods of ``--methods`` (:data:`SYNTHETIC_METHODS`) on a synthetic pair of ``--shape`` (default
   Llama-3.1-8B with Llama-3.2-1B as draft; trained parts untrained) in bf16, at two acceptance rates, each against ``ar`` on the same prompts (``reference=none``: compiling
   the reference in each of these runs would spend the budget), for what time is left;
7. the methods of ``--batch-methods`` (:data:`BATCH_METHODS`) at ``--batch-size`` (8; as many prompts, one batch) on
   that synthetic pair at the last rate, each against ``ar`` at the same batch size: what speculation's machinery
   costs in a batch at a real size, and the throughput over the batch (a synthetic pair's output is not ``ar``'s by
   design; that a batch decodes each row as ``ar`` does on the device is the walk's ``test_a_batch_on_the_device``);
8. on CUDA, for what time is left: what GQA's key/value copy costs a verification there and what ``sdpa_gqa``
   saves (``scripts/gqa_cost.py``, bf16, 1k and 4k cached tokens, 4 layers: ``OUT/gqa.csv``), which decides whether
   ``core.gqa_attention`` is switched on for CUDA too.

``--device cpu --shape tiny`` is the dry run CI takes (tests/test_gpu_check.py). Writes ``OUT/summary.md``,
``OUT/synthetic.csv``, ``OUT/synthetic.png``, ``OUT/check.json`` and the walk's ``OUT/walk.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The methods step 6 times by default: every method runs on a synthetic pair (trained parts untrained), but the budget
# holds about twenty runs, so the draft-model and model-free methods and two trained ones (Medusa's heads, EAGLE's
# draft layer); left out: those whose set-up runs the target over a corpus (swift's skip-set search, nest's datastore,
# hierarchy's answers: minutes at 8B) and the other heads and draft-layer variants (--methods names any).
SYNTHETIC_METHODS = ["sd", "pld", "cascade", "spechub", "gsd", "recycling", "samd", "rest", "lookahead", "medusa",
                     "eagle"]
# Step 7's methods at batch size 8 (issue 41): one per batched drafting path (a draft model, n-grams, the target's own
# top-k tree, heads, a draft layer), at the last acceptance rate, after step 6 so that B = 1 comes first.
BATCH_METHODS = ["sd", "pld", "recycling", "medusa", "eagle"]


class Budget:
    """Seconds left of ``total`` since it was made."""

    def __init__(self, total: float):
        self.end = time.monotonic() + total

    def left(self) -> float:
        return self.end - time.monotonic()


def compose(overrides: list[str]):
    from bench.cli import compose as bench_compose

    return bench_compose(overrides)


def machine(device: str) -> dict:
    import torch
    import transformers

    from core import kv_cache

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cache_keyword": kv_cache.CACHE_ARG, "device": device}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def guard_rows(device: str, cache: str, tokens: int = 16) -> list[dict]:
    """Per dtype: the tiny pair loads (the cache guard runs in load_pair) and ``ar``'s greedy tokens equal the argmax
    of cache-free forwards of the whole sequence; where they part, the target's top-1 - top-2 logit there and whether
    that is a near-tie (bf16 and fp16 round a one-token step and a whole-sequence forward differently)."""
    from bench import quality
    from bench.models import load_pair
    from tests.helpers import cache_free_greedy, decode, prompts_for

    rows = []
    for dtype in ("float32", "bfloat16", "float16"):
        row = {"dtype": dtype}
        try:
            pair = load_pair(compose(["pair=tiny", f"device={device}", f"dtype={dtype}", f"cache_dir={cache}"]))
            row["guard"] = "passed"
            prompt = prompts_for(pair, 1)[0]
            out = decode(pair, "ar", prompt, max_new=tokens).output_ids
            free = cache_free_greedy(pair, prompt, tokens)
            row["ar_equals_cache_free"] = out == free
            if out != free:  # where they part, and whether rounding alone can explain it (a near-tie)
                d = quality.divergence(pair, {"prompt_ids": prompt, "output_ids": out}, {"output_ids": free})
                row.update(first_difference=d["position"], margin=round(d["margin"], 4), near_tie=d["tie"])
        except Exception as err:  # noqa: BLE001 - the check reports every failure and goes on
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        rows.append(row)
    return rows


def synthetic_rows(out: Path, device: str, shape: str, dtype: str, rates: list[float], prompts: int, tokens: int,
                   cache: str, budget: Budget, methods: list[str], batch_size: int = 1) -> tuple[list[dict], list[str]]:
    """Every method of ``methods`` against ``ar`` (at the same ``batch_size``) on the synthetic pair of ``shape`` at
    each rate; the summary rows of each run (its method's row), and what was skipped for time."""
    from bench.runner import run

    rows, skipped = [], []
    # Method by method, each at every rate in turn: a transient (the machine's, or one the previous run left) then
    # shows as one method's outlier rather than one rate's column.
    for name in methods:
        for rate in rates:
            batch = f" at B = {batch_size}" if batch_size > 1 else ""
            if budget.left() < 30:
                skipped.append(f"{name} at {rate}{batch}")
                continue
            run_dir = out / "synthetic" / f"{name}-a{rate}{f'-b{batch_size}' if batch_size > 1 else ''}"
            cfg = compose([f"method={name}", "pair=synthetic", f"pair.shape={shape}", f"pair.acceptance={rate}",
                           f"device={device}", f"dtype={dtype}", f"max_new_tokens={tokens}",
                           f"dataset.n_prompts={prompts}", f"batch_size={batch_size}", "warmup=1", "reference=none",
                           f"cache_dir={cache}"])
            try:
                summary = run(cfg, run_dir)
                # The run's own ar beside the method: a transient (the machine's, or what an earlier run left) shows
                # in both, and the peak memory shows what else was resident.
                ar = next((r for r in summary if r["method"] == "ar"), {})
                rows += [{**r, "acceptance_set": rate, "batch_size": batch_size, "ar_tokens_per_s": ar.get("tokens_per_s"),
                          "ar_throughput": ar.get("throughput")} for r in summary
                         if r.get("label") == name or r["method"] == name]
            except Exception as err:  # noqa: BLE001
                rows.append({"method": name, "acceptance_set": rate, "batch_size": batch_size,
                             "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"})
    return rows, skipped


def reference_rows(out: Path, device: str, shape: str, dtype: str, prompts: int, tokens: int, cache: str,
                   budget: Budget, mode: str) -> list[dict]:
    """Eager ``ar`` and the optimised plain-decoding reference (``mode``: compiled, or static for a CPU dry run) on the
    synthetic pair of ``shape``: the summary rows of both (the reference's: its speedup over ``ar``, its tokens against
    ``ar``'s). The reference's warm-up, which compiles it, is untimed; its time counts against the budget."""
    from bench.runner import run

    if budget.left() < 60:
        return [{"label": f"ar_{mode}", "skipped": "no time left"}]
    cfg = compose(["method=ar", "pair=synthetic", f"pair.shape={shape}", f"device={device}", f"dtype={dtype}",
                   f"max_new_tokens={tokens}", f"dataset.n_prompts={prompts}", "warmup=1", f"reference={mode}",
                   f"cache_dir={cache}"])
    start = time.monotonic()
    try:
        rows = run(cfg, out / "reference")
    except Exception as err:  # noqa: BLE001 - the check reports every failure and goes on
        return [{"label": f"ar_{mode}", "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}]
    return [{**r, "seconds": round(time.monotonic() - start, 1)} for r in rows]


def compiled_rows(out: Path, device: str, shape: str, dtype: str, rate: float, prompts: int, tokens: int, cache: str,
                  budget: Budget, method: str) -> list[dict]:
    """``method`` against ``ar`` with ``compile=true`` (buckets 1 and 8), then eagerly, on the synthetic pair of ``shape``
    at acceptance ``rate``: the summary rows of both runs, each with ``compile`` and the seconds the run took
    (compiling included, untimed by the run itself)."""
    from bench.runner import run

    rows = []
    for compiled in (True, False):
        if budget.left() < (150 if compiled else 45):
            rows.append({"method": method, "compile": compiled, "skipped": "no time left"})
            continue
        cfg = compose([f"method={method}", "pair=synthetic", f"pair.shape={shape}", f"pair.acceptance={rate}",
                       f"device={device}", f"dtype={dtype}", f"max_new_tokens={tokens}", f"dataset.n_prompts={prompts}",
                       "warmup=1", "reference=none", f"compile={str(compiled).lower()}", "compile_buckets=[1,8]",
                       f"cache_dir={cache}"])
        start = time.monotonic()
        try:
            rows += [{**r, "compile": compiled, "seconds": round(time.monotonic() - start, 1)}
                     for r in run(cfg, out / ("compiled" if compiled else "eager"))]
        except Exception as err:  # noqa: BLE001 - the check reports every failure and goes on
            rows.append({"method": method, "compile": compiled,
                         "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"})
    return rows


def gqa_cost(out: Path, device: str, budget: Budget) -> dict:
    """scripts/gqa_cost.py on ``device`` (CUDA only: the CPU's figures are in docs/measuring.md) for what the budget
    leaves, at most two minutes; its rows in ``out/gqa.csv``."""
    if not device.startswith("cuda"):
        return {"skipped": "CUDA only"}
    if budget.left() < 45:
        return {"skipped": "no time left"}
    cmd = [sys.executable, "scripts/gqa_cost.py", "--device", device, "--dtypes", "bfloat16", "--contexts", "1024,4096",
           "--layers", "4", "--csv", str(out / "gqa.csv")]
    status, stdout, stderr = run_within(cmd, min(budget.left(), 120))
    return {"status": status, "table": stdout[-6000:], "error": stderr[-2000:] if status != "passed" else ""}


def run_within(cmd: list[str], seconds: float, env: dict | None = None) -> tuple[str, str, str]:
    """``(status, stdout, stderr)`` of ``cmd`` run from the checkout, stopped after ``seconds``: status ``passed``,
    ``exit N`` or ``timed out`` (with what it printed until then)."""
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(seconds, 1))
        return ("passed" if done.returncode == 0 else f"exit {done.returncode}"), done.stdout, done.stderr
    except subprocess.TimeoutExpired as err:
        text = [(t.decode() if isinstance(t, bytes) else t or "") for t in (err.stdout, err.stderr)]
        return "timed out", text[0], text[1]


def leviathan(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al.'s expected speedup of a chain of ``gamma`` drafts at acceptance ``alpha``, cost ratio ``c``."""
    if alpha >= 1:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and r.get("speedup_median") == r.get("speedup_median")]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    names = sorted({r["method"] for r in ok})
    rates = sorted({r["acceptance_set"] for r in ok})
    width = 0.8 / max(len(rates), 1)
    for j, rate in enumerate(rates):
        ys = [next((r["speedup_median"] for r in ok if r["method"] == n and r["acceptance_set"] == rate), 0) for n in names]
        ax.bar([i + j * width for i in range(len(names))], ys, width, label=f"acceptance {rate}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + width * (len(rates) - 1) / 2 for i in range(len(names))], names, rotation=45, ha="right")
    ax.set_ylabel("median paired speedup over ar")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def walk(out: Path, device: str, quick: bool, budget: Budget, seconds: float) -> dict:
    """tests/test_gpu.py on ``device`` (quick: the device placement and the harness end to end only), stopped after
    ``seconds`` or when the budget is spent; its log in ``out/walk.log``."""
    if budget.left() < 30:
        return {"skipped": "no time left"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py", "-m", "gpu"]
    if quick:
        cmd += ["-k", "on_the_device_without_packed or harness_on_the_device"]
    status, stdout, stderr = run_within(cmd, min(budget.left(), seconds), {**os.environ, "BENCH_GPU_TEST_DEVICE": device})
    log = stdout + stderr
    (out / "walk.log").write_text(log)
    tail = [line for line in log.splitlines() if " passed" in line or " failed" in line][-1:]
    return {"status": status, "result": tail[0] if tail else ""}


def markdown(check: dict) -> str:
    from tabulate import tabulate

    lines = [f"# Device check, {check['date']}", "", "```", json.dumps(check["machine"], indent=1), "```", "",
             "## Cache guard and `ar` against cache-free greedy (tiny pair)", "",
             tabulate(check["guard"], headers="keys", tablefmt="github"), "",
             "## GPU test walk", "", json.dumps(check["walk"]), ""]
    from bench.summary import mib

    ref_cols = ["label", "tokens_per_s", "speedup_median", "speedup_vs_ref", "matches_baseline", "tie_flips",
                "mismatches", "peak_mem_bytes", "peak_decode_bytes", "seconds", "skipped", "error"]
    ref_rows = [{c.replace("_bytes", "_mib"): mib(r[c]) if c.endswith("_bytes") else r[c] for c in ref_cols if c in r}
                for r in check["reference"]]
    lines += [f"## Eager `ar` against the optimised plain decoding (`reference`): {check['synthetic_pair']}", "",
              tabulate(ref_rows, headers="keys", tablefmt="github", floatfmt=".4g"), ""]
    comp_cols = ["label", "compile", "tokens_per_s", "speedup_median", "matches_baseline", "tie_flips", "mismatches",
                 "peak_mem_bytes", "seconds", "skipped", "error"]
    comp_rows = [{c.replace("_bytes", "_mib"): mib(r[c]) if c.endswith("_bytes") else r[c] for c in comp_cols if c in r}
                 for r in check.get("compiled", [])]
    lines += ["## `compile=true` against eager (buckets 1 and 8; compiling counted in `seconds`)", "",
              tabulate(comp_rows, headers="keys", tablefmt="github", floatfmt=".4g"), ""]
    cols = ["method", "acceptance_set", "speedup_median", "speedup_pooled", "mean_accepted", "alpha", "cost_ratio_c",
            "analytic_speedup", "tokens_per_s", "ar_tokens_per_s", "target_calls_per_token", "peak_mem_bytes", "error"]
    rows = [{c.replace("_bytes", "_mib"): mib(r[c]) if c.endswith("_bytes") and c in r else r.get(c)
             for c in cols if c in r or c != "error"} for r in check["synthetic"]]
    lines += [f"## Synthetic pair: {check['synthetic_pair']}", "", tabulate(rows, headers="keys", tablefmt="github",
                                                                           floatfmt=".3g"), ""]
    batch_cols = ["method", "batch_size", "acceptance_set", "speedup_median", "throughput", "ar_throughput",
                  "mean_accepted", "target_calls_per_token", "peak_mem_bytes", "error"]
    batch_rows = [{c.replace("_bytes", "_mib"): mib(r[c]) if c.endswith("_bytes") else r[c] for c in batch_cols if c in r}
                  for r in check.get("batch", [])]
    lines += ["## A batch on the synthetic pair (each method against `ar` at the same B; throughput: tokens/s over "
              "the batch)", "", tabulate(batch_rows, headers="keys", tablefmt="github", floatfmt=".3g"), ""]
    if check["skipped"]:
        lines += ["Skipped for time: " + ", ".join(check["skipped"]), ""]
    gqa = check.get("gqa", {})
    lines += ["## GQA's key/value copy in verification (scripts/gqa_cost.py)", "",
              gqa.get("table") or json.dumps({k: v for k, v in gqa.items() if k != "table"}), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "results/gpu-check", help="folder for the results")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama-3.1-8b", help="the synthetic target's shape (bench/synthetic.py)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rates", default="0.6,0.9", help="acceptance rates, comma-separated")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--methods", default=",".join(SYNTHETIC_METHODS))
    p.add_argument("--batch-size", type=int, default=8, help="step 7's batch size (as many prompts, one batch)")
    p.add_argument("--batch-methods", default=",".join(BATCH_METHODS),
                   help="step 7's methods, each against ar at --batch-size on the synthetic pair at the last rate; none: skip")
    p.add_argument("--compiled", default="sd", help="step 5's method (compile=true against ar); none: skip the step")
    p.add_argument("--reference", choices=["auto", "compiled", "static", "none"], default="auto",
                   help="step 4's reference; auto: compiled on CUDA, static (uncompiled) elsewhere")
    p.add_argument("--walk", choices=["full", "quick", "none"], default="full")
    p.add_argument("--walk-seconds", type=float, default=180.0, help="the most step 3's test walk may take (an H200 "
                   "took 120 s for all of it on 2026-11-27)")
    p.add_argument("--budget", type=float, default=460.0, help="seconds for the whole check (under 8 minutes with the set-up)")
    args = p.parse_args(argv)
    budget = Budget(args.budget)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = str(out / "cache")
    check = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(args.device), "skipped": []}
    check["guard"] = guard_rows(args.device, cache)
    check["walk"] = (walk(out, args.device, args.walk == "quick", budget, args.walk_seconds) if args.walk != "none"
                     else {"skipped": "--walk none"})
    rates = [float(r) for r in args.rates.split(",")]
    check["synthetic_pair"] = f"{args.shape} in {args.dtype}, {args.prompts} prompts x {args.tokens} tokens"
    mode = args.reference if args.reference != "auto" else ("compiled" if args.device.startswith("cuda") else "static")
    check["reference"] = (reference_rows(out, args.device, args.shape, args.dtype, args.prompts, args.tokens, cache,
                                         budget, mode) if mode != "none" else [])
    check["compiled"] = (compiled_rows(out, args.device, args.shape, args.dtype, rates[0], args.prompts, args.tokens,
                                       cache, budget, args.compiled) if args.compiled != "none" else [])
    check["synthetic"], check["skipped"] = synthetic_rows(out, args.device, args.shape, args.dtype, rates, args.prompts,
                                                          args.tokens, cache, budget, args.methods.split(","))
    if args.batch_methods != "none":
        check["batch"], skipped = synthetic_rows(out, args.device, args.shape, args.dtype, rates[-1:], args.batch_size,
                                                 args.tokens, cache, budget, args.batch_methods.split(","), args.batch_size)
        check["skipped"] += skipped
    check["gqa"] = gqa_cost(out, args.device, budget)
    check["seconds"] = round(args.budget - budget.left(), 1)
    (out / "check.json").write_text(json.dumps(check, indent=1, default=str))
    import pandas as pd

    pd.DataFrame(check["synthetic"]).to_csv(out / "synthetic.csv", index=False)
    plot(check["synthetic"], out / "synthetic.png", f"synthetic {check['synthetic_pair']}, {check['machine'].get('gpu', args.device)}")
    (out / "summary.md").write_text(markdown(check))
    print(markdown(check))
    failed = any("error" in r or (r.get("ar_equals_cache_free") is False and not r.get("near_tie")) for r in check["guard"])
    # The reference must run, and its tokens may leave ar's only at near-ties (a rounding flip of the argmax).
    failed |= any("error" in r or (r.get("mismatches") or 0) > 0 for r in check["reference"])
    failed |= any("error" in r for r in check["compiled"])
    failed |= check["walk"].get("status", "passed") not in ("passed", "timed out")  # a failing GPU test fails the check
    failed |= any("error" in r for r in check.get("batch", []))
    return 1 if failed or any("error" in r for r in check["synthetic"]) else 0


if __name__ == "__main__":
    sys.exit(main())
