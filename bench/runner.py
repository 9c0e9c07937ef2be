"""The one timing loop. Every method is warmed up, synchronised and clocked here, the same way.

For each prompt the baseline (``ar``) and the method decode the same token ids back to back, in an order
that alternates from prompt to prompt so slow drift of the machine does not favour either; speedups are
ratios of those paired measurements, taken in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from bench import quality, summary
from bench.data import encode, load_prompts
from bench.models import load_pair
from bench.results import (
    RecordWriter,
    previous_records,
    provenance,
    run_key,
    write_json_atomic,
)
from bench.validate import validate
from core import metrics
from core.clock import clocked, sync
from core.kv_cache import lm_forward
from core.pair import Pair
from decoding.sampling import Sampling
from methods.registry import get_method

log = logging.getLogger(__name__)


def peak_memory(device: torch.device) -> int:
    """Peak bytes: CUDA allocator peak since the last reset; on CPU the process's peak RSS (a high-water mark)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed_decode(method, pair: Pair, prompt_ids: torch.Tensor, max_new: int, sampling: Sampling, seed: int) -> dict:
    """Decode once under the clock; returns the method's output, the timings and the per-role counts (of the
    method's own role table, :func:`build_methods`)."""
    device = pair.device
    method.pair.reset_counts()
    generator = torch.Generator(device=device).manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first: list[float] = []

    def on_tokens(n: int) -> None:
        if not first and n > 0:
            sync(device)
            first.append(time.perf_counter())

    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        decoded = method.decode(prompt_ids, max_new, sampling, generator, on_tokens)
    sync(device)
    end = time.perf_counter()
    return {
        "decoded": decoded,
        "wall_s": end - start,
        "ttft_s": (first[0] if first else end) - start,
        "counts": method.pair.counts(),
        "peak_mem_bytes": peak_memory(device),
    }


def forward_seconds(device: torch.device, model, context: torch.Tensor, new_tokens: int = 1, repeats: int = 10) -> float:
    """Median seconds of one ``new_tokens``-token forward of a causal LM ``model`` (a transformers module,
    uncounted) after a KV cache of ``context (1, T)``, under the harness clock; the first call is a warm-up."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        lm_forward(model, context, cache, logits_to_keep=1)
    step = context[:, -new_tokens:]
    samples = []
    for _ in range(repeats + 1):
        _, seconds = clocked(device, lm_forward, model, step, cache)
        cache.crop(-new_tokens)
        samples.append(seconds)
    return metrics.median(samples[1:])


def cost_ratio(pair: Pair, prompt_ids: torch.Tensor, repeats: int = 10) -> float:
    """c of Leviathan et al.: median time of one single-token draft forward over one of the target, with a
    KV cache of the prompt, measured here under the same clock (NaN without a draft)."""
    if not pair.drafts:
        return float("nan")
    draft, target = (forward_seconds(pair.device, lm.module, prompt_ids, 1, repeats) for lm in (pair.drafts[0], pair.target))
    return draft / target


def method_cfgs(cfg: DictConfig) -> dict[str, DictConfig]:
    """The baseline (if any) and the method under test, in that order, each with its settings: the
    baseline gets its own settings in full (e.g. ``sd``'s gamma), as ``method=<name>``
    would, since its decode reads them like any method's."""
    cfgs = {}
    if cfg.get("baseline") and cfg.baseline != cfg.method.name:
        cfgs[cfg.baseline] = get_method(cfg.baseline).settings({})
    cfgs[cfg.method.name] = cfg.method
    return cfgs


def drafts_needed(mcfgs: dict[str, DictConfig]) -> int:
    """How many of the pair's drafts the baseline and the method use (the rest are never loaded or trained)."""
    return max(get_method(name).drafts for name in mcfgs)


def build_methods(cfg: DictConfig, mcfgs: dict[str, DictConfig], pair: Pair) -> dict:
    """The baseline (if any) and the method under test, set up (trained if missing) before any clock runs."""
    built = {}
    for name, mcfg in mcfgs.items():
        # Each its own role table over the shared models: amphista and its baseline medusa both count "heads",
        # and one registering it must not take the other's counts away.
        built[name] = get_method(name)(mcfg, dataclasses.replace(pair, roles=dict(pair.roles)))
        built[name].setup(train_if_missing=cfg.train_if_missing)
    return built


def resume_plan(cfg: DictConfig, mcfgs: dict[str, DictConfig], run_dir: Path, prompts: list) -> tuple[dict, dict]:
    """``keys[prompt_id][method]``: the run key of every decode this run makes; ``done[prompt_id]``: with
    ``resume`` set, the records of prompts whose every method already has a complete record in ``run_dir``
    (a prompt missing any of them is decoded again by all, so speedups stay paired within one process)."""
    settings = {name: OmegaConf.to_container(m, resolve=True) for name, m in mcfgs.items()}
    # Only the methods that run something trained under the recipe depend on it (published weights: none).
    trains = {name: get_method(name).trains(cfg.pair, get_method(name).check_settings(m)) for name, m in mcfgs.items()}
    keys = {p.prompt_id: {name: run_key(mc, cfg, p.prompt_id, trains[name]) for name, mc in settings.items()}
            for p in prompts}
    done = {}
    if cfg.get("resume"):
        prev = previous_records(run_dir)
        for pid, ks in keys.items():
            if all(k in prev for k in ks.values()):
                done[pid] = [prev[k] for k in ks.values()]
    return keys, done


def previous_provenance(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None


def make_record(cfg, pair, method, prompt, prompt_ids, run: dict, c: float, sampling: Sampling) -> dict:
    """One prompt's record from one timed decode (``c``: the run's measured draft/target cost ratio)."""
    decoded = run["decoded"]
    new = len(decoded.output_ids)
    text = pair.tokenizer.decode(decoded.output_ids, skip_special_tokens=True)
    rec = {
        "method": method.name,
        "lossless": method.is_lossless(sampling),
        "pair": pair.name,
        # Random weights of a real shape and a set acceptance (bench/synthetic.py): real costs, a chosen acceptance;
        # the outputs follow the coin, so they are never compared with the baseline's or scored for quality.
        "synthetic": pair.synthetic,
        "acceptance_set": pair.spec.get("acceptance"),
        "dataset": cfg.dataset.name,
        "prompt_id": prompt.prompt_id,
        "category": prompt.category,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
        "method_cfg": method.cfg.model_dump(mode="json"),
        # The training recipe behind the method's trained parts (draft, heads, verifier): its name, or
        # name~<hash> when its settings were overridden; None: nothing trained.
        "recipe": pair.teacher.recipe.label if type(method).trains(pair.spec, method.cfg) else None,
        "prompt_ids": prompt_ids,
        "output_ids": decoded.output_ids,
        "output_text": text,
        "reference": prompt.reference,
        "new_tokens": new,
        # The answer's length as Spec-Bench's speed.py counts a baseline's: its text tokenized again, less one (the
        # BOS a Llama tokenizer adds; a tokenizer that adds none loses a real token, as there).
        "specbench_tokens": None if pair.synthetic else len(pair.tokenizer(text).input_ids) - 1,
        "accept_lengths": decoded.accept_lengths,
        "drafted": decoded.drafted,
        # P(draft token i accepted | tokens before it accepted and i proposed), i = 0, 1, ...; [] without drafts.
        "accept_by_position": (metrics.acceptance_by_position(decoded.accept_lengths, decoded.drafted)
                               if any(decoded.drafted) else []),
        "cost_ratio_c": c,  # the run's measured c, so a table reads it from the records (the analytic speedup)
        "peak_mem_bytes": run["peak_mem_bytes"],
        "extra": decoded.extra,
    }
    rec.update(metrics.record_metrics(new, run["wall_s"], run["ttft_s"], decoded.accept_lengths, run["counts"]))
    return rec


def paired_speedup(base: dict, rec: dict) -> float:
    """Per-prompt speedup: baseline seconds per token over the method's, same prompt ids, same run
    (for lossless greedy methods the token counts are equal and this is the ratio of wall times)."""
    return metrics.ratio(metrics.ratio(base["wall_s"], base["new_tokens"]), metrics.ratio(rec["wall_s"], rec["new_tokens"]))


def run(cfg: DictConfig, run_dir: Path) -> list[dict]:
    """Decode every prompt of ``cfg.dataset`` with the baseline and ``cfg.method``; write the results."""
    cfg = validate(cfg)  # checked, defaults filled in: before any model loads or any file is written
    torch.manual_seed(cfg.seed)
    prompts = load_prompts(cfg.dataset, cfg.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    mcfgs = method_cfgs(cfg)
    keys, done = resume_plan(cfg, mcfgs, run_dir, prompts)
    # Prompt i keeps its index (its seed and its order of methods) whether or not earlier ones were kept.
    todo = [(i, p) for i, p in enumerate(prompts) if p.prompt_id not in done]
    carried = [r for p in prompts for r in done.get(p.prompt_id, [])]
    if cfg.get("resume"):
        log.info("resume: %d prompts complete in %s, %d to decode", len(done), run_dir, len(todo))

    methods_, encoded, tensors = {}, [], []
    if todo:
        pair = load_pair(cfg, n_drafts=drafts_needed(mcfgs))  # a missing distilled draft is distilled first
        methods_ = build_methods(cfg, mcfgs, pair)
        sampling = Sampling(float(cfg.temperature), float(cfg.top_p))
        encoded = [encode(p, pair.tokenizer, cfg.dataset.get("template")) for _, p in todo]
        tensors = [torch.tensor([ids], device=pair.device) for ids in encoded]
        prov = provenance(cfg, pair.device)
        prov["cost_ratio_c"] = cost_ratio(pair, tensors[0])
        prov["one_row_kernels"] = pair.kernels  # which CPU kernel one-token forwards took, and why (timings)
    else:  # everything is already measured: no model needs loading
        prov = previous_provenance(run_dir) or {**provenance(cfg, torch.device("cpu")), "cost_ratio_c": float("nan")}
    if cfg.get("resume"):
        prov["resumed"] = {"kept_prompts": len(done), "decoded_prompts": len(todo)}
    prov["status"] = "running"
    write_json_atomic(run_dir / "run.json", prov)

    for _ in range(int(cfg.warmup) if tensors else 0):  # untimed: first-call allocations, lazy inits, caches
        for m in methods_.values():
            timed_decode(m, pair, tensors[0], min(16, cfg.max_new_tokens), sampling, cfg.seed)

    writer = RecordWriter(run_dir, carried)
    records: list[dict] = list(carried)
    ok = False
    try:
        order = list(methods_.values())
        for (i, prompt), ids, x in tqdm(list(zip(todo, encoded, tensors)), desc=f"{cfg.method.name} on {cfg.dataset.name}", unit="prompt"):
            per_prompt = {}
            for m in order if i % 2 == 0 else order[::-1]:
                res = timed_decode(m, pair, x, cfg.max_new_tokens, sampling, cfg.seed + i)
                per_prompt[m.name] = make_record(cfg, pair, m, prompt, ids, res, prov["cost_ratio_c"], sampling)
                per_prompt[m.name]["run_key"] = keys[prompt.prompt_id][m.name]
            base = per_prompt.get(cfg.get("baseline"))
            for name, rec in per_prompt.items():
                if base is not None:
                    rec["speedup"] = 1.0 if rec is base else paired_speedup(base, rec)
                    # Token-for-token equality with the baseline: greedy runs only (sampled outputs match by chance).
                    rec["matches_baseline"] = (rec["output_ids"] == base["output_ids"]
                                               if sampling.greedy and not pair.synthetic else None)
                # A greedy output that leaves the baseline's: where, and whether the target's choice there was a
                # near-tie (a kernel rounding flip) or a real mismatch. Untimed, and its forward is not counted.
                rec["divergence"] = quality.divergence(pair, rec, base) if rec.get("matches_baseline") is False else None
                if not rec["lossless"] and not pair.synthetic:
                    # Lossy output is scored against AR and the reference; untimed, and its one target
                    # forward is not counted (the counters are reset before the next timed decode).
                    rec["quality"] = quality.record_quality(pair, rec, base)
                writer.write(rec)
                records.append(rec)
        ok = True
    finally:
        writer.close(publish=ok)
        prov["status"] = "complete" if ok else "failed"
        prov["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if ok:
            # From the records just published, read back as `python -m bench table` reads them: one summary.
            prov["summary"] = summary.as_rows(summary.run_summary(run_dir, cfg.get("baseline")))
        write_json_atomic(run_dir / "run.json", prov)
    return prov["summary"]
