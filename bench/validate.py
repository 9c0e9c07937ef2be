"""The check of a composed config, run before any model loads or any training starts.

Each node is validated against its declaration (:class:`RunSettings` here: the top level; ``Method.Config``:
the method and the baseline; ``bench.models.PairSettings``: the pair; ``bench.data``: the dataset's source;
``training.recipes.RecipeSettings``: the training recipe and its teacher store), then the files the config names are read far enough to know they are
usable. The first problem is one sentence
(:class:`core.errors.BenchError`) naming the key, the value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import Field, field_validator

from bench.data import dataset_settings
from bench.models import HubModel, PairSettings
from core import files, model_parts
from core.errors import BenchError
from core.schema import Settings, as_config, check
from methods.registry import get_method
from training.recipes import RecipeSettings

GROUPS = ("method", "pair", "dataset", "recipe")  # the config groups (bench.cli reads them from here)
DEFAULT_MAX_NEW_TOKENS = 128  # when neither the command line nor the dataset sets a budget


class RunSettings(Settings):
    """Top-level settings of ``python -m bench run`` (and ``train``)."""

    max_new_tokens: int | None = Field(None, ge=1, description="new tokens per prompt; null: the dataset's own "
                                       "max_new_tokens, else 128 (decoding also stops at EOS)")
    temperature: float = Field(0.0, ge=0, description="0 = greedy (the default); > 0 samples")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    seed: int = Field(0, ge=0, description="seeds sampling and prompt selection")
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$",
                        description="auto = CUDA when present, else cpu; or cpu, cuda, cuda:N, mps (when present)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = bfloat16 on CUDA, float32 on CPU")
    cache_dir: str | None = Field(None, description="converted models, drafts, heads, verifiers, tables; "
                                  "null = $BENCH_CACHE or ~/.cache/specbench")
    baseline: str | None = Field("ar", description="method run on the same prompts in the same run, for "
                                 "paired speedups (null: none)")
    warmup: int = Field(1, ge=0, description="untimed warm-up decodes (per method) before the timed prompts")
    reference: Literal["auto", "compiled", "static", "none"] = Field(
        "auto", description="also time plain decoding on a static cache (compiled: + torch.compile); auto = compiled "
        "on CUDA when greedy")
    train_if_missing: bool = Field(True, description="train a missing draft / heads / verifier before decoding")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU (null: torch's default)")
    packed_linear: bool = Field(True, description="CPU fp32, eager: each forward size takes the faster of "
                                "F.linear and packed weights (core/kernels.py)")
    compile: bool = Field(False, description="target forwards compiled per row bucket on a static cache, baseline "
                          "and method alike (core/compiled.py)")
    compile_buckets: list[Annotated[int, Field(ge=1)]] = Field([1, 2, 4, 8, 16, 32, 64], min_length=1, description="with compile: a forward of "
                                       "n rows runs the smallest bucket >= n (larger: uncompiled)")
    compile_batch_sizes: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="with compile, batch_size > 1: running-row counts also compiled for (null: the powers of "
        "two below batch_size on CUDA, none on CPU)")
    batch_size: int = Field(1, ge=1, description="prompts decoded together, one target forward per step for all "
                            "(docs/batching.md); 1: one at a time")
    resume: str | None = Field(None, min_length=1, description="DIR: write the run (with -m: the sweep) into DIR, "
                               "keep its complete records, decode only the rest")

    @field_validator("device")
    @classmethod
    def device_present(cls, device: str) -> str:
        """A device this machine has: checked now, not when the first tensor moves."""
        import torch

        if device == "mps" and not torch.backends.mps.is_available():
            raise ValueError("device 'mps' was asked for but this machine has no MPS (Apple GPU) device.")
        if device.startswith("cuda"):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = int(device.partition(":")[2] or 0)
            if index >= count:
                raise ValueError(f"device '{device}' was asked for but this machine has {count} CUDA device(s).")
        return device


def plain(cfg: DictConfig) -> dict:
    """The composed config as plain values, interpolations resolved (a failing one is one sentence)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise BenchError(f"config value {err.full_key or ''} cannot be resolved: {str(err).splitlines()[0]}.") from None


def checked(cfg: DictConfig) -> dict[str, Settings]:
    """Every node of ``cfg`` validated: ``{"": top level, "method": ..., "pair": ..., "dataset": ..., "recipe": ...}``, defaults
    filled in and ``max_new_tokens`` resolved; raises :class:`BenchError` on the first problem."""
    data = plain(cfg)
    nodes = {g: data.pop(g, None) or {} for g in GROUPS}
    settings = check(RunSettings, data, "", "the top level")
    method_cls = get_method(nodes["method"].get("name"))
    method = method_cls.check_settings(nodes["method"])
    at_batch = method.at_batch(settings.batch_size)  # what the run reads (method.by_batch)
    pair = check(PairSettings, nodes["pair"], "pair", f"pair={nodes['pair'].get('name')}")
    method_cls.check_pair(at_batch, pair)
    if pair.synthetic:
        check_synthetic(settings, method_cls, at_batch, pair)
    dataset = dataset_settings(nodes["dataset"])
    recipe = check(RecipeSettings, nodes["recipe"], "recipe", f"recipe={nodes['recipe'].get('name')}")
    method_cls.check_recipe(at_batch, recipe)
    if settings.baseline is not None:
        baseline = get_method(settings.baseline)  # an unknown name lists the known ones
        try:
            baseline.check_pair(baseline.check_settings({}), pair)
        except BenchError as err:
            raise BenchError(f"baseline={settings.baseline}: {err}") from None
    if settings.max_new_tokens is None:
        settings.max_new_tokens = dataset.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if settings.batch_size > 1:
        for role, cls in (("method", method_cls), ("baseline", get_method(settings.baseline) if settings.baseline else None)):
            if cls is not None and cls.batch_refusal:
                raise BenchError(f"{role}={cls.name} cannot decode a batch yet: {cls.batch_refusal}; set batch_size=1.")
    return {"": settings, "method": method, "pair": pair, "dataset": dataset, "recipe": recipe}


def check_synthetic(settings: RunSettings, method_cls, method, pair: PairSettings) -> None:
    """What a synthetic pair (random weights, a set acceptance) can run: greedy decoding (the coin decides the
    target's argmax), every method, its trained parts untrained (``training.kit.untrained_if_synthetic``: random
    weights teach nothing, and the acceptance is set anyway), but not the authors' published weights, which belong
    to a real target."""
    if settings.temperature > 0:
        raise BenchError(f"pair={pair.name} sets the target's greedy choice by its acceptance; run it with "
                         "temperature=0.")
    if (published := published_weights(method.model_dump(mode="json"), "method")) is not None:
        key, value = published
        raise BenchError(f"{key}={value} reads published weights trained for a real target, which pair={pair.name} "
                         "(random weights) is not; leave it unset there: a synthetic pair runs trained parts untrained.")


def published_weights(settings: dict, at: str) -> tuple[str, str] | None:
    """``(key, value)`` of the first ``weights`` (the authors' published drafter) set in a method's settings or in a
    method's nested in them (``koala``'s base, ``samd``'s eagle); None: none is."""
    for key, value in settings.items():
        if key == "weights" and value:
            return f"{at}.{key}", value
        if isinstance(value, dict) and (found := published_weights(value, f"{at}.{key}")) is not None:
            return found
    return None


def validate_run(cfg: DictConfig) -> tuple[DictConfig, dict[str, Settings]]:
    """``cfg`` checked (:func:`checked`) and the files it names read far enough to be trusted, once per run: the
    config the run uses (defaults filled in; what records and run keys read) and the typed settings it was checked
    into (:func:`checked`'s), which loading and training take as they are (``bench.models.load_pair(cfg, n,
    checked)``); or one sentence on the first problem."""
    nodes = checked(cfg)
    check_files(nodes["pair"], nodes["dataset"])
    check_resume(nodes[""].resume)
    out = as_config(nodes[""])
    for group in GROUPS:
        out[group] = as_config(nodes[group])
    return out, nodes


def validate(cfg: DictConfig) -> DictConfig:
    """:func:`validate_run`'s config alone (for what loads no pair, or a script that lets ``load_pair`` check again)."""
    return validate_run(cfg)[0]


def check_files(pair: PairSettings, dataset) -> None:
    """The files a config names, read just far enough to trust them (``core/files.py``): local model folders
    and the question file. The sentence is prefixed by the key that named the file."""
    named = [("pair.target.id" if i == 0 else f"pair.drafts.{i - 1}.id", spec)
             for i, spec in enumerate([pair.target, *pair.drafts])]
    for key, spec in named:
        if isinstance(spec, HubModel) and files.looks_local(spec.id):
            _with_key(key, files.check_model_folder, Path(spec.id).expanduser())
            _with_key(key, model_parts.check_folder_family, Path(spec.id).expanduser())
            if key == "pair.target.id":  # the pair's tokenizer is the target's
                _with_key(key, files.check_tokenizer_folder, Path(spec.id).expanduser())
    if dataset.source == "spec_bench" and "://" not in dataset.path:
        _with_key("dataset.path", files.read_question_file, dataset.path)


def check_resume(resume: str | None) -> None:
    """``resume=DIR`` names a folder (or one to create), never a file."""
    if resume and Path(resume).expanduser().exists() and not Path(resume).expanduser().is_dir():
        raise BenchError(f"resume: '{resume}' is a file; resume takes the folder of an earlier run or sweep.")


def _with_key(key: str, check_file, *args) -> None:
    try:
        check_file(*args)
    except BenchError as err:
        raise BenchError(f"{key}: {err}") from None
