"""The verification cost curve: what a target forward of k tokens costs against a one-token step (issue 40).

  python scripts/verify_cost.py [--rows 1,2,3,4,6,8,12,16,24,32] [--past 128] [--repeats 15] [--csv PATH]
      [hydra overrides, e.g. pair=smollm2 (the default) dtype=float32]

A speculative method gains what its accepted tokens save minus what its verification costs over ``ar``'s one-token
step; on a CPU that cost is set by which matmul kernel a row count takes (``core/kernels.py``). For the run's target
(loaded as a run loads it: ``bench.models.load_pair``), after a cache of ``--past`` tokens, a forward of k tokens
(every row's logits kept, as a chain's verification keeps them) is timed under the harness clock (``core.clock``), k
and the kernels interleaved in every round, the first round dropped, medians in ms, with each kernel the linears can
take on the CPU in fp32:

- ``plain``: ``F.linear`` for every row count (transformers' own modules);
- ``packed``: the oneDNN-packed weights for every row count;
- ``chosen``: what a run takes (per size, the kernel timed faster at load: ``core.kernels.choose_kernels``).

With ``--compiled``, also ``compiled``: the forward as ``compile=true`` runs it (``core.compiled.CompiledLM``, a
graph per k on its static cache, the linears on ``F.linear`` for inductor to pack), timed in rounds of its own with
``plain`` again beside it (``compiled_plain_ms``), so the two compare within one set of rounds. Compiling costs
about a minute per k for SmolLM2-135M on 2 cores (untimed).

``ratio_*``: the forward's time over the same kernel's one-row forward; the memory roofline says it should stay
near 1 while k is small (the same weights are read). ``bound_ms``: that roofline's floor, the **streaming bound**: the
target's weight bytes over this machine's read bandwidth, measured here (:func:`read_bandwidth`), the least a forward
that reads every weight once can take. Prints a table; ``--csv`` writes its rows.

With ``--profile K`` (after ``--compiled``), where the compiled K-token forward's time goes: ``torch.profiler`` over
``--repeats`` of them after the same cache, the operators by their own CPU time, and their shares by kind (the
matrix products, attention, the compiled graph's fused loops, the rest).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cli import compose  # noqa: E402
from bench.models import load_pair, use_threads  # noqa: E402
from bench.validate import validate_run  # noqa: E402
from core.kernels import PACKED, PLAIN, PackedLinear, time_forwards  # noqa: E402

def read_bandwidth(device: torch.device, nbytes: int = 1 << 29, repeats: int = 10) -> float:
    """Bytes per second this machine reads from memory, as a forward reads its weights: the median time of summing a
    ``nbytes`` float32 tensor (far larger than any CPU cache) under the harness clock, after an untimed sum."""
    from core.clock import clocked

    x = torch.ones(nbytes // 4, device=device)
    x.sum()
    seconds = statistics.median(clocked(device, torch.sum, x)[1] for _ in range(repeats))
    return nbytes / seconds


def curve(model, rows: list[int], past: int, repeats: int) -> list[dict]:
    """Median ms of a k-token forward after ``past`` cached tokens, per kernel and k (``core.kernels.time_forwards``),
    and each one's ratio to the same kernel's one-token forward."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    tables = {"plain": PLAIN, "packed": PACKED, "chosen": linears[0].packed_at} if linears else {"plain": PLAIN}
    ms = time_forwards(model, tables, tuple(rows), repeats, past)
    return [{"k": k, **{f"{name}_ms": ms[name][k] for name in tables},
             **{f"ratio_{name}": round(ms[name][k] / ms[name][rows[0]], 3) for name in tables}} for k in rows]


def compiled_curve(model, rows: list[int], past: int, repeats: int, profile: int = 0) -> dict[int, dict]:
    """Per k: median ms of the compiled forward of k tokens (a graph per k) after ``past`` cached tokens, and of the
    eager ``F.linear`` one in the same rounds, interleaved, the first round dropped; ``profile`` (a k of ``rows``):
    then print :func:`profiled`'s table for it."""
    from transformers import DynamicCache

    from core.clock import clocked
    from core.compiled import CompiledLM, no_recompiles
    from core.kv_cache import lm_forward

    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for lin in linears:
        lin.packed_at = PLAIN  # F.linear: inductor's freezing packs the weights per graph itself
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.arange(past + max(rows), device=device).remainder(vocab).unsqueeze(0)
    compiled = CompiledLM(model, past + max(rows), tuple(rows))
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.enable_kernel_profile": bool(profile)}):  # name each fused loop in the profile
        compiled.warm()
    cache, static = DynamicCache(), compiled.new_cache("verify_cost")
    times = {(name, k): [] for name in ("compiled", "compiled_plain") for k in rows}
    with torch.inference_mode(), no_recompiles():
        lm_forward(model, ids[:, :past], cache)
        compiled(ids[:, :past], static)  # the static cache's prefix (uncompiled where past exceeds every bucket)
        for round_ in range(repeats + 1):
            for k in rows:
                step = ids[:, past:past + k]
                for name, forward, held in (("compiled", lambda: compiled(step, static), static),
                                            ("compiled_plain", lambda: lm_forward(model, step, cache), cache)):
                    _, seconds = clocked(device, forward)
                    held.crop(-k)
                    if round_:
                        times[(name, k)].append(seconds)
    if profile:
        print(profiled(compiled, static, ids[:, past:past + profile], repeats))
    compiled.release()
    ms = {key: round(statistics.median(v) * 1e3, 2) for key, v in times.items()}
    return {k: {"compiled_ms": ms[("compiled", k)], "compiled_plain_ms": ms[("compiled_plain", k)],
                "ratio_compiled": round(ms[("compiled", k)] / ms[("compiled", rows[0])], 3),
                "compiled_vs_plain": round(ms[("compiled", k)] / ms[("compiled_plain", k)], 3)} for k in rows}


KINDS = {  # operator name fragments -> what a profile groups them as (first match wins)
    "matrix products": ("mkldnn", "mkl_linear", "addmm", "aten::mm", "aten::bmm", "linear", "matmul", "onednn"),
    "attention": ("attention", "sdpa", "softmax"),
    "fused loops (inductor)": ("cpp_fused", "triton", "graph_", "kernel"),
}


def profiled(compiled, cache, step: torch.Tensor, repeats: int) -> str:
    """Where ``repeats`` compiled forwards of ``step (1, k)`` after ``cache``'s tokens spend their time: torch.profiler's
    operators by self CPU time (top 20), then the share of each of :data:`KINDS`."""
    from torch.profiler import ProfilerActivity, profile

    from core.compiled import no_recompiles

    k = step.shape[1]
    with torch.inference_mode(), no_recompiles():
        compiled(step, cache)  # once outside the profile
        cache.crop(-k)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                compiled(step, cache)
                cache.crop(-k)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    shares = dict.fromkeys([*KINDS, "the rest"], 0.0)
    for e in events:
        name = e.key.lower()
        kind = next((kind for kind, parts in KINDS.items() if any(p in name for p in parts)), "the rest")
        shares[kind] += e.self_cpu_time_total
    lines = [f"profile of {repeats} compiled {k}-token forwards: {total / repeats / 1e3:.2f} ms each (self CPU time, "
             "profiler overhead included)",
             prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20),
             *(f"  {kind}: {t / total:.0%} ({t / repeats / 1e3:.2f} ms a forward)" for kind, t in shares.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,3,4,6,8,12,16,24,32", help="tokens k per forward, comma-separated (1 first)")
    p.add_argument("--past", type=int, default=128, help="cached tokens before each forward")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds")
    p.add_argument("--csv", type=Path, help="also write the rows here")
    p.add_argument("--compiled", action="store_true", help="also time the compiled forwards (compile=true's)")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="with --compiled: profile the compiled K-token forward (K one of --rows)")
    args, overrides = p.parse_known_args(argv)
    rows = sorted({int(r) for r in args.rows.split(",")})
    if rows[0] != 1:
        p.error("--rows must include 1 (the ratios are to the one-token step)")
    if args.profile and (not args.compiled or args.profile not in rows):
        p.error("--profile K needs --compiled and K among --rows")
    cfg, checked = validate_run(compose(["method=ar", "train_if_missing=false", *overrides]))
    use_threads(cfg)
    pair = load_pair(cfg, 0, checked)
    model = pair.target.module
    table = curve(model, rows, args.past, args.repeats)
    if args.compiled:
        extra = compiled_curve(model, rows, args.past, args.repeats, args.profile)
        table = [{**row, **extra[row["k"]]} for row in table]
    weights = sum(t.numel() * t.element_size() for t in model.parameters())  # tied weights once, as a forward reads them
    bandwidth = read_bandwidth(pair.device)
    bound_ms = round(weights / bandwidth * 1e3, 3)
    table = [{**row, "bound_ms": bound_ms} for row in table]
    from tabulate import tabulate

    print(f"{cfg.pair.name} on {pair.device} in {str(pair.dtype).removeprefix('torch.')}, {args.past} cached tokens, "
          f"{torch.get_num_threads()} threads; kernels chosen at load: {pair.kernels.get('target')}")
    fastest = min(v for k, v in table[0].items() if k.endswith("_ms") and k != "bound_ms")
    print(f"streaming bound: {weights / 1e6:.0f} MB of weights at {bandwidth / 1e9:.1f} GB/s read = {bound_ms} ms per "
          f"forward; the fastest one-token forward above ({fastest} ms) runs at {bound_ms / fastest:.0%} of it")
    print(tabulate(table, headers="keys", tablefmt="github"))
    if args.csv:
        import pandas as pd

        pd.DataFrame(table).to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
