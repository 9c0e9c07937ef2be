"""The one timing loop. Every method is warmed up, synchronised and clocked here, the same way.

For each prompt the baseline (``ar``) and the method decode the same token ids back to back, in an order
that alternates from prompt to prompt so slow drift of the machine does not favour either; speedups are
ratios of those paired measurements, taken in the same run. Where the run times the optimised plain-decoding
reference (``bench.reference``: on CUDA by default), it decodes each prompt in the same alternation, and every
record also carries its speedup against it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from bench import kept, memory, quality, reference, summary
from bench.data import encode, load_prompts
from bench.models import load_pair, resolve_device, resolve_dtype, use_threads
from bench.results import (
    RecordWriter,
    previous_records,
    provenance,
    run_key,
    write_json_atomic,
)
from bench.validate import validate_run
from core import metrics
from core.clock import clocked, sync
from core.compiled import CompiledLM, check_compiler, no_recompiles
from core.compiled_rows import CompiledRows, row_buckets
from core.errors import BenchError
from core.kv_cache import lm_forward
from core.pair import Pair
from decoding.sampling import Sampling
from methods.registry import get_method

log = logging.getLogger(__name__)


def _clocked(method, device: torch.device, rows: int, decode, every_commit: bool = False) -> dict:
    """The one clock frame of a timed decode: the method's counts reset, the memory baseline taken, the device
    synchronised before each clock read, ``decode(callbacks)`` run under it with one ``on_tokens`` callback per row.
    Returns the decode's result, ``start``, ``end``, per row ``first`` (its first token's time; with ``every_commit``
    also ``last``, its last token's: one more synchronisation per commit, which a batch's per-row latency needs) and
    the decode's own peak memory above its start (``above``)."""
    method.pair.reset_counts()
    start_bytes = memory.decode_start(device)  # CUDA: the peak reset, what is allocated before the decode
    first: list[float | None] = [None] * rows
    last: list[float | None] = [None] * rows

    def told(b: int):
        def on_tokens(n: int) -> None:
            if n > 0 and (every_commit or first[b] is None):
                sync(device)
                last[b] = time.perf_counter()
                first[b] = first[b] or last[b]

        return on_tokens

    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        result = decode([told(b) for b in range(rows)])
    sync(device)
    end = time.perf_counter()
    return {"result": result, "start": start, "end": end, "first": first, "last": last,
            "above": memory.decode_peak(device, start_bytes)}


def timed_decode(method, pair: Pair, prompt_ids: torch.Tensor, max_new: int, sampling: Sampling, seed: int) -> dict:
    """Decode once under the clock; returns the method's output, the timings, the per-role counts (of the
    method's own role table, :func:`build_methods`) and the memory figures (:mod:`bench.memory`, read outside the
    clock)."""
    device = pair.device
    generator = torch.Generator(device=device).manual_seed(seed)
    t = _clocked(method, device, 1, lambda told: method.decode(prompt_ids, max_new, sampling, generator, told[0]))
    start, end, above = t["start"], t["end"], t["above"]
    return {
        "decoded": t["result"],
        "wall_s": end - start,
        "ttft_s": (t["first"][0] or end) - start,
        "counts": method.pair.counts(),
        "peak_mem_bytes": memory.peak_memory(device),
        # The decode's own peak; a cache the decoder keeps between prompts (the reference's static one) is its too.
        "peak_decode_bytes": None if above is None else above + getattr(method, "kept_cache_bytes", 0),
    }


def timed_batch(method, pair: Pair, prompts: list[torch.Tensor], max_new: int, sampling: Sampling,
                seeds: list[int]) -> list[dict]:
    """Decode ``prompts`` together (``batch_size`` > 1: ``DraftVerify.decode_batch``) once under the clock; per prompt
    what :func:`timed_decode` returns for one, its ``wall_s`` being its own end-to-end latency (start of the batch to
    its last token), its counts its share of the batch's (``DecodeOutput.counts``), and ``batch``: the batch's size,
    seconds and new tokens, the same for every row."""
    device = pair.device
    generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    t = _clocked(method, device, len(prompts),
                 lambda told: method.decode_batch(prompts, max_new, sampling, generators, told), every_commit=True)
    decoded, start, end = t["result"], t["start"], t["end"]
    batch = {"size": len(prompts), "wall_s": end - start, "new_tokens": sum(len(d.output_ids) for d in decoded)}
    peak = memory.peak_memory(device)
    return [{"decoded": d, "wall_s": (t["last"][b] or end) - start, "ttft_s": (t["first"][b] or end) - start,
             "counts": d.counts, "peak_mem_bytes": peak, "peak_decode_bytes": t["above"], "batch": batch}
            for b, d in enumerate(decoded)]


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


def longest_sequence(cfg: DictConfig, prompts: list[list[int]]) -> int:
    """The longest sequence a compiled model's static cache holds: the longest prompt, then the budget (or the
    warm-up's 16 tokens)."""
    return max((len(p) for p in prompts), default=0) + max(int(cfg.max_new_tokens), 16)


def compile_models(cfg: DictConfig, pair: Pair, prompts: list[list[int]], kept: dict | None = None) -> dict[str, CompiledLM]:
    """``compile=true``: the forwards of the target and of each draft model the run loaded, compiled per bucket of
    rows over one static cache each, sized for ``prompts``, the budget and the warm-up; every bucket compiled and the
    result checked against the eager model here, before any clock runs; every decode of the run (the baseline's, the
    method's) then goes through them. ``kept``: (role, max_len, buckets) -> compiled forwards an earlier run of this
    process made for the same model (:mod:`bench.kept`), taken from it (warmed again: instant while their graphs live)
    and checked again; the new ones are added to it. ``{role: compiled}``, empty when eager."""
    if not cfg.get("compile"):
        return {}
    kept = {} if kept is None else kept
    longest = longest_sequence(cfg, prompts)
    buckets = tuple(cfg.compile_buckets)
    compiled = {}
    for lm in (pair.target, *pair.drafts):
        key = (lm.role, longest, buckets)
        reused = key in kept and kept[key].module is lm.module
        if not reused:
            kept[key] = CompiledLM(lm.module, longest, buckets, role=lm.role)
        compiled[lm.role] = kept[key]
        compiled[lm.role].reused = reused  # run.json says so
        log.info("compiling the %s's forwards for %d row buckets (untimed%s)", lm.role, len(buckets),
                 "; kept from an earlier run" if reused else "")
        compiled[lm.role].warm()
        compiled[lm.role].check()
        lm.compiled = compiled[lm.role]
    return compiled


def batch_models(cfg: DictConfig, pair: Pair, prompts: list[list[int]], methods: list) -> dict[str, CompiledLM]:
    """``batch_size`` > 1: the target's forwards over a static cache of ``batch_size`` rows, one length per row (a
    ``DynamicCache`` cannot hold rows of different lengths), and those of each draft model that a method batching its
    drafting runs (``DraftVerify.batched_drafting``; its first ``drafts``) and the methods' own models whose forwards
    they yield (``Method.batch_parts``: EAGLE's draft layer, GliDe's draft, which reads the target's batch cache too);
    compiled per bucket with ``compile``
    (warmed before any clock), else the same code run eagerly; each checked against the eager model row by row
    either way. A method that does not batch its drafting drafts eagerly, one cache per row (docs/batching.md).
    ``{role: batch forwards}``."""
    longest = longest_sequence(cfg, prompts)
    # The draft models a method that batches its drafting runs (Method.drafts: its first n); the others need no cache.
    batched_drafts = max((m.drafts for m in methods if getattr(m, "batched_drafting", False)), default=0)
    models = {}
    for lm in (pair.target, *pair.drafts[:batched_drafts], *(part for m in methods for part in m.batch_parts())):
        # GliDe's draft attends to the target's cache too: its batch forwards read the target's batch cache.
        reads = models["target"].cache if getattr(lm.module, "read_layers", None) is not None else None
        sizes = cfg.get("compile_batch_sizes")
        graphs = CompiledLM(lm.module, longest, tuple(cfg.compile_buckets), role=lm.role,
                            rows=int(cfg.batch_size), compiled=bool(cfg.compile), reads=reads,
                            batch_sizes=None if sizes is None else tuple(sizes))
        log.info("the %s's batch forwards: %d rows%s", lm.role, graphs.cache.rows,
                 f", compiled for {len(graphs.buckets)} row buckets x batch sizes {list(graphs.batch_sizes)} (untimed)"
                 if cfg.compile else ", eager")
        graphs.warm()
        graphs.check()
        lm.compiled = models[lm.role] = graphs
    return models


def compile_parts(cfg: DictConfig, methods: list, batch: int,
                  longest: int | None = None) -> dict[str, CompiledRows | CompiledLM]:
    """``compile=true``: each method's cache-free parts (``Method.row_parts``: draft heads, SPRINTER's verifier)
    compiled per input shape its calls use and bucket of rows (the powers of two up to the most rows such a call holds);
    and, decoding one prompt at a time, its own models with a KV cache (``Method.batch_parts``: EAGLE's draft layer,
    Hydra++'s prefix layer, Amphista's stages, GliDe's draft; a batch compiles them in :func:`batch_models`) per bucket
    of query rows over a one-row static cache for sequences of ``longest`` positions, as the target's. Each warmed and
    checked against the eager part before any clock; dropped when the run ends (:func:`uncompile_parts`).
    ``{role: compiled}``."""
    if not cfg.get("compile"):
        return {}
    compiled = {}
    for method in methods:
        for part in method.batch_parts() if batch == 1 else ():
            if part.compiled is not None:  # a part a method shares with another (SAM-Decoding's EAGLE layer)
                continue
            if longest is None:  # a static cache sized for nothing would fail mid-decode, not here
                raise ValueError(f"compiling the {part.role}'s forwards needs the longest sequence its cache holds")
            # GliDe's draft attends to the target's cache too: its forwards read the target's compiled one.
            reads = method.pair.target.compiled.cache if getattr(part.module, "read_layers", None) is not None else None
            log.info("compiling the %s's forwards for %d row buckets (untimed)", part.role, len(cfg.compile_buckets))
            part.compiled = compiled[part.role] = CompiledLM(part.module, longest, tuple(cfg.compile_buckets),
                                                             role=part.role, reads=reads)
            part.compiled.warm()
            part.compiled.check()
        for part, most in method.row_parts(batch):
            buckets = {sig: row_buckets(rows) for sig, rows in most.items()}
            log.info("compiling the %s for %d input shapes, %d graphs (untimed)", part.role, len(buckets),
                     sum(map(len, buckets.values())))
            part.compiled = compiled[part.role] = CompiledRows(part.module, buckets, part.role)
            part.compiled.warm()
            part.compiled.check()
    return compiled


def uncompile_parts(methods: list, batch: int) -> None:
    """When the run ends: each method's compiled parts (:func:`compile_parts`) let go of their graphs and the frozen
    weights inductor's code holds, and run eagerly again. (Those of the method's own table are not the pair's that
    :func:`uncompile` walks; its models with a KV cache, compiled here at one row, are not kept for the next run as the
    pair's are.)"""
    for method in methods:
        for part in method.batch_parts() if batch == 1 else ():
            if part.compiled is not None:
                part.compiled.release()
                part.compiled.drop()
                part.compiled = None
        for part, _ in method.row_parts(batch):
            if part.compiled is not None:
                part.compiled.release()
                part.compiled = None


def uncompile(pair: Pair, keep: bool) -> None:
    """When the run ends: its models stop decoding through the compiled forwards. ``keep``: the run completed and its
    models and compiled forwards stay in :mod:`bench.kept` for the next compiled run of this process; else they are
    let go (their graphs hold frozen copies of the weights, or a CUDA-graph pool)."""
    models = [lm for lm in pair.roles.values() if getattr(lm, "compiled", None) is not None]  # a method's parts too
    graphs = any(lm.compiled.compiles for lm in models)
    for lm in models:
        if lm.compiled is not None:
            lm.compiled.release()
        lm.compiled = None
    if not keep:
        kept.release(graphs)


def check_context(pair: Pair, prompts: list, encoded: list[list[int]], max_new: int) -> None:
    """One sentence when a prompt and the token budget do not fit the target's context (its config's
    ``max_position_embeddings`` or ``n_positions``; a model that names none is not checked), or pass a sliding
    attention window of the target or a draft model (:func:`sliding_window`)."""
    if not encoded:
        return
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
    need = len(encoded[longest]) + max_new
    said = f"prompt {prompts[longest].prompt_id} is {len(encoded[longest])} tokens; with max_new_tokens={max_new} it"
    config = pair.target.module.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit and need > limit:
        raise BenchError(f"{said} passes the target's context of {limit} positions (a shorter dataset.input_tokens or "
                         "budget fits).")
    for lm in (pair.target, *pair.drafts):
        window = sliding_window(lm.module.config)
        if window is not None and need > window:
            raise BenchError(f"{said} passes the {lm.role}'s sliding attention window of {window} positions, which the "
                             "harness's own attention masks (trees, the static cache) do not apply, so its tokens would "
                             "not be the model's (a shorter dataset.input_tokens or budget fits).")


def sliding_window(config) -> int | None:
    """The positions a model's attention reaches back over when it slides (``sliding_window``: Mistral's, and
    Qwen2's when ``use_sliding_window``), None when it does not. The harness passes its own masks to the model's
    layers for trees and static caches, which attend over every cached position."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


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
        # Its settings as read at the run's batch size (method.by_batch).
        cls = get_method(name)
        settings = cls.check_settings(mcfg).at_batch(int(cfg.get("batch_size") or 1))
        built[name] = cls(settings, dataclasses.replace(pair, roles=dict(pair.roles)))
        built[name].setup(train_if_missing=cfg.train_if_missing)
    return built


def resume_plan(cfg: DictConfig, mcfgs: dict[str, DictConfig], run_dir: Path, prompts: list,
                others: dict[str, dict] | None = None) -> tuple[dict, dict]:
    """``keys[prompt_id][method]``: the run key of every decode this run makes; ``done[prompt_id]``: with
    ``resume`` set, the records of prompts whose every method already has a complete record in ``run_dir``
    (a prompt missing any of them is decoded again by all, so speedups stay paired within one process).
    ``others``: decoders the registry does not know, by name, with their settings (the reference), trained by none."""
    settings = {name: OmegaConf.to_container(m, resolve=True) for name, m in mcfgs.items()}
    # Only the methods that run something trained under the recipe depend on it (published weights: none).
    trains = {name: get_method(name).trains(cfg.pair, get_method(name).check_settings(m)) for name, m in mcfgs.items()}
    settings.update(others or {})
    trains.update(dict.fromkeys(others or {}, False))
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


def compiled_shapes(pair) -> tuple[str | None, str | None]:
    """What the target's compiled forwards have graphs for: the query-row buckets (``"1,2,4,8,16"``) and, compiled over
    a batch (B > 1), the running-row counts (``"1,2,4,8"``); None for each that is not compiled."""
    graphs = getattr(pair.target, "compiled", None)
    if graphs is None or not graphs.compiles:
        return None, None
    sizes = ",".join(str(r) for r in graphs.batch_sizes) if graphs.cache.rows > 1 else None
    return ",".join(str(b) for b in graphs.buckets), sizes


def make_record(cfg, pair, method, prompt, prompt_ids, run: dict, c: float, sampling: Sampling) -> dict:
    """One prompt's record from one timed decode (``c``: the run's measured draft/target cost ratio)."""
    decoded = run["decoded"]
    buckets, batch_sizes = compiled_shapes(pair)
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
        # The target's forwards compiled per bucket over a static cache (core/compiled.py), or eager.
        "compile": bool(cfg.get("compile")),
        # Prompts decoded together (docs/batching.md): this one's group's size, seconds and new tokens (None at 1).
        "batch_size": int(cfg.get("batch_size") or 1),
        "batch": run.get("batch"),
        # Compiled: the query-row buckets with graphs of their own ("1,2,4,8,16"), else None; at B > 1 also the
        # running-row counts ("1,2,4,8"; core/compiled.py), else None.
        "compile_buckets": buckets,
        "compile_batch_sizes": batch_sizes,
        "method_cfg": method.cfg.model_dump(mode="json"),
        # The training recipe behind the method's trained parts (draft, heads, verifier): its name, or
        # name~<hash> when its settings were overridden; None: nothing trained.
        "recipe": pair.teacher.recipe.label if type(method).trains(pair.spec, method.cfg) else None,
        "prompt_ids": prompt_ids,
        "input_tokens": len(prompt_ids),  # the prompt's length, as fed (the input-length axis)
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
        "peak_mem_bytes": run["peak_mem_bytes"],  # everything resident, the other method's parts too (bench/memory.py)
        "method_param_bytes": run.get("method_param_bytes"),  # the method's own parts and tensors beyond the target
        "peak_decode_bytes": run.get("peak_decode_bytes"),  # CUDA: the decode's own peak above what was resident
        "extra": decoded.extra,
    }
    rec.update(metrics.record_metrics(new, run["wall_s"], run["ttft_s"], decoded.accept_lengths, run["counts"]))
    return rec


def paired_speedup(base: dict, rec: dict) -> float:
    """Per-prompt speedup: baseline seconds per token over the method's, same prompt ids, same run
    (for lossless greedy methods the token counts are equal and this is the ratio of wall times)."""
    return metrics.ratio(metrics.ratio(base["wall_s"], base["new_tokens"]), metrics.ratio(rec["wall_s"], rec["new_tokens"]))


def pair_up(cfg: DictConfig, pair: Pair, per_prompt: dict[str, dict], ref, sampling: Sampling) -> list[dict]:
    """One prompt's records (method name -> record), each completed against the baseline's and the reference's of
    the same prompt: paired speedups, token equality (greedy), where a greedy output leaves the baseline's, and the
    quality of lossy output. Returns them in order."""
    base = per_prompt.get(cfg.get("baseline"))
    ref_rec = per_prompt.get(ref.name) if ref is not None else None
    for rec in per_prompt.values():
        if base is not None:
            rec["speedup"] = 1.0 if rec is base else paired_speedup(base, rec)
            # Token-for-token equality with the baseline: greedy runs only (sampled outputs match by chance);
            # on a synthetic pair only the reference against ar (the coin decides no plain step's token).
            compared = sampling.greedy and (not pair.synthetic or (rec is ref_rec and base["method"] == "ar"))
            rec["matches_baseline"] = rec["output_ids"] == base["output_ids"] if compared else None
        if ref_rec is not None:  # against the optimised plain decoding, beside the speedup against the baseline
            rec["speedup_vs_ref"] = 1.0 if rec is ref_rec else paired_speedup(ref_rec, rec)
        # A greedy output that leaves the baseline's: where, and whether the target's choice there was a
        # near-tie (a kernel rounding flip) or a real mismatch. Untimed, and its forward is not counted.
        rec["divergence"] = quality.divergence(pair, rec, base) if rec.get("matches_baseline") is False else None
        if rec is ref_rec and rec["divergence"] is not None:
            d = rec["divergence"]
            log.warning("%s's tokens leave %s's on prompt %s at position %d (the target's top-1 - top-2 logit "
                        "there: %.3g, %s); its record says so (matches_baseline: false)", ref.name,
                        base["method"], rec["prompt_id"], d["position"], d["margin"],
                        "a near-tie" if d["tie"] else "not a near-tie")
        if not rec["lossless"] and not pair.synthetic:
            # Lossy output is scored against AR and the reference; untimed, and its one target
            # forward is not counted (the counters are reset before the next timed decode).
            rec["quality"] = quality.record_quality(pair, rec, base)
    return list(per_prompt.values())


def run(cfg: DictConfig, run_dir: Path) -> list[dict]:
    """Decode every prompt of ``cfg.dataset`` with the baseline and ``cfg.method``; write the results."""
    cfg, checked = validate_run(cfg)  # checked once, defaults filled in: before any model loads or file is written
    use_threads(cfg)
    device = resolve_device(cfg.device)  # the optimised plain-decoding reference, or None; refused here if it cannot run
    if cfg.compile:
        check_compiler(device)
    batch = int(cfg.get("batch_size") or 1)
    # The reference decodes one prompt at a time: a batch run has none (run.json: reference null).
    ref_mode = None if batch > 1 else reference.mode_for(
        cfg, device, packed=bool(cfg.packed_linear) and not cfg.compile and device.type == "cpu"
        and resolve_dtype(cfg.dtype, device) == torch.float32)
    ref_cfg = reference.ReferenceConfig.of(ref_mode) if ref_mode else None
    torch.manual_seed(cfg.seed)
    prompts = load_prompts(cfg.dataset, cfg.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    mcfgs = method_cfgs(cfg)
    keys, done = resume_plan(cfg, mcfgs, run_dir, prompts,
                             {ref_cfg.name: ref_cfg.model_dump(mode="json")} if ref_cfg else None)
    # Prompt i keeps its index (its seed and its order of methods) whether or not earlier ones were kept.
    todo = [(i, p) for i, p in enumerate(prompts) if p.prompt_id not in done]
    carried = [r for p in prompts for r in done.get(p.prompt_id, [])]
    if cfg.get("resume"):
        log.info("resume: %d prompts complete in %s, %d to decode", len(done), run_dir, len(todo))

    methods_, encoded, tensors, ref, own, compiled = {}, [], [], None, {}, {}
    if todo:
        # Compiled: the models and compiled forwards an earlier compiled run of these settings in this process (a
        # sweep's) kept, if any; eager: nothing kept (an eager run packs its weights in place).
        slot = kept.slot_for(kept.key_of(cfg, checked)) if cfg.compile and batch == 1 else None
        if slot is None:
            kept.release()
        # A missing distilled draft is distilled first.
        pair = load_pair(cfg, drafts_needed(mcfgs), checked, slot.modules if slot else None)
        methods_ = build_methods(cfg, mcfgs, pair)
        sampling = Sampling(float(cfg.temperature), float(cfg.top_p))
        encoded = [encode(p, pair.tokenizer, cfg.dataset.get("template")) for _, p in todo]
        check_context(pair, [p for _, p in todo], encoded, int(cfg.max_new_tokens))
        tensors = [torch.tensor([ids], device=pair.device) for ids in encoded]
        prov = provenance(cfg, pair.device)
        prov["cost_ratio_c"] = cost_ratio(pair, tensors[0])
        prov["kernels"] = pair.kernels  # which CPU kernel each forward size took, and why (timings)
        # The optimised plain-decoding reference, with ar's stop tokens; its cache sized for these prompts.
        ref = reference.build(ref_mode, pair, get_method("ar")({}, pair).eos_ids, encoded, cfg.max_new_tokens)
        compiled = (batch_models(cfg, pair, encoded, list(methods_.values())) if batch > 1
                    else compile_models(cfg, pair, encoded, slot.compiled if slot else None))
        compiled.update(compile_parts(cfg, list(methods_.values()), batch, longest_sequence(cfg, encoded)))
        prov["compile"] = {role: c.describe() for role, c in compiled.items()} or None
        # What each method holds beyond the target (its parts, its tensors), measured once, outside any clock.
        own = {m.name: memory.method_param_bytes(m) for m in [*methods_.values(), *([ref] if ref else [])]}
    else:  # everything is already measured: no model needs loading
        prov = previous_provenance(run_dir) or {**provenance(cfg, torch.device("cpu")), "cost_ratio_c": float("nan")}
    if cfg.get("resume"):
        prov["resumed"] = {"kept_prompts": len(done), "decoded_prompts": len(todo)}
    prov["reference"] = ref_cfg.model_dump(mode="json") if ref_cfg else None
    prov["status"] = "running"
    write_json_atomic(run_dir / "run.json", prov)

    with contextlib.ExitStack() as held:
        if ref is not None:  # its compiled step's caches and CUDA graphs would keep the target alive
            held.callback(ref.close)
        ok = False  # every record written: only then are the compiled models kept for the next run
        if compiled:
            # A batch run's compiled forwards are never kept (bench.kept keeps one-row ones): let go of their graphs.
            held.callback(lambda: uncompile(pair, keep=ok and batch == 1))
            held.callback(lambda: uncompile_parts(list(methods_.values()), batch))
        # The reference is warmed up whatever `warmup` says: compiling its step and recording its CUDA graph are never
        # timed.
        for _ in range(max(int(cfg.warmup), 1) if ref is not None else 0):
            timed_decode(ref, pair, tensors[0], reference.WARMUP_TOKENS, sampling, cfg.seed)
        if compiled:  # every bucket was compiled at load: a graph compiled again now would be timed
            held.enter_context(no_recompiles())
        for _ in range(int(cfg.warmup) if tensors else 0):  # untimed: first-call allocations, lazy inits, caches
            for m in methods_.values():
                if batch > 1:
                    timed_batch(m, pair, tensors[:batch], min(16, cfg.max_new_tokens), sampling, [cfg.seed] * len(tensors[:batch]))
                else:
                    timed_decode(m, pair, tensors[0], min(16, cfg.max_new_tokens), sampling, cfg.seed)

        writer = RecordWriter(run_dir, carried)
        records: list[dict] = list(carried)
        try:
            order = [*methods_.values(), *([ref] if ref is not None else [])]
            items = list(zip(todo, encoded, tensors))
            groups = [items[g:g + batch] for g in range(0, len(items), batch)]  # the dataset's order, B at a time
            progress = tqdm(total=len(items), desc=f"{cfg.method.name} on {cfg.dataset.name}", unit="prompt")
            for group in groups:
                timed = {}  # method -> one result per prompt of the group
                first = group[0][0][0]  # the group's first prompt's index: at batch_size 1, the prompt's own
                for m in order if (first // batch) % 2 == 0 else order[::-1]:
                    seeds = [cfg.seed + i for (i, _), _, _ in group]
                    timed[m.name] = (timed_batch(m, pair, [x for _, _, x in group], cfg.max_new_tokens, sampling, seeds)
                                     if batch > 1 else [timed_decode(m, pair, group[0][2], cfg.max_new_tokens, sampling, seeds[0])])
                progress.update(len(group))
                for row, ((i, prompt), ids, _) in enumerate(group):
                    per_prompt = {}
                    for m in order:
                        res = timed[m.name][row]
                        res["method_param_bytes"] = own[m.name]
                        per_prompt[m.name] = make_record(cfg, pair, m, prompt, ids, res, prov["cost_ratio_c"], sampling)
                        per_prompt[m.name]["run_key"] = keys[prompt.prompt_id][m.name]
                    for rec in pair_up(cfg, pair, per_prompt, ref, sampling):
                        writer.write(rec)
                        records.append(rec)
            progress.close()
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
