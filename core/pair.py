"""The models of one run, as every method sees them: target, drafts, tokenizer and the roles they are counted
under. Loading them is the harness's job (``bench.models.load_pair``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from core.counting import Counted, CountedLM
from core.errors import BenchError


@dataclass
class Pair:
    """The models of one run: the target, its drafts (ordered, largest first) and the tokenizer.

    Methods add roles of their own (heads, verifier) with :meth:`add`; the harness resets and reads every
    role's counts around each prompt.
    """

    name: str
    tokenizer: object
    target: CountedLM
    drafts: list[CountedLM]
    device: torch.device
    dtype: torch.dtype
    cache: Path
    spec: DictConfig
    # The run's training.teacher.Teacher (its training recipe and the target's teacher stores), which every trainer
    # reads; set by the harness. Typed loosely: the foundation does not import the training layer above it.
    teacher: Any = None
    roles: dict[str, Counted] = field(default_factory=dict)
    # Per role, the one-row CPU kernel chosen when the pair loaded and its timings (core.kernels); empty: not packed.
    kernels: dict[str, dict | None] = field(default_factory=dict)
    # Per role, the model's attention implementation (``sdpa_gqa``: core.gqa_attention's, for GQA models on the CPU).
    attention: dict[str, str | None] = field(default_factory=dict)

    def __post_init__(self):
        self.roles["target"] = self.target
        for i, draft in enumerate(self.drafts):
            self.roles[draft.role] = draft

    @property
    def synthetic(self) -> bool:
        """Random weights of a real shape with a set acceptance (``pair=synthetic``): costs are real, outputs not."""
        return self.spec.get("acceptance") is not None

    @property
    def draft(self) -> CountedLM:
        if not self.drafts:
            raise BenchError(f"pair '{self.name}' has no draft model, which this method needs.")
        return self.drafts[0]

    def add(self, counted: Counted) -> Counted:
        self.roles[counted.role] = counted
        return counted

    def reset_counts(self) -> None:
        for c in self.roles.values():
            c.reset()

    def counts(self) -> dict[str, dict]:
        return {role: c.stats() for role, c in self.roles.items()}
