"""The teacher store: the target's labels, computed once per target and read by every trainer.

Labelling is the binding cost of every trained drafter on a CPU (the target runs at a few hundred
teacher-forced tokens per second), so it is done once and kept: token ids, the target's top-k next-token
probabilities at every position and, when asked, its last hidden states (what feature-level drafters and
heads read). Text comes from two sources, interleaved shard by shard:

- packaged text (:func:`core.corpus.corpus`), teacher-forced;
- the target's own greedy answers to packaged instructions (:func:`core.corpus.instruction_prompts`),
  generated in batches and then teacher-forced like text: on-policy text, the kind a draft meets while
  decoding.

The store is a sequence of shards, each ``shard_sequences`` rows of ``seq_len`` tokens, each one artifact of
``core.artifacts`` (atomic, locked, checksummed) keyed by the target, the tokenizer, the store's settings and
the shard's index -- not by how many tokens are wanted. So a killed build keeps every finished shard and
resumes at the first missing one, and asking for more tokens appends shards and keeps what was labelled.
Arrays are ``.npy`` files read back memory-mapped: a trainer touches only the rows it samples.

How much of the store a run's trainers read, and for how many epochs, is the run's recipe (``recipe=smoke|quick|
full``, :class:`RecipeSettings`); :class:`Teacher` hands every trainer of a run the same stores (a train split of
``recipe.tokens``, a held-out split of ``recipe.eval_tokens``), grown on first use.

Per shard (S sequences, L = seq_len, k = topk, H = hidden size):
``ids (S, L) int32``, ``mask (S, L) bool`` (False on padding), ``idx (S, L, k) int32`` and ``prob (S, L, k)
float16`` (the target's top-k at each position: ``idx[..., 0]`` is its greedy next token), ``hidden (S, L, H)
float16`` (only with ``hidden: true``); answer shards also ``answer (S, L) bool``: True where the next token is
the target's own answer (the end of the prompt before it is labelled too, but is not on-policy text); a text
shard's is all False and is not stored.

Beside the shards, and only when a trainer asks (:meth:`training.teacher.Teacher.kv_store`; ``training/kv_store.py``;
GliDe's draft cross-attends to them):
the target's keys and values of one decoder layer at every position of a shard's ``ids``, ``k`` and ``v``
``(S, n_kv_heads, L, head_dim) float16`` (keys after rotary, as the target caches them while decoding), each
shard's one artifact keyed by that shard's own key and the layer, so the shards' keys never change.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from core.artifacts import Artifact, content_key, load_or_build, model_fingerprint, report_of, tokenizer_fingerprint
from core.corpus import corpus, instruction_prompts
from core.errors import BenchError
from training.labelling import target_answers, teacher_pass
from training.recipes import StoreSettings

FILES = ("ids", "mask", "idx", "prob", "hidden", "answer")

@dataclass
class TeacherStore:
    """The shards of one store, memory-mapped: ``shards[i][name]`` is an ``np.ndarray`` (see the module doc).

    ``limit``: how many sequences a trainer may read (the first ``ceil(tokens / seq_len)``), however far the
    store on disk has grown: a trained artifact depends on its recipe only, not on the store's history.
    """

    settings: StoreSettings
    shards: list[dict[str, np.ndarray]]
    folder: Path
    reports: list[dict]  # each shard's build report: kind, tokens, seconds, tokens_per_s
    limit: int
    per_shard: int  # sequences per shard (sequences_per_shard(settings, split))
    keys: list[dict] = field(default_factory=list, repr=False)  # each shard's artifact key (what its extras key on)

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
        """Sequences a trainer reads."""
        return min(self.limit, sum(len(s["ids"]) for s in self.shards))

    @property
    def tokens(self) -> int:
        """Labelled (non-padding) positions among those sequences."""
        return int(self.rows(range(len(self)), ("mask",))["mask"].sum())

    def kind(self, i: int) -> str:
        """``text`` or ``answers``: what sequence ``i`` holds."""
        return self.reports[i // self.per_shard].get("kind", "text")

    def rows(self, index, fields=FILES) -> dict[str, torch.Tensor]:
        """Sequences ``index`` (ints in ``[0, len)``) as tensors: ``ids``, ``idx`` LongTensor, ``prob``,
        ``hidden`` FloatTensor, ``mask`` and ``answer`` BoolTensor (those of ``fields`` the store has; ``answer`` is
        all False for a text shard); only those rows are read from disk."""
        per = self.per_shard
        out: dict[str, list] = {}
        for i in index:
            if not 0 <= int(i) < len(self):
                raise IndexError(f"sequence {int(i)} of a store of {len(self)}")
            shard, row = self.shards[int(i) // per], int(i) % per
            for name in fields:
                if name in shard:
                    out.setdefault(name, []).append(np.asarray(shard[name][row]))
                elif name == "answer":  # a text shard: no position is followed by an answer token
                    out.setdefault(name, []).append(np.zeros(shard["ids"].shape[1], dtype=bool))
        cast = {"ids": torch.long, "idx": torch.long, "prob": torch.float32, "hidden": torch.float32, "mask": torch.bool,
                "answer": torch.bool}
        return {name: torch.from_numpy(np.stack(v)).to(cast[name]) for name, v in out.items()}

def sequences_per_shard(settings: StoreSettings, split: str) -> int:
    """Sequences per shard: ``shard_sequences`` in the train split, a quarter as many held out (an evaluation
    needs few tokens, but of both kinds)."""
    return settings.shard_sequences if split == "train" else max(1, settings.shard_sequences // 4)


def shard_kinds(settings: StoreSettings, n: int, split: str = "train") -> list[tuple[str, int]]:
    """``(kind, i)`` of shards 0..n-1: ``answers`` shards spread evenly at the settings' share, each kind
    numbered on its own (text shard i holds the i-th slice of the corpus, answers shard i the i-th slice of
    the instructions), so shard j's content never depends on how many shards are asked for. The held-out
    split starts with an answers shard (its reports need the target's own answers however small it is)."""
    out, counts, a = [], {"text": 0, "answers": 0}, settings.answers
    for j in range(n):
        step = math.ceil if split == "test" else math.floor
        kind = "answers" if step((j + 1) * a) > step(j * a) else "text"
        out.append((kind, counts[kind]))
        counts[kind] += 1
    return out


class _Sources:
    """The packaged text as one token stream and the instruction pool, tokenised once, on first use."""

    def __init__(self, tokenizer, settings: StoreSettings, split: str):
        self.tok, self.s, self.split = tokenizer, settings, split

    @cached_property
    def stream(self) -> list[int]:
        eos, ids = self.tok.eos_token_id, []
        for doc in corpus(self.s.corpus, self.split):
            ids += self.tok(doc, add_special_tokens=False)["input_ids"] + [eos]
        return ids

    @cached_property
    def prompts(self) -> list[str]:
        # Every instruction built from this split's articles, shuffled by seed: held-out text never leaks in.
        return instruction_prompts(10**6, self.s.seed, self.split, self.s.instructions)

    def text(self, i: int) -> torch.Tensor:
        """Text shard ``i``: ``LongTensor (S, L)``, the i-th slice of the stream."""
        S, L = sequences_per_shard(self.s, self.split), self.s.seq_len
        start, end = i * S * L, (i + 1) * S * L
        if end > len(self.stream):
            raise BenchError(f"recipe.store.corpus '{self.s.corpus}' ({self.split} split) holds "
                             f"{len(self.stream):,} tokens, enough for {len(self.stream) // (S * L)} text shards of "
                             f"{S * L:,}; ask for fewer recipe.tokens (or eval_tokens), a larger recipe.store.corpus "
                             "or a larger recipe.store.answers share.")
        return torch.tensor(self.stream[start:end]).view(S, L)

    def answers(self, target, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Answers shard ``i``: the target's greedy answers to instructions ``[i*S, (i+1)*S)``, each row its
        prompt's last tokens then the answer, right-padded with EOS; ``(ids (S, L), mask (S, L), answer (S, L))``,
        ``answer`` True at the positions whose next token is the answer's (the labels greedy SD drafts for)."""
        S, L = sequences_per_shard(self.s, self.split), self.s.seq_len
        prompts = self.prompts[i * S : (i + 1) * S]
        if len(prompts) < S:
            raise BenchError(f"the packaged instructions ({len(self.prompts):,} in the {self.split} split) are used "
                             "up; ask for fewer recipe.tokens (or eval_tokens) or a smaller recipe.store.answers share.")
        ids = torch.full((S, L), self.tok.eos_token_id, dtype=torch.long)
        mask = torch.zeros(S, L, dtype=torch.bool)
        answer = torch.zeros(S, L, dtype=torch.bool)
        gen = target_answers(target, self.tok, prompts, self.s.answer_batch, self.s.answer_tokens,
                             f"store: target answers (shard {i})")
        for row, (prompt, reply, _, _) in enumerate(gen):
            seq = torch.cat([prompt, reply])[-L:]  # a long prompt keeps its end: the part the answer follows
            ids[row, : len(seq)], mask[row, : len(seq)] = seq, True
            # Position t's label is the token at t + 1: the reply's tokens are the last len(reply) of the row.
            answer[row, max(len(seq) - len(reply) - 1, 0) : len(seq) - 1] = True
        return ids, mask, answer


def label(target, ids: torch.Tensor, settings: StoreSettings) -> dict[str, np.ndarray]:
    """The target's top-k (and hidden states) at every position of ``ids (S, L)``, as the shard's arrays."""
    device = next(target.parameters()).device
    hidden, idx, prob = teacher_pass(target, ids.to(device), settings.topk, settings.batch_size, "store: labelling",
                                     with_hidden=settings.hidden)
    out = {"idx": idx.int().cpu().numpy(), "prob": prob.half().cpu().numpy()}
    if hidden is not None:
        out["hidden"] = hidden.half().cpu().numpy()
    return out


def shard_artifact(target, tokenizer, settings: StoreSettings, split: str, j: int, kind: tuple[str, int],
                   sources: _Sources, fingerprint: dict) -> Artifact:
    """Shard ``j`` of the ``split`` store, as an artifact: built by labelling its text (or generating, then
    labelling, its answers), loaded memory-mapped."""
    key = {"target": fingerprint, "store": settings.key(kind[0]), "split": split, "shard": j, "kind": kind}

    def build(folder: Path) -> dict:
        _ = sources.stream if kind[0] == "text" else sources.prompts  # read once, before the clock: not labelling
        start = time.perf_counter()
        extra = {}
        if kind[0] == "text":
            ids = sources.text(kind[1])
            mask = torch.ones_like(ids, dtype=torch.bool)
        else:
            ids, mask, answer = sources.answers(target, kind[1])
            extra["answer"] = answer.numpy()
        arrays = {"ids": ids.int().numpy(), "mask": mask.numpy(), **extra, **label(target, ids, settings)}
        for name, arr in arrays.items():
            np.save(folder / f"{name}.npy", arr)
        seconds = time.perf_counter() - start
        return {"kind": kind[0], "tokens": int(mask.sum()), "seconds": round(seconds, 3),
                "tokens_per_s": round(int(mask.sum()) / max(seconds, 1e-9), 1)}

    def load(folder: Path) -> dict[str, np.ndarray]:
        return {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in FILES
                if (folder / f"{name}.npy").exists()}

    store = f"store-{split}-{content_key(fingerprint, key['store'])}"
    # version 2: instructions drawn from the split's own articles; held-out shards a quarter the size. Answer
    # shards 3: they hold ``answer`` (text shards, unchanged, keep 2 and their labels).
    version = 3 if kind[0] == "answers" else 2
    return Artifact("teacher", f"{store}/shard-{j:05d}", key, build, load, version=version,
                    description=f"teacher store shard {j}",
                    trained_by="store")


def shard_bytes(settings: StoreSettings, hidden_size: int, sequences: int) -> int:
    """Bytes one shard of ``sequences`` rows takes on disk (its .npy arrays)."""
    per_position = 4 + 1 + 1 + settings.topk * (4 + 2) + (2 * hidden_size if settings.hidden else 0)  # ids mask answer
    return sequences * settings.seq_len * per_position


def check_disk(folder: Path, missing: int, settings: StoreSettings, hidden_size: int, sequences: int) -> None:
    """Refuse a build whose missing shards would not fit on the disk, before any of them is labelled."""
    need = missing * shard_bytes(settings, hidden_size, sequences)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise BenchError(f"the teacher store needs {need / 2**30:.2f} GiB more for {missing} shards but {folder} has "
                         f"{free / 2**30:.2f} GiB free; free some space, set cache_dir= elsewhere or ask for fewer "
                         "recipe.tokens.")


def load_or_grow_store(target, tokenizer, settings: StoreSettings, cache: Path, tokens: int, split: str = "train",
                       build_if_missing: bool = True) -> TeacherStore:
    """The ``split`` store of ``target`` holding at least ``tokens`` positions (whole shards): shards already
    built are loaded, missing ones built in order (a progress bar per shard). ``target`` is the frozen target;
    the store's limit is ``ceil(tokens / seq_len)`` sequences."""
    per = sequences_per_shard(settings, split)
    n = math.ceil(tokens / (per * settings.seq_len))
    fingerprint = store_fingerprint(target, tokenizer)
    sources = _Sources(tokenizer, settings, split)
    arts = [shard_artifact(target, tokenizer, settings, split, j, kind, sources, fingerprint)
            for j, kind in enumerate(shard_kinds(settings, n, split))]
    missing = [a for a in arts if not report_of(a, cache)]
    if missing and build_if_missing:
        check_disk(arts[0].folder(cache).parent, len(missing), settings, target.config.hidden_size, per)
    shards, reports = [], []
    with torch.inference_mode():
        for art in tqdm(arts, desc=f"teacher store ({split})", unit="shard"):
            shards.append(load_or_build(art, cache, build_if_missing))
            reports.append(report_of(art, cache))
    return TeacherStore(settings, shards, arts[0].folder(cache).parent, reports, math.ceil(tokens / settings.seq_len), per,
                        [a.key for a in arts])

def tokenizer_key(tokenizer) -> dict:
    """The tokenizer's part of a store's key (and of what is trained from it): its vocabulary and its chat
    template (the answers' prompts are written in it)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    return {"tokenizer": tokenizer_fingerprint(tokenizer), "chat_template": hashlib.sha256(template.encode()).hexdigest()[:16]}


def store_fingerprint(target, tokenizer) -> dict:
    """What a store's labels depend on besides its settings: the target's weights and the dtype it labels in
    (bf16 labels are not fp32 labels), and :func:`tokenizer_key`."""
    return {**model_fingerprint(target), "dtype": str(next(target.parameters()).dtype), **tokenizer_key(tokenizer)}
