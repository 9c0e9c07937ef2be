"""SWIFT's parts (Xia et al. 2025, "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference
Acceleration", ICLR): the skip set, the target run without it, and the search that picks it.

- :class:`SkipSet`: which attention and which MLP sub-layers the draft skips. The first and the last layer are
  always kept, as in the paper; a search skips ``max(1, int(2 (L - 2) * skip_ratio))`` of the ``2 (L - 2)``
  sub-layers between them.
- :class:`SkippingLM`: the target's own weights run with a skip set (:func:`core.model_parts.skipping`), counted
  in a role of its own whose FLOPs are those of the sub-layers it runs. Its KV entries go into the target's
  cache, only for the attention layers it runs, and are cropped before the target verifies.
- :class:`SkipSearch`: the paper's optimisation stage. Each iteration proposes a candidate set (random search;
  every ``bayes_interval``-th a Bayesian-optimisation suggestion: a Gaussian process over the 2 (L - 2)
  sub-layers with an upper-confidence-bound acquisition, ``bayes_opt`` as the authors use it, the candidate
  being the suggestion's top coordinates), scores it by :func:`matchness` and keeps it when it beats the best
  so far. It stops at ``target_score``, after ``patience`` iterations without a gain, or after ``max_iters``.
- :func:`load_or_build_skip_set`: the search run once, before any timing, over the target's own answers to
  packaged instructions (the paper's cached configuration, ``--cache-hit``), through the artifact cache; each
  candidate is scored on every calibration window (the paper scores one, the current prompt's).

Read to understand: the authors' code (``github:hemingkx/SWIFT``, ``model/swift/utils.py``); nothing copied.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.clock import clocked
from core.counting import CountedLM
from core.errors import BenchError
from core.kv_cache import lm_forward
from core.model_parts import decoder_layers, skipping, sublayers
from core.static_cache import RowCache, RowView
from decoding.cache import truncate_cache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SkipSet:
    """Layer indices (0-based) whose attention (``attn``) and whose MLP (``mlp``) the draft skips."""

    attn: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.attn) + len(self.mlp)

    @classmethod
    def alternating(cls, n_layers: int) -> SkipSet:
        """The paper's starting point: both sub-layers of every other layer from the second on (1, 3, 5, ...,
        never the last): about half of the target."""
        every_other = tuple(range(1, n_layers - 1, 2))
        return cls(every_other, every_other)

    @classmethod
    def from_coordinates(cls, chosen, n_layers: int) -> SkipSet:
        """The set of search coordinates ``chosen``: coordinate i < L - 2 is layer i + 1's attention, coordinate
        L - 2 + i layer i + 1's MLP (the paper's numbering)."""
        middle = n_layers - 2
        chosen = sorted(int(c) for c in chosen)
        return cls(tuple(c + 1 for c in chosen if c < middle), tuple(c - middle + 1 for c in chosen if c >= middle))

    def check(self, n_layers: int, what: str = "the skip set") -> None:
        """One sentence when this set cannot be a SWIFT draft of an ``n_layers``-layer target."""
        for kind, ids in (("attention", self.attn), ("MLP", self.mlp)):
            bad = [i for i in ids if not 1 <= i <= n_layers - 2]
            if bad:
                raise BenchError(f"{what} skips the {kind} of layer(s) {bad}, but only layers 1..{n_layers - 2} of "
                                 f"this {n_layers}-layer target may be skipped (the first and the last are always "
                                 "kept).")
        if not self.size:
            raise BenchError(f"{what} skips nothing: its draft would be the target itself.")

    def as_dict(self) -> dict:
        return {"attn": list(self.attn), "mlp": list(self.mlp)}


class SkippingLM(CountedLM):
    """The target's module run without the sub-layers of :attr:`skip`, counted as ``role``.

    ``lm(input_ids (1, n), cache, **kw)`` as a :class:`~core.counting.CountedLM`; ``use(skip)`` switches the
    set (and the FLOPs formula with it). On a compiled target's static cache it runs the compiled model's code
    uncompiled (its graphs hold every sub-layer), counted as ``uncompiled_calls``."""

    def __init__(self, target: CountedLM, role: str):
        self.target = target
        super().__init__(target.module, role)
        self.full = self.formula
        self.skip = SkipSet()

    @property
    def compiled(self):
        """The target's compiled forwards and static cache (set on the target when the run compiles it, or batches):
        this model runs their code, uncompiled, on the target's cache."""
        return self.target.compiled

    @compiled.setter
    def compiled(self, value) -> None:
        if value is not None and value is not self.target.compiled:
            raise ValueError(f"the {self.role} runs its target's compiled forwards only")

    def use(self, skip: SkipSet) -> None:
        self.skip = skip
        self.formula = self.full.without(sublayers(self.module, list(skip.attn), list(skip.mlp)), len(skip.attn))

    def __call__(self, input_ids: torch.Tensor, cache, **kwargs):
        eager = self.compiled.eagerly() if self.compiled is not None else contextlib.nullcontext()
        with eager, skipping(self.module, list(self.skip.attn), list(self.skip.mlp)):
            return super().__call__(input_ids, cache, **kwargs)

    def forward_rows(self, rows: list[dict | None]):
        """ONE forward of the drafting rows of a batch on the target's batch cache (``CountedLM.forward_rows``), run
        uncompiled without the skipped sub-layers."""
        with self.compiled.eagerly(), skipping(self.module, list(self.skip.attn), list(self.skip.mlp)):
            return super().forward_rows(rows)


def matchness(lm: SkippingLM, cache, window: list[int]) -> float:
    """The paper's score of a skip set: the share of ``window[1:]`` (the target's own tokens) that ``lm``
    predicts greedily from ``window[:-1]``, teacher-forced in ONE forward after ``cache`` (the prompt's KV,
    left as it was)."""
    past = cache.get_seq_length()
    ids = torch.tensor([window[:-1]], device=lm.device)
    predicted = lm(ids, cache).logits[0].argmax(-1)
    truncate_cache(cache, past)
    return float((predicted == torch.tensor(window[1:], device=predicted.device)).float().mean())


def prompt_cache(cache, prompt_len: int):
    """A copy of ``cache`` holding the prompt's positions only: what the search's forwards extend and crop (a
    ``DynamicCache`` of a compiled target's static cache: the search's forwards run eagerly, beside the compiled
    ones)."""
    if isinstance(cache, (RowCache, RowView)):
        return cache.prefix(prompt_len)
    out = copy.deepcopy(cache)
    truncate_cache(out, prompt_len)
    return out


class SkipSearch:
    """The paper's layer-set optimisation, one :meth:`step` at a time (settings: ``method.*`` of swift)."""

    def __init__(self, n_layers: int, settings, start: SkipSet):
        from bayes_opt import BayesianOptimization, acquisition

        self.n_layers, self.settings = n_layers, settings
        self.coords = 2 * (n_layers - 2)
        self.k = max(1, int(self.coords * settings.skip_ratio))  # sub-layers a candidate skips
        self.best, self.best_score = start, 0.0  # the paper starts from a score of 0: the first candidate is kept
        self.iters = self.stale = 0
        self.stopped = ""  # why the search stopped ("" while it runs)
        self.seconds = 0.0  # under the harness clock, every step included
        self.rng = np.random.default_rng(settings.seed)
        self.bo = BayesianOptimization(
            f=None, pbounds={f"x{i}": (0.0, 1.0) for i in range(self.coords)}, verbose=0,
            acquisition_function=acquisition.UpperConfidenceBound(kappa=2.5), random_state=settings.seed)
        self.bo.set_gp_params(alpha=1e-2)
        self.probed: set[tuple] = set()  # points already registered: the optimiser takes each once

    @property
    def done(self) -> bool:
        return bool(self.stopped)

    def candidate(self) -> tuple[dict, SkipSet]:
        """``(point, set)``: the search-space point to register its score at, and the skip set it stands for."""
        every = self.settings.bayes_interval
        if every and (self.iters + 1) % every == 0:
            point = self.bo.suggest()  # continuous in [0, 1]^coords: the top-k coordinates are skipped
            chosen = sorted(range(self.coords), key=lambda i: -float(point[f"x{i}"]))[: self.k]
        else:
            chosen = self.rng.choice(self.coords, self.k, replace=False)
            point = {f"x{i}": float(i in set(chosen.tolist())) for i in range(self.coords)}
        return point, SkipSet.from_coordinates(chosen, self.n_layers)

    def step(self, score, device: torch.device) -> bool:
        """One iteration: ``score(skip_set) -> float`` rates a candidate. Returns whether the best set changed."""

        def iteration() -> bool:
            point, cand = self.candidate()
            value = score(cand)
            if (seen := tuple(round(point[f"x{i}"], 6) for i in range(self.coords))) not in self.probed:
                self.probed.add(seen)  # a repeat (random search draws one now and then) would only add noise
                self.bo.register(params=point, target=value)
            self.iters += 1
            better = value > self.best_score
            if better:
                self.best, self.best_score, self.stale = cand, value, 0
            else:
                self.stale += 1
            s = self.settings
            if better and value > s.target_score:
                self.stopped = f"score {value:.3f} above target_score {s.target_score}"
            elif self.stale > s.patience:
                self.stopped = f"{self.stale} iterations without a better set (patience {s.patience})"
            elif self.iters >= s.max_iters:
                self.stopped = f"max_iters ({s.max_iters}) reached"
            return better

        better, seconds = clocked(device, iteration)
        self.seconds += seconds
        return better

    def report(self) -> dict:
        return {**self.best.as_dict(), "score": self.best_score, "iterations": self.iters,
                "search_s": self.seconds, "stopped": self.stopped or "still searching"}


def n_layers_of(target: CountedLM) -> int:
    """The target's decoder layers; one sentence when there is nothing between the first and the last."""
    n = len(decoder_layers(target.module))
    if n < 3:
        raise BenchError(f"method=swift skips layers between the target's first and last, and this target has {n} "
                         "layer(s).")
    return n


def load_or_build_skip_set(pair, settings, n_layers: int, build_if_missing: bool) -> tuple[SkipSet, dict]:
    """The search run to its end over the target's greedy answers to ``settings.calibration`` packaged
    instructions (a window of ``context_window + 1`` answer tokens each; a candidate's score is its mean
    matchness over all of them), cached under
    ``cache/swift/`` keyed by the target's weights and the search's settings. Returns the set and the search's
    report (score, iterations, seconds under the harness clock, why it stopped)."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from core.artifacts import Artifact, load_or_build, model_fingerprint
    from core.corpus import instruction_prompts
    from training.labelling import target_answers

    target = pair.target
    keys = ("skip_ratio", "context_window", "bayes_interval", "max_iters", "patience", "target_score", "calibration",
            "seed")

    def build(folder: Path) -> dict:
        window = settings.context_window + 1
        prompts = instruction_prompts(settings.calibration, settings.seed, split="train")
        cases = []
        with torch.inference_mode():
            for prompt, answer, _, _ in target_answers(target.module, pair.tokenizer, prompts, 8, window,
                                                       "swift: target answers"):
                if answer.numel() >= 2:
                    cache = DynamicCache()
                    lm_forward(target.module, prompt[None].to(target.device), cache, logits_to_keep=1)
                    cases.append((cache, answer.tolist()))
            if not cases:
                raise BenchError("the target answered every swift calibration prompt with at most one token.")
            search, lm = SkipSearch(n_layers, settings, SkipSet.alternating(n_layers)), SkippingLM(target, "search")

            def score(cand: SkipSet) -> float:
                # Every window, not the paper's one window per decoding step: candidates are then compared on the
                # same text, and the kept set is not the one that met the easiest window.
                lm.use(cand)
                return sum(matchness(lm, cache, answer) for cache, answer in cases) / len(cases)

            with tqdm(total=settings.max_iters, desc="swift: skip-set search", unit="it") as bar:
                while not search.done:
                    search.step(score, target.device)
                    bar.update(1)
                    bar.set_postfix(score=f"{search.best_score:.3f}", skipped=search.best.size)
        report = {**search.report(), "windows": len(cases)}
        (folder / "skip_set.json").write_text(json.dumps(report, indent=1))
        log.info("swift: skip set %s, matchness %.3f after %d iterations (%.0f s; %s)", search.best.as_dict(),
                 search.best_score, search.iters, search.seconds, search.stopped)
        return report

    def load(folder: Path) -> tuple[SkipSet, dict]:
        report = json.loads((folder / "skip_set.json").read_text())
        skip = SkipSet(tuple(report["attn"]), tuple(report["mlp"]))
        skip.check(n_layers, "the cached swift skip set")
        return skip, report

    key = {"target": model_fingerprint(target.module), "search": {k: getattr(settings, k) for k in keys}}
    art = Artifact("swift", "skip-set", key, build, load, version=2, description="swift skip set",
                   otherwise="method.search=online")
    return load_or_build(art, pair.cache, build_if_missing)
