"""The trainer kit: what every trained part (the distilled draft, Medusa / Hydra / Amphista heads, EAGLE's and
GliDe's drafts, SPACE's mask embeddings, the SPRINTER verifier) is trained, measured, reported and cached with.

A trainer is: :func:`training_start` (the recipe's seed, then the frozen target in fp32 and its device), its stores
(:func:`feature_stores`, :func:`store_data`; :func:`check_store_keeps_hidden` before any model loads), a reduced
drafting vocabulary (:func:`store_vocab`, :func:`pick_vocab`, :func:`sub_index`; :func:`vocab_coverage` reports
it), then :func:`fit_and_measure`: held-out :func:`agreement` before (over every held-out row, and over
:func:`answer_rows`, the target's own answers), :func:`training.loop.fit` for the part's own epochs
(:func:`part_epochs`), agreement after, one report shape. Its result is one cached artifact (:func:`part_artifact`,
keyed with :func:`part_key` and :func:`budget`), which a method reads with :func:`load_or_train`. On a synthetic
pair nothing is trained: :func:`untrained_if_synthetic` gives the part untrained."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import torch

from core.artifacts import Artifact, load_or_build, model_fingerprint, recipe_key, report_of
from core.errors import BenchError
from core.metrics import ratio
from training.loop import TrainRecipe, fit
from training.teacher import Teacher

# Every trained part's recipe class by the part's name (``draft``, ``heads``, ...): ``@trained_part("name")``.
PARTS: dict[str, type[TrainRecipe]] = {}


def trained_part(name: str):
    """Class decorator naming a trained part's recipe class (a :class:`TrainRecipe` that declares its ``EPOCHS``)."""

    def wrap(cls: type[TrainRecipe]) -> type[TrainRecipe]:
        if name in PARTS and PARTS[name] is not cls:
            raise ValueError(f"trained part '{name}' is declared twice ({PARTS[name].__module__}, {cls.__module__})")
        PARTS[name] = cls
        return cls

    return wrap


def part_epochs(name: str, recipe, teacher: Teacher) -> int:
    """Passes part ``name`` makes with ``recipe`` (its settings) under the run's recipe."""
    return PARTS[name].epochs_for(recipe, teacher.recipe.name)


def budget(teacher: Teacher, epochs: int) -> dict:
    """What a trained part depends on in the run's recipe: the store's contents, how many of its tokens are read
    and for how many passes (not the recipe's name, nor the held-out size, which changes only the report)."""
    return {"store": teacher.recipe.store.key(), "tokens": teacher.recipe.tokens, "epochs": epochs}


def part_key(recipe, **added) -> dict:
    """A part's recipe as its artifact key holds it (:func:`core.artifacts.recipe_key`), without ``epochs``: the
    passes enter once, resolved, through :func:`budget`."""
    return {k: v for k, v in recipe_key(recipe, **added).items() if k != "epochs"}


def fp32_eval(target):
    """The frozen target to train from, in fp32 (a copy when it is not, so the pair's target is unchanged)."""
    if next(target.parameters()).dtype != torch.float32:
        target = copy.deepcopy(target).float()
    return target.eval()


def training_start(target, seed: int) -> tuple[torch.nn.Module, torch.device]:
    """The first lines of every trainer: ``(target, device)``, the frozen target in fp32 (:func:`fp32_eval`: a copy
    only when it is not fp32 already) and the device its weights are on, where the part trains.

    The global RNG is seeded with ``seed`` (the part's ``recipe.seed``) first, before anything else of the trainer
    draws (the part's initialisation, the batches' order, noise, cut points): a part retrained from the same store
    and recipe is the same part, and its cache key (which holds the seed) says which one it is."""
    torch.manual_seed(seed)
    target = fp32_eval(target)
    return target, next(target.parameters()).device


def answer_rows(store) -> list[int]:
    """The rows of a teacher store (a trainer's held-out split) that hold the target's own answers rather than
    packaged text, in order: :func:`agreement`'s ``answer_rows``, the text greedy decoding actually drafts in."""
    return [i for i in range(len(store)) if store.kind(i) == "answers"]


def vocab_coverage(to_sub: torch.Tensor, labels: dict[str, torch.Tensor]) -> float:
    """The share of labelled positions whose target top-1 token is in the reduced drafting vocabulary, rounded to 4
    places: what bounds the part's agreement, since it never proposes a token outside that vocabulary (NaN when
    nothing is labelled).

    ``to_sub``: ``LongTensor (vocab_size,)`` from :func:`sub_index`, on any device; ``labels``: a store's ``idx``
    ``LongTensor (N, T, k)`` and ``mask`` ``BoolTensor (N, T)``, on the host (as :func:`store_data` reads them)."""
    top1 = labels["idx"][..., 0][labels["mask"]]
    return round(float((to_sub.cpu()[top1] >= 0).float().mean()), 4)


def check_store_keeps_hidden(method: str, recipe) -> None:
    """A method whose trained part reads the target's stored hidden states needs a store that keeps them: said
    before any model loads (``check_recipe``)."""
    if not recipe.store.hidden:
        raise BenchError(f"method={method} reads the target's hidden states, which recipe.store.hidden=false does "
                         "not keep.")


def feature_stores(target, tokenizer, teacher: Teacher, who: str):
    """The run's train and held-out teacher stores for a trainer that reads the stored hidden states (heads,
    EAGLE's draft layer); ``who`` starts the sentence that says so when the store keeps none."""
    if not teacher.recipe.store.hidden:
        raise BenchError(f"{who} the target's hidden states, which this store does not keep; set "
                         "recipe.store.hidden=true.")
    return teacher.store(target, tokenizer, "train"), teacher.store(target, tokenizer, "test")


@torch.no_grad()
def agreement(judge: Callable[[torch.Tensor], list[tuple]], rows: Iterable[int], batch_size: int,
              answer_rows: Iterable[int] = ()) -> dict[str, list[float]]:
    """Held-out top-1 agreement of a trained part with the target, per output (one for a draft, K for K heads):
    hits / positions counted, NaN where none are (:func:`core.metrics.ratio`), rounded to 4 places.

    ``judge(part)`` reads the store rows ``part`` (``LongTensor (b,)``) and returns, per output, three tensors
    whose first dimension is those rows: ``hit`` (the part's greedy token is the target's), ``counted`` (the
    position counts) and ``on_answer`` (it counts and its label is the target's own answer token), all bool.
    Returns ``all`` (every counted position), ``answer_rows`` (those of ``answer_rows``, the target's own
    answers) and ``answer_tokens`` (positions labelled by an answer token: what a greedy decode's α follows)."""
    answer = set(int(r) for r in answer_rows)
    sums: list[dict[str, list[int]]] = []
    for chunk in torch.as_tensor(list(rows), dtype=torch.long).split(batch_size):
        on_row = torch.tensor([int(r) in answer for r in chunk], dtype=torch.bool)
        for k, (hit, counted, on_answer) in enumerate(judge(chunk)):
            if k == len(sums):
                sums.append({"all": [0, 0], "answer_rows": [0, 0], "answer_tokens": [0, 0]})
            on_row_here = on_row.to(counted.device).view(-1, *([1] * (counted.dim() - 1)))
            for view, where in (("all", counted), ("answer_rows", counted & on_row_here), ("answer_tokens", on_answer)):
                sums[k][view][0] += int((hit & where).sum())
                sums[k][view][1] += int(where.sum())
    views = ("all", "answer_rows", "answer_tokens")
    return {view: [round(ratio(*s[view]), 4) for s in sums] for view in views}


def fit_and_measure(modules: list[torch.nn.Module], step: Callable[[torch.Tensor], torch.Tensor], *, examples: int,
                    judge: Callable[[], Callable[[torch.Tensor], list[tuple]]], held: int, answer_rows: Iterable[int],
                    epochs: int, batch_size: int, lr: float, desc: str, params: list | None = None, **fit_args) -> dict:
    """The middle of every trainer: held-out :func:`agreement` over the ``held`` rows before,
    :func:`training.loop.fit` over ``examples`` rows in shuffled batches of ``batch_size`` (``step(rows) -> loss``)
    for ``epochs`` passes, agreement after; returns the report's common part. ``judge()`` makes a fresh judge for
    each measurement (one may hold state: SPACE's seeded cuts). A figure is a number for a part of one output, a
    list (per head, per mask) for several. ``params``: what trains (default: every parameter of ``modules`` that
    takes a gradient)."""
    answer_rows = list(answer_rows)
    before = agreement(judge(), range(held), batch_size, answer_rows)
    single = len(before["all"]) == 1

    def figure(values: list[float]):
        return values[0] if single else values

    params = params if params is not None else [p for m in modules for p in m.parameters() if p.requires_grad]
    for m in modules:
        m.train()
    loss = fit(params, lambda: torch.randperm(examples).split(batch_size), step, epochs=epochs,
               steps_per_epoch=-(-examples // batch_size), lr=lr, desc=desc, **fit_args)
    for m in modules:
        m.eval()
    after = agreement(judge(), range(held), batch_size, answer_rows)
    return {
        # Held-out: P(the part's greedy token == the target's), on every position, before and after training.
        "agreement_before": figure(before["all"]),
        "agreement_after": figure(after["all"]),
        # After, on the target's own held-out answer rows, and on the answer's tokens alone.
        "answer_agreement": figure(after["answer_rows"]),
        "answer_token_agreement": figure(after["answer_tokens"]),
        "epochs": epochs,
        "final_loss": round(loss, 4),
    }


def part_artifact(kind: str, name: str, key: dict, train: Callable[[], tuple], save: Callable[[object], dict],
                  load: Callable[[dict], object], file: str, trained_by: str, description: str,
                  same: tuple[str, ...] = ()) -> Artifact:
    """A trained part as one cached artifact (``cache_dir/<kind>/<name>-<key>/<file>``): ``train() -> (part,
    report)`` builds it, ``save(part)`` is what ``file`` holds, ``load(blob)`` rebuilds the part from it and
    raises ``ValueError`` where the blob does not fit (the artifact is then rebuilt, or refused in one sentence).
    The file is read with ``weights_only``: one that would run code is refused, never executed."""

    def build(folder: Path) -> dict:
        made, report = train()
        torch.save(save(made), folder / file)
        return report

    def read(folder: Path):
        return load(torch.load(folder / file, map_location="cpu", weights_only=True))

    return Artifact(kind, name, key, build, read, trained_by=trained_by, same=same, description=description)


def load_or_train(art: Artifact, cache: Path, train_if_missing: bool = True) -> tuple[object, dict]:
    """``(part, report)``: the trained part of the cached artifact ``art`` (:func:`part_artifact`,
    :func:`module_artifact`) under ``cache`` (the run's cache folder), trained first when it is missing or broken and
    ``train_if_missing`` (else one sentence naming what trains it: :func:`core.artifacts.load_or_build`), and the
    report its training left in the artifact's manifest: a part loaded from the cache reports what was measured
    when it was trained. The part is as ``art``'s ``load`` rebuilds it (on the host, in fp32)."""
    return load_or_build(art, cache, train_if_missing), report_of(art, cache)


def module_artifact(kind: str, target, key: dict, train, new, trained_by: str, description: str) -> Artifact:
    """A draft module trained from the target (EAGLE's, GliDe's) as a cached artifact ``<kind>.pt`` holding its
    hidden size, depth and weights. ``key``: what it depends on besides the target's weights; ``train() ->
    (module, report)`` builds it; ``new(vocab_map, layers)`` makes an untrained one to load the weights into."""
    ident = model_fingerprint(target)

    def save(draft) -> dict:
        return {"hidden": target.config.hidden_size, "layers": draft.config.num_hidden_layers, "state": draft.state_dict()}

    def load(blob: dict):
        if blob["hidden"] != target.config.hidden_size:
            raise ValueError(f"its hidden size is {blob['hidden']}, the target's {target.config.hidden_size}")
        draft = new(blob["state"]["vocab_map"], blob.get("layers", 1))
        draft.load_state_dict(blob["state"])
        return draft.eval()

    return part_artifact(kind, f"{kind}-{ident['name']}", {"target": ident, **key}, train, save, load, f"{kind}.pt",
                         trained_by, description)


def store_data(store, fields=("ids", "idx", "prob", "mask")) -> dict[str, torch.Tensor]:
    """Every sequence a trainer reads from ``store``, as tensors (no hidden states: those stay on disk)."""
    return store.rows(range(len(store)), fields)


def store_vocab(tokenizer, data: dict, size: int, vocab_size: int) -> torch.Tensor:
    """:func:`pick_vocab` over the labelled positions of a store's ``ids`` / ``idx`` / ``mask``."""
    m = data["mask"]
    return pick_vocab(tokenizer, data["ids"][m], data["idx"][..., 0][m], min(size, vocab_size))


def pick_vocab(tokenizer, chunks: torch.Tensor, top1: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` tokens the target predicts or reads most often, plus every special token (EOS first)."""
    counts = Counter(top1.flatten().tolist())
    counts.update(chunks.flatten().tolist())
    # Chat markup and specials must be proposable: instruct answers start and end with them.
    specials = set(tokenizer.all_special_ids) | {tokenizer.eos_token_id}
    chosen = list(dict.fromkeys([*sorted(specials), *(t for t, _ in counts.most_common())]))[:size]
    if len(chosen) < size:  # a tiny corpus: pad with the lowest ids not yet chosen
        rest = (t for t in range(len(tokenizer)) if t not in set(chosen))
        chosen += [next(rest) for _ in range(size - len(chosen))]
    return torch.tensor(sorted(chosen))


def sub_index(vocab_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``LongTensor (vocab_size,)``: a token's row in the reduced vocabulary ``vocab_map``, -1 outside it."""
    to_sub = torch.full((vocab_size,), -1, dtype=torch.long, device=vocab_map.device)
    to_sub[vocab_map] = torch.arange(vocab_map.numel(), device=vocab_map.device)
    return to_sub


def untrained_vocab(size: int, vocab_size: int) -> torch.Tensor:
    """An untrained part's reduced drafting vocabulary: the lowest ``min(size, vocab_size)`` ids (which ids they are
    changes no cost, and on a synthetic pair no acceptance)."""
    return torch.arange(min(size, vocab_size))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def untrained_if_synthetic(pair, untrained: Callable[[], object], trained: Callable[[], tuple]) -> tuple[object, dict]:
    """A method's trained part and its report: ``trained()`` (cached, trained when missing), or on a synthetic pair
    (random weights of a real shape, a set acceptance: nothing to learn from, docs/synthetic.md) ``untrained()``,
    a fresh part of the shape the trained one has, made from the target's config in the pair's dtype, seeded with
    the target's seed: never trained, cached or keyed by the target's weights (no teacher store, no hashing of an
    8B model), so its forwards cost what a trained part's cost and the acceptance is the pair's. Made on the host,
    as a loaded part is: the method moves it to the device (a part is small next to the target). Its report is
    ``{"untrained": True}``."""
    if not pair.synthetic:
        return trained()
    torch.manual_seed(int(pair.spec.target.get("seed") or 0))
    with _default_dtype(pair.dtype):
        part = untrained()
    return part, {"untrained": True}
