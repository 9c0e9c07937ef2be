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

Beside the shards, and only when a trainer asks (:meth:`Teacher.kv_store`; GliDe's draft cross-attends to them):
the target's keys and values of one decoder layer at every position of a shard's ``ids``, ``k`` and ``v``
``(S, n_kv_heads, L, head_dim) float16`` (keys after rotary, as the target caches them while decoding), each
shard's one artifact keyed by that shard's own key and the layer, so the shards' keys never change.
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from pydantic import Field
from tqdm.auto import tqdm

from core.artifacts import (
    Artifact,
    content_key,
    load_or_build,
    model_fingerprint,
    report_of,
    tokenizer_fingerprint,
)
from core.corpus import Corpus, Instructions, corpus, instruction_prompts
from core.errors import BenchError
from core.schema import Settings

log = logging.getLogger(__name__)

FILES = ("ids", "mask", "idx", "prob", "hidden", "answer")


class StoreSettings(Settings):
    """``recipe.store.*``: what the teacher store holds and how it is built (its size is ``recipe.tokens``)."""

    corpus: Corpus = Field("lee+wiki", description="packaged text that is teacher-forced")
    answers: float = Field(0.25, ge=0, le=1, description="share of shards made of the target's own greedy "
                           "answers to packaged instructions (on-policy text)")
    answer_tokens: int = Field(128, ge=1, description="tokens per answer at most")
    answer_batch: int = Field(16, ge=1, description="answers generated per batch")
    seq_len: int = Field(256, ge=2, description="tokens per stored sequence")
    shard_sequences: int = Field(64, ge=1, description="sequences per shard: the unit that is built, kept after "
                                 "a kill and appended (held-out shards hold a quarter as many)")
    topk: int = Field(32, ge=1, description="the target's top-k next-token probabilities kept per position")
    hidden: bool = Field(True, description="keep the target's last hidden states (float16): heads, the SPRINTER "
                         "verifier's sampling labels and the teacher loss need them")
    batch_size: int = Field(8, ge=1, description="sequences per teacher-forced forward")
    seed: int = Field(0, ge=0, description="which instructions are answered, in which order")
    instructions: Instructions = Field("news+wiki", description="what the answered instructions are: news+wiki = "
                                       "tasks on packaged articles; mixed = those in two of five, with advice, "
                                       "explanations of topics and arithmetic word problems (core/corpus.py)")

    def key(self, kind: str = "answers") -> dict:
        """The settings as store shards (of ``kind``) and trained parts are keyed by (:func:`store_key`)."""
        return store_key(self.model_dump(mode="json"), kind)


def store_key(store: dict, kind: str = "answers") -> dict:
    """``store`` (``recipe.store`` as a dict) as keys see it. ``instructions`` enters only for answers, and only when
    it is not ``news+wiki``, the one kind there was before it was a setting: what was built (and run) then keeps its
    key, and the teacher-forced text shards are shared by both."""
    data = dict(store)
    if data.get("instructions") == "news+wiki" or kind == "text":
        data.pop("instructions", None)
    return data


class RecipeSettings(Settings):
    """How much the target labels for the trainers (``recipe=smoke|quick|full``). Every trained part of a run reads
    the same teacher store under the same recipe, for as many passes as the part itself declares for the recipe
    (``training.loop.TrainRecipe.EPOCHS``: the recipe names no method); records name the recipe behind each
    trained method."""

    name: str = Field("quick", pattern=r"^[A-Za-z0-9_.-]+$", description="the recipe's name, as records and "
                      "tables show it")
    tokens: int = Field(65536, ge=1, description="teacher tokens each trainer reads (train split: the first "
                        "ceil(tokens / seq_len) stored sequences); the store grows to hold them")
    eval_tokens: int = Field(16384, ge=1, description="held-out teacher tokens (test split) for the trainers' "
                             "reports")
    store: StoreSettings = Field(default_factory=StoreSettings, description="what the teacher store holds")

    @property
    def label(self) -> str:
        """The recipe as records and tables name it: its name, or ``name~<hash>`` when settings were overridden."""
        preset = RECIPES.get(self.name)
        if preset is not None and preset == self:
            return self.name
        return f"{self.name}~{content_key({**self.model_dump(mode='json'), 'store': self.store.key()})[:6]}"


# The presets of ``recipe=NAME``. quick and full share one store (full appends to quick's shards); full is
# sized for ``python -m bench train all recipe=full`` in about an hour on 2 CPU cores for the methods of issue 12;
# with every trained method since, about 3 h (README: measured).
RECIPES = {
    "smoke": RecipeSettings(name="smoke", tokens=4096, eval_tokens=1024,
                            store=StoreSettings(corpus="lee", seq_len=64, shard_sequences=16, answer_tokens=32, topk=8)),
    "quick": RecipeSettings(),
    "full": RecipeSettings(name="full", tokens=163840, eval_tokens=32768),
}


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


# --------------------------------------------------------------------------------------------- labelling


def token_chunks(tokenizer, docs, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Documents joined by EOS and cut into ``(n_chunks, seq_len)`` token rows, at most ``max_tokens``."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos])
        if len(ids) >= max_tokens:
            break
    n = min(len(ids), max_tokens) // seq_len
    if n == 0:
        raise BenchError("the text is shorter than one sequence; ask for a shorter seq_len.")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


@torch.no_grad()
def teacher_pass(target, chunks: torch.Tensor, topk: int, batch_size: int, desc: str, with_hidden: bool = False):
    """Teacher-forced target outputs at every position of ``chunks (N, T)``.

    Returns ``(hidden, idx, prob)``: the last hidden states ``(N, T, hidden)`` (``None`` unless
    ``with_hidden``) and the target's top-k next-token ids and probabilities ``(N, T, topk)``
    (``idx[..., 0]`` is its greedy token).
    """
    hidden, idx, prob = [], [], []
    for start in tqdm(range(0, len(chunks), batch_size), desc=desc, unit="batch"):
        out = target(chunks[start : start + batch_size], output_hidden_states=with_hidden)
        p, i = torch.softmax(out.logits.float(), -1).topk(topk, dim=-1)
        if with_hidden:
            hidden.append(out.hidden_states[-1].float())
        idx.append(i)
        prob.append(p)
    return (torch.cat(hidden) if with_hidden else None), torch.cat(idx), torch.cat(prob)



@torch.no_grad()
def target_answers(target, tokenizer, prompts: list[str], batch_size: int, max_new_tokens: int, desc: str, topk: int = 0):
    """The target's greedy answers to ``prompts`` (chat template where the tokenizer has one), batched.

    Yields ``(prompt_ids, answer_ids, idx, prob)`` per prompt, on the CPU whatever the target's device:
    ``LongTensor (P,)``, ``LongTensor (n,)`` (cut after the first EOS) and, when ``topk`` > 0, the target's top-k
    at each answer step: ``(n, topk)`` each.
    """
    device = next(target.parameters()).device
    eos = tokenizer.eos_token_id
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation appends on the right, so prompts are aligned on the right
    try:
        for start in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch"):
            batch = prompts[start : start + batch_size]
            if getattr(tokenizer, "chat_template", None):
                batch = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       tokenize=False) for p in batch]
            enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            out = target.generate(**enc.to(device), max_new_tokens=max_new_tokens, do_sample=False,
                                  output_logits=topk > 0, return_dict_in_generate=True, pad_token_id=eos)
            if topk:
                steps = torch.stack(out.logits, 1).float()  # (B, R, vocab): the target's logits for answer token t
                prob, idx = (t.cpu() for t in torch.softmax(steps, -1).topk(topk, dim=-1))
            enc, sequences = enc.to("cpu"), out.sequences.cpu()
            width = enc["input_ids"].shape[1]
            for b in range(len(batch)):
                answer = sequences[b, width:]
                ends = (answer == eos).nonzero()
                n = int(ends[0]) + 1 if ends.numel() else answer.numel()
                prompt = enc["input_ids"][b][enc["attention_mask"][b].bool()]
                yield prompt, answer[:n], (idx[b, :n] if topk else None), (prob[b, :n] if topk else None)
    finally:
        tokenizer.padding_side = side


# --------------------------------------------------------------------------------------------- the store


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


# --------------------------------------------------------------------------------------------- K/V extra


def kv_layer(config, layer: int, key: str = "layer") -> int:
    """``layer`` as an index into the target's decoder layers (negative: from the last, -1 the last one); ``key``
    names the setting in the sentence that refuses one that is not a layer."""
    n = config.num_hidden_layers
    if not -n <= layer < n:
        raise BenchError(f"{key}={layer} is not one of the target's {n} decoder layers (0 .. {n - 1}, or -1 .. -{n} "
                         "counted from the last).")
    return layer % n


@torch.no_grad()
def target_kv(target, ids: torch.Tensor, layer: int, batch_size: int, desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's keys and values of decoder ``layer`` at every position of ``ids (N, T)``: one teacher-forced
    forward per batch, read from the KV cache it returns (keys after rotary, exactly what decoding caches).
    Returns ``(k, v)``, each ``FloatTensor (N, n_kv_heads, T, head_dim)`` on the CPU."""
    device = next(target.parameters()).device
    ks, vs = [], []
    for start in tqdm(range(0, len(ids), batch_size), desc=desc, unit="batch"):
        out = target(ids[start : start + batch_size].to(device), use_cache=True, logits_to_keep=1)
        cached = out.cache.layers[layer]
        ks.append(cached.keys.float().cpu())
        vs.append(cached.values.float().cpu())
    return torch.cat(ks), torch.cat(vs)


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


def tokenizer_key(tokenizer) -> dict:
    """The tokenizer's part of a store's key (and of what is trained from it): its vocabulary and its chat
    template (the answers' prompts are written in it)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    return {"tokenizer": tokenizer_fingerprint(tokenizer), "chat_template": hashlib.sha256(template.encode()).hexdigest()[:16]}


def store_fingerprint(target, tokenizer) -> dict:
    """What a store's labels depend on besides its settings: the target's weights and the dtype it labels in
    (bf16 labels are not fp32 labels), and :func:`tokenizer_key`."""
    return {**model_fingerprint(target), "dtype": str(next(target.parameters()).dtype), **tokenizer_key(tokenizer)}


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
