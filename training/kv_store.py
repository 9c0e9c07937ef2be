"""The target's keys and values of one decoder layer over a teacher store's sequences, kept beside the store shard
by shard (GliDe's draft cross-attends to them): ``k`` and ``v`` ``(S, n_kv_heads, L, head_dim) float16`` per
shard (keys after rotary, as the target caches them while decoding), each shard's one artifact keyed by that
shard's own key, its ids and the layer, so the store's keys never change."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.artifacts import Artifact
from core.errors import BenchError
from training.labelling import target_kv
from training.store import TeacherStore


def kv_layer(config, layer: int, key: str = "layer") -> int:
    """``layer`` as an index into the target's decoder layers (negative: from the last, -1 the last one); ``key``
    names the setting in the sentence that refuses one that is not a layer."""
    n = config.num_hidden_layers
    if not -n <= layer < n:
        raise BenchError(f"{key}={layer} is not one of the target's {n} decoder layers (0 .. {n - 1}, or -1 .. -{n} "
                         "counted from the last).")
    return layer % n

@dataclass
class KVStore:
    """The target's keys and values of decoder ``layer`` over the sequences of ``store``, shard by shard,
    memory-mapped: ``shards[i]["k"]`` and ``["v"]`` are ``(S, n_kv_heads, L, head_dim) float16`` arrays."""

    store: TeacherStore
    layer: int
    shards: list[dict[str, np.ndarray]]

    def __len__(self) -> int:
        return len(self.store)

    def rows(self, index) -> dict[str, torch.Tensor]:
        """Sequences ``index`` (as :meth:`TeacherStore.rows` takes them, aligned with it): ``k`` and ``v``,
        ``FloatTensor (B, n_kv_heads, L, head_dim)``; only those rows are read from disk."""
        out: dict[str, list] = {"k": [], "v": []}
        for i in index:
            if not 0 <= int(i) < len(self):
                raise IndexError(f"sequence {int(i)} of a store of {len(self)}")
            shard, row = self.shards[int(i) // self.store.per_shard], int(i) % self.store.per_shard
            for name in out:
                out[name].append(np.asarray(shard[name][row]))
        return {name: torch.from_numpy(np.stack(v)).float() for name, v in out.items()}


def kv_artifact(target, store: TeacherStore, j: int, layer: int) -> Artifact:
    """The target's keys and values of ``layer`` over shard ``j`` of ``store`` (its stored ids, teacher-forced
    again: the answers are not regenerated), as an artifact beside the store, keyed by the shard's key and the
    ids themselves (a shard rebuilt under the same key, say by a new version of the store or answers generated
    elsewhere, never meets keys and values of other ids)."""

    def build(folder: Path) -> dict:
        ids = torch.from_numpy(np.array(store.shards[j]["ids"])).long()  # a copy: the shard is read-only
        start = time.perf_counter()
        k, v = target_kv(target, ids, layer, store.settings.batch_size, f"store: target keys and values (shard {j})")
        np.save(folder / "k.npy", k.half().numpy())
        np.save(folder / "v.npy", v.half().numpy())
        seconds = time.perf_counter() - start
        return {"layer": layer, "tokens": ids.numel(), "seconds": round(seconds, 3),
                "tokens_per_s": round(ids.numel() / max(seconds, 1e-9), 1)}

    def load(folder: Path) -> dict[str, np.ndarray]:
        return {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("k", "v")}

    ids = hashlib.sha256(np.ascontiguousarray(store.shards[j]["ids"]).tobytes()).hexdigest()[:16]
    return Artifact("teacher", f"{store.folder.name}-kv/layer{layer}-{j:05d}",
                    {"shard": store.keys[j], "ids": ids, "layer": layer},
                    build, load, description=f"target keys and values of layer {layer}, teacher store shard {j}",
                    trained_by="method")
