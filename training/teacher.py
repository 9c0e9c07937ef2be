"""The teacher: what every trainer of a run reads -- the run's recipe (``training/recipes.py``) and the target's
stores under it (``training/store.py``: shards of labels; ``training/kv_store.py``: keys and values beside them),
built or grown on first use and shared. The target's passes that make the labels are in ``training/labelling.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from core.artifacts import load_or_build
from training.kv_store import KVStore, kv_artifact, kv_layer
from training.recipes import RecipeSettings
from training.store import TeacherStore, load_or_grow_store


@dataclass
class Teacher:
    """What every trainer of a run reads: the run's recipe and the target's stores under it (train and held-out),
    built or grown on first use and shared, so a run that trains a draft and heads labels its text once."""

    recipe: RecipeSettings
    cache: Path
    build_if_missing: bool = True
    stores: dict = field(default_factory=dict, repr=False)
    kvs: dict = field(default_factory=dict, repr=False)

    def store(self, target, tokenizer, split: str = "train") -> TeacherStore:
        """The ``train`` store (``recipe.tokens``) or the held-out ``test`` store (``recipe.eval_tokens``)."""
        if split not in self.stores:
            tokens = self.recipe.tokens if split == "train" else self.recipe.eval_tokens
            self.stores[split] = load_or_grow_store(target, tokenizer, self.recipe.store, self.cache, tokens, split,
                                                    self.build_if_missing)
        return self.stores[split]

    def kv_store(self, target, tokenizer, split: str = "train", layer: int = -1) -> KVStore:
        """The target's keys and values of decoder ``layer`` (-1: the last) over the ``split`` store, built per
        shard on first use (a progress bar) and kept beside it; rows align with :meth:`store`'s."""
        layer = kv_layer(target.config, layer)  # a bad layer is said before anything is labelled
        if (split, layer) not in self.kvs:
            store = self.store(target, tokenizer, split)
            arts = [kv_artifact(target, store, j, layer) for j in range(len(store.shards))]
            with torch.inference_mode():
                shards = [load_or_build(a, self.cache, self.build_if_missing)
                          for a in tqdm(arts, desc=f"teacher keys and values, layer {layer} ({split})", unit="shard")]
            self.kvs[(split, layer)] = KVStore(store, layer, shards)
        return self.kvs[(split, layer)]
