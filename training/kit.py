"""The trainer kit: what every trained part (the distilled draft, Medusa / Hydra / Amphista heads, EAGLE's and
GliDe's drafts, SPACE's mask embeddings, the SPRINTER verifier) reads the teacher store and caches its result with.

- the frozen target in fp32 (:func:`fp32_eval`) and the stores it labelled (:func:`feature_stores`,
  :func:`store_data`), checked to keep what the trainer reads (:func:`check_store_keeps_hidden`);
- the reduced drafting vocabulary (:func:`pick_vocab`, :func:`store_vocab`, :func:`sub_index`);
- a trained draft module as one cached artifact (:func:`module_artifact`).

The loop itself is :func:`training.loop.fit`."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import torch

from core.artifacts import Artifact, model_fingerprint
from core.errors import BenchError
from training.teacher import Teacher


def fp32_eval(target):
    """The frozen target to train from, in fp32 (a copy when it is not, so the pair's target is unchanged)."""
    if next(target.parameters()).dtype != torch.float32:
        target = copy.deepcopy(target).float()
    return target.eval()


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


def module_artifact(kind: str, target, key: dict, train, new, hint: str, description: str) -> Artifact:
    """A draft module trained from the target (EAGLE's, GliDe's) as a cached artifact ``<kind>.pt`` holding its
    hidden size, depth and weights. ``key``: what it depends on besides the target's weights; ``train() ->
    (module, report)`` builds it; ``new(vocab_map, layers)`` makes an untrained one to load the weights into."""
    ident = model_fingerprint(target)

    def build(folder: Path) -> dict:
        draft, report = train()
        torch.save({"hidden": target.config.hidden_size, "layers": draft.config.num_hidden_layers,
                    "state": draft.state_dict()}, folder / f"{kind}.pt")
        return report

    def load(folder: Path):
        blob = torch.load(folder / f"{kind}.pt", map_location="cpu", weights_only=True)
        if blob["hidden"] != target.config.hidden_size:
            raise ValueError(f"its hidden size is {blob['hidden']}, the target's {target.config.hidden_size}")
        draft = new(blob["state"]["vocab_map"], blob.get("layers", 1))
        draft.load_state_dict(blob["state"])
        return draft.eval()

    return Artifact(kind, f"{kind}-{ident['name']}", {"target": ident, **key}, build, load, hint=hint,
                    description=description)


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
