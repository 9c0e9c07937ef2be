"""Checks of a composed config, run before any model loads: one sentence per problem, naming the value."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from bench.errors import BenchError
from bench.registry import get_method



def validate(cfg: DictConfig) -> None:
    """Raise :class:`BenchError` on the first invalid setting."""
    if int(cfg.max_new_tokens) < 1:
        raise BenchError(f"max_new_tokens must be at least 1, got {cfg.max_new_tokens}.")
    if float(cfg.temperature) < 0:
        raise BenchError(f"temperature must be >= 0 (0 means greedy), got {cfg.temperature}.")
    if not 0 < float(cfg.top_p) <= 1:
        raise BenchError(f"top_p must be in (0, 1], got {cfg.top_p}.")
    if cfg.dataset.get("n_prompts") is not None and int(cfg.dataset.n_prompts) < 1:
        raise BenchError(f"dataset.n_prompts must be at least 1 (or null for all), got {cfg.dataset.n_prompts}.")
    for key in ("path",):
        value = cfg.dataset.get(key)
        if value and "://" not in str(value) and not Path(str(value)).expanduser().exists():
            raise BenchError(f"dataset.{key} '{value}' does not exist.")
    for spec in [cfg.pair.target, *(cfg.pair.get("drafts") or [])]:
        ident = str(spec.get("id") or "")
        if spec.source == "hub" and ident.startswith(("/", ".", "~")) and not Path(ident).expanduser().exists():
            raise BenchError(f"model path '{ident}' does not exist.")
    get_method(cfg.method.name).check(cfg.method)  # a method's own constraints, still before any model loads
    if cfg.get("baseline"):
        get_method(cfg.baseline)
