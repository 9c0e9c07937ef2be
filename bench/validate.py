"""The check of a composed config, run before any model loads or any training starts.

Each node is validated against its declaration (``bench/schema.py``: the top level; ``Method.Config``: the
method and the baseline; ``bench.models.PairSettings``: the pair; ``bench.data``: the dataset's source; ``decoding.teacher``: the
teacher store), then
the files the config names are read far enough to know they are usable. The first problem is one sentence
(:class:`bench.errors.BenchError`) naming the key, the value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bench import inputs
from bench.data import dataset_settings
from bench.errors import BenchError
from bench.models import HubModel, PairSettings
from bench.registry import get_method
from bench.schema import RunSettings, Settings, as_config, check
from decoding.teacher import StoreSettings

GROUPS = ("method", "pair", "dataset")  # the config groups (bench.cli reads them from here)
DEFAULT_MAX_NEW_TOKENS = 128  # when neither the command line nor the dataset sets a budget


def plain(cfg: DictConfig) -> dict:
    """The composed config as plain values, interpolations resolved (a failing one is one sentence)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise BenchError(f"config value {err.full_key or ''} cannot be resolved: {str(err).splitlines()[0]}.") from None


def checked(cfg: DictConfig) -> dict[str, Settings]:
    """Every node of ``cfg`` validated: ``{"": top level, "method": ..., "pair": ..., "dataset": ...}``, defaults
    filled in and ``max_new_tokens`` resolved; raises :class:`BenchError` on the first problem."""
    data = plain(cfg)
    nodes = {g: data.pop(g, None) or {} for g in GROUPS}
    store = check(StoreSettings, data.pop("store", None) or {}, "store")
    settings = check(RunSettings, data, "", "the top level")
    method_cls = get_method(nodes["method"].get("name"))
    method = method_cls.check_settings(nodes["method"])
    pair = check(PairSettings, nodes["pair"], "pair", f"pair={nodes['pair'].get('name')}")
    method_cls.check_pair(method, pair)
    dataset = dataset_settings(nodes["dataset"])
    if settings.baseline is not None:
        baseline = get_method(settings.baseline)  # an unknown name lists the known ones
        try:
            baseline.check_pair(baseline.check_settings({}), pair)
        except BenchError as err:
            raise BenchError(f"baseline={settings.baseline}: {err}") from None
    if settings.max_new_tokens is None:
        settings.max_new_tokens = dataset.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    return {"": settings, "method": method, "pair": pair, "dataset": dataset, "store": store}


def validate(cfg: DictConfig) -> DictConfig:
    """``cfg`` checked (:func:`checked`) and the files it names read far enough to be trusted: the config the
    run uses, or one sentence on the first problem."""
    nodes = checked(cfg)
    check_files(nodes["pair"], nodes["dataset"])
    check_resume(nodes[""].resume)
    out = as_config(nodes[""])
    for group in (*GROUPS, "store"):
        out[group] = as_config(nodes[group])
    return out


def check_files(pair: PairSettings, dataset) -> None:
    """The files a config names, read just far enough to trust them (``bench/inputs.py``): local model folders
    and the question file. The sentence is prefixed by the key that named the file."""
    named = [("pair.target.id" if i == 0 else f"pair.drafts.{i - 1}.id", spec)
             for i, spec in enumerate([pair.target, *pair.drafts])]
    for key, spec in named:
        if isinstance(spec, HubModel) and inputs.looks_local(spec.id):
            _with_key(key, inputs.check_model_folder, Path(spec.id).expanduser())
            if key == "pair.target.id":  # the pair's tokenizer is the target's
                _with_key(key, inputs.check_tokenizer_folder, Path(spec.id).expanduser())
    if dataset.source == "spec_bench" and "://" not in dataset.path:
        _with_key("dataset.path", inputs.read_question_file, dataset.path)


def check_resume(resume: str | None) -> None:
    """``resume=DIR`` names a folder (or one to create), never a file."""
    if resume and Path(resume).expanduser().exists() and not Path(resume).expanduser().is_dir():
        raise BenchError(f"resume: '{resume}' is a file; resume takes the folder of an earlier run or sweep.")


def _with_key(key: str, check_file, *args) -> None:
    try:
        check_file(*args)
    except BenchError as err:
        raise BenchError(f"{key}: {err}") from None
