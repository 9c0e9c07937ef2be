"""The teacher store: the target's labels, computed once per target and read by every trainer.

Labelling is the binding cost of every trained drafter on a CPU (the target runs at a few hundred
teacher-forced tokens per second), so it is done once and kept: token ids, the target's top-k next-token
probabilities at every position and, when asked, its last hidden states (what feature-level drafters and
heads read). Text comes from two sources, interleaved shard by shard:

- packaged text (:func:`decoding.corpus.corpus`), teacher-forced;
- the target's own greedy answers to packaged instructions (:func:`decoding.corpus.instruction_prompts`),
  generated in batches and then teacher-forced like text: on-policy text, the kind a draft meets while
  decoding.

The store is a sequence of shards, each ``shard_sequences`` rows of ``seq_len`` tokens, each one artifact of
``bench.artifacts`` (atomic, locked, checksummed) keyed by the target, the tokenizer, the store's settings and
the shard's index -- not by how many tokens are wanted. So a killed build keeps every finished shard and
resumes at the first missing one, and asking for more tokens appends shards and keeps what was labelled.
Arrays are ``.npy`` files read back memory-mapped: a trainer touches only the rows it samples.

Per shard (S sequences, L = seq_len, k = topk, H = hidden size):
``ids (S, L) int32``, ``mask (S, L) bool`` (False on padding), ``idx (S, L, k) int32`` and ``prob (S, L, k)
float16`` (the target's top-k at each position: ``idx[..., 0]`` is its greedy next token), ``hidden (S, L, H)
float16`` (only with ``hidden: true``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from tqdm.auto import tqdm

from bench.artifacts import (
    Artifact,
    content_key,
    load_or_build,
    model_fingerprint,
    report_of,
    tokenizer_fingerprint,
)
from bench.errors import BenchError
from bench.schema import Settings
from decoding.corpus import Corpus, corpus, instruction_prompts
from decoding.distill import target_answers, teacher_pass

log = logging.getLogger(__name__)

FILES = ("ids", "mask", "idx", "prob", "hidden")


class StoreSettings(Settings):
    """``store.*``: what the teacher store holds and how it is built (``python -m bench train store``)."""

    tokens: int = Field(65536, ge=1, description="labelled tokens wanted; the store grows to at least this many "
                        "(whole shards), keeping what is already labelled")
    corpus: Corpus = Field("lee+wiki", description="packaged text that is teacher-forced")
    answers: float = Field(0.25, ge=0, le=1, description="share of shards made of the target's own greedy "
                           "answers to packaged instructions (on-policy text)")
    answer_tokens: int = Field(128, ge=1, description="tokens per answer at most")
    answer_batch: int = Field(16, ge=1, description="answers generated per batch")
    seq_len: int = Field(256, ge=2, description="tokens per stored sequence")
    shard_sequences: int = Field(64, ge=1, description="sequences per shard: the unit that is built, kept after "
                                 "a kill and appended")
    topk: int = Field(32, ge=1, description="the target's top-k next-token probabilities kept per position")
    hidden: bool = Field(True, description="keep the target's last hidden states (float16)")
    batch_size: int = Field(8, ge=1, description="sequences per teacher-forced forward")
    split: Literal["train", "test"] = Field("train", description="which half of the packaged text and "
                                            "instructions (test: held out, for evaluation)")
    seed: int = Field(0, ge=0, description="which instructions are answered, in which order")


@dataclass
class TeacherStore:
    """The shards of one store, memory-mapped: ``shards[i][name]`` is an ``np.ndarray`` (see the module doc)."""

    settings: StoreSettings
    shards: list[dict[str, np.ndarray]]
    folder: Path
    reports: list[dict]  # each shard's build report: kind, tokens, seconds, tokens_per_s

    def report(self) -> dict:
        """What the store holds and what labelling cost, by kind of shard (``train store`` prints it)."""
        out = {"folder": str(self.folder), "shards": len(self.shards), "sequences": len(self), "tokens": self.tokens}
        for kind in ("text", "answers"):
            done = [r for r in self.reports if r.get("kind") == kind]
            tokens, seconds = sum(r["tokens"] for r in done), sum(r["seconds"] for r in done)
            out[kind] = {"shards": len(done), "tokens": tokens, "build_seconds": round(seconds, 1),
                         "tokens_per_s": round(tokens / seconds, 1) if seconds else None}
        return out

    def __len__(self) -> int:
        """Stored sequences."""
        return sum(len(s["ids"]) for s in self.shards)

    @property
    def tokens(self) -> int:
        """Labelled (non-padding) positions."""
        return int(sum(s["mask"].sum() for s in self.shards))

    def rows(self, index) -> dict[str, torch.Tensor]:
        """Sequences ``index`` (ints in ``[0, len)``) as tensors: ``ids``, ``idx`` LongTensor, ``prob``,
        ``hidden`` FloatTensor, ``mask`` BoolTensor; only those rows are read from disk."""
        per = self.settings.shard_sequences
        out: dict[str, list] = {}
        for i in index:
            shard, row = self.shards[int(i) // per], int(i) % per
            for name, arr in shard.items():
                out.setdefault(name, []).append(np.asarray(arr[row]))
        cast = {"ids": torch.long, "idx": torch.long, "prob": torch.float32, "hidden": torch.float32, "mask": torch.bool}
        return {name: torch.from_numpy(np.stack(v)).to(cast[name]) for name, v in out.items()}


def shard_kinds(settings: StoreSettings, n: int) -> list[tuple[str, int]]:
    """``(kind, i)`` of shards 0..n-1: ``answers`` shards spread evenly at the settings' share, each kind
    numbered on its own (text shard i holds the i-th slice of the corpus, answers shard i the i-th slice of
    the instructions), so shard j's content never depends on how many shards are asked for."""
    out, counts = [], {"text": 0, "answers": 0}
    for j in range(n):
        kind = "answers" if math.floor((j + 1) * settings.answers) > math.floor(j * settings.answers) else "text"
        out.append((kind, counts[kind]))
        counts[kind] += 1
    return out


class _Sources:
    """The packaged text as one token stream and the instruction pool, tokenised once, on first use."""

    def __init__(self, tokenizer, settings: StoreSettings):
        self.tok, self.s = tokenizer, settings

    @cached_property
    def stream(self) -> list[int]:
        eos, ids = self.tok.eos_token_id, []
        for doc in corpus(self.s.corpus, self.s.split):
            ids += self.tok(doc, add_special_tokens=False)["input_ids"] + [eos]
        return ids

    @cached_property
    def prompts(self) -> list[str]:
        pool = instruction_prompts(10**6, self.s.seed)  # every instruction, shuffled by seed
        cut = int(len(pool) * 0.9)  # the last tenth is held out (split=test)
        return pool[:cut] if self.s.split == "train" else pool[cut:]

    def text(self, i: int) -> torch.Tensor:
        """Text shard ``i``: ``LongTensor (S, L)``, the i-th slice of the stream."""
        S, L = self.s.shard_sequences, self.s.seq_len
        start, end = i * S * L, (i + 1) * S * L
        if end > len(self.stream):
            raise BenchError(f"store.corpus '{self.s.corpus}' ({self.s.split}) holds {len(self.stream):,} tokens, "
                             f"enough for {len(self.stream) // (S * L)} text shards of {S * L:,}; ask for fewer "
                             "store.tokens, a larger store.corpus or a larger store.answers share.")
        return torch.tensor(self.stream[start:end]).view(S, L)

    def answers(self, target, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Answers shard ``i``: the target's greedy answers to instructions ``[i*S, (i+1)*S)``, each row its
        prompt's last tokens then the answer, right-padded with EOS; ``(ids (S, L), mask (S, L))``."""
        S, L = self.s.shard_sequences, self.s.seq_len
        prompts = self.prompts[i * S : (i + 1) * S]
        if len(prompts) < S:
            raise BenchError(f"the packaged instructions ({len(self.prompts):,} in split '{self.s.split}') are used "
                             "up; ask for fewer store.tokens or a smaller store.answers share.")
        ids = torch.full((S, L), self.tok.eos_token_id, dtype=torch.long)
        mask = torch.zeros(S, L, dtype=torch.bool)
        gen = target_answers(target, self.tok, prompts, self.s.answer_batch, self.s.answer_tokens,
                             f"store: target answers (shard {i})")
        for row, (prompt, answer, _, _) in enumerate(gen):
            seq = torch.cat([prompt, answer])[-L:]  # a long prompt keeps its end: the part the answer follows
            ids[row, : len(seq)], mask[row, : len(seq)] = seq, True
        return ids, mask


def label(target, ids: torch.Tensor, settings: StoreSettings) -> dict[str, np.ndarray]:
    """The target's top-k (and hidden states) at every position of ``ids (S, L)``, as the shard's arrays."""
    device = next(target.parameters()).device
    hidden, idx, prob = teacher_pass(target, ids.to(device), settings.topk, settings.batch_size, "store: labelling",
                                     with_hidden=settings.hidden)
    out = {"idx": idx.int().cpu().numpy(), "prob": prob.half().cpu().numpy()}
    if hidden is not None:
        out["hidden"] = hidden.half().cpu().numpy()
    return out


def shard_artifact(target, tokenizer, settings: StoreSettings, j: int, kind: tuple[str, int], sources: _Sources,
                   fingerprint: dict) -> Artifact:
    """Shard ``j`` of the store, as an artifact: built by labelling its text (or generating, then labelling,
    its answers), loaded memory-mapped."""
    key = {"target": fingerprint, "store": settings.model_dump(exclude={"tokens"}), "shard": j, "kind": kind}

    def build(folder: Path) -> dict:
        _ = sources.stream if kind[0] == "text" else sources.prompts  # read once, before the clock: not labelling
        start = time.perf_counter()
        if kind[0] == "text":
            ids = sources.text(kind[1])
            mask = torch.ones_like(ids, dtype=torch.bool)
        else:
            ids, mask = sources.answers(target, kind[1])
        arrays = {"ids": ids.int().numpy(), "mask": mask.numpy(), **label(target, ids, settings)}
        for name, arr in arrays.items():
            np.save(folder / f"{name}.npy", arr)
        seconds = time.perf_counter() - start
        return {"kind": kind[0], "tokens": int(mask.sum()), "seconds": round(seconds, 3),
                "tokens_per_s": round(int(mask.sum()) / max(seconds, 1e-9), 1)}

    def load(folder: Path) -> dict[str, np.ndarray]:
        return {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in FILES
                if (folder / f"{name}.npy").exists()}

    store = f"store-{settings.split}-{content_key(fingerprint, key['store'])}"
    return Artifact("teacher", f"{store}/shard-{j:05d}", key, build, load, description=f"teacher store shard {j}",
                    hint="run 'python -m bench train store' (or with train_if_missing=true)")


def load_or_grow_store(target, tokenizer, settings: StoreSettings, cache: Path, build_if_missing: bool = True) -> TeacherStore:
    """The store of ``target`` with at least ``settings.tokens`` positions (whole shards): shards already built
    are loaded, missing ones built in order (a progress bar per shard). ``target`` is the frozen fp32 target."""
    per_shard = settings.shard_sequences * settings.seq_len
    n = math.ceil(settings.tokens / per_shard)
    fingerprint = {**model_fingerprint(target), "tokenizer": tokenizer_fingerprint(tokenizer)}
    sources = _Sources(tokenizer, settings)
    shards, reports = [], []
    with torch.inference_mode():
        for j, kind in enumerate(tqdm(shard_kinds(settings, n), desc="teacher store", unit="shard")):
            art = shard_artifact(target, tokenizer, settings, j, kind, sources, fingerprint)
            shards.append(load_or_build(art, cache, build_if_missing))
            reports.append(report_of(art, cache))
    return TeacherStore(settings, shards, art.folder(cache).parent, reports)
