"""REST (He et al. 2023, "REST: Retrieval-Based Speculative Decoding"): drafts retrieved from a datastore of text,
no draft model.

Each step the longest suffix of the committed text (``max_span`` tokens, then one fewer, down to ``min_span``)
that occurs in the datastore is looked up through the datastore's suffix array
(:mod:`decoding.suffix_array`); the ``long`` tokens after each of its first ``matches`` occurrences are merged
into a trie, whose ``choices`` most frequent nodes are the draft tree, rooted at the pending token and scored by
the target in ONE forward. The candidates are deterministic (one-hot q), so the shared tree verifier keeps the
method lossless: greedy output equals ``ar``, sampled output follows the target.

The datastore (``method.datastore``): a packaged corpus (``lee``, ``wiki``, ``lee+wiki``: the text the teacher
store reads) or a user's ``.txt`` / ``.jsonl`` file, tokenized by the target's tokenizer and concatenated (as the
authors' writer concatenates its entries, without separators), with its suffix array; built once and cached
(``cache_dir/datastore/``, keyed by the source, the file's checksum and the tokenizer).

Where this differs from the authors' code (FasterDecoding/REST's ``DraftRetriever``, as Spec-Bench runs it), and why:

- ids are stored as ``uint32``, not ``u16`` (which wraps ids above 65,535: Llama-3's and Qwen's vocabularies);
- ties among equally frequent trie nodes go to the shallower node, then to the first in lexicographic order, so
  the kept nodes always form a trie of exactly ``choices`` nodes (the authors' heap breaks ties by token order
  and then trims to "less than choices in most cases");
- when nothing matches, nothing is drafted (a plain target step); the authors' code guesses token id 100.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from pydantic import Field, model_validator

from core.artifacts import Artifact, file_sha256, load_or_build, model_fingerprint, report_of, tokenizer_fingerprint
from core.corpus import CORPORA, corpus
from core.errors import BenchError
from decoding.suffix_array import continuations, draft_trie, match_range, suffix_array
from decoding.tree import Tree
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register
from training.kit import budget


def file_documents(path: Path) -> list[str]:
    """The documents of a user's datastore file: a ``.txt`` file is one document; a ``.jsonl`` file one per line,
    each a string or an object with ``text``, or with ``conversations`` / ``messages`` (ShareGPT's ``value``, or
    ``content``) whose turns are joined."""
    if not path.is_file():
        raise BenchError(f"method.datastore={path}: no such file (or give a packaged corpus: {', '.join(CORPORA)}).")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise BenchError(f"{path}, line {n}, is not JSON.") from None
        turns = row.get("conversations") or row.get("messages") if isinstance(row, dict) else None
        if isinstance(row, str):
            docs.append(row)
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            docs.append(row["text"])
        elif isinstance(turns, list) and all(isinstance(t, dict) for t in turns):
            docs.append("\n".join(str(t.get("value", t.get("content", ""))) for t in turns))
        else:
            raise BenchError(f"{path}, line {n}, has no text: give a string, or an object with 'text', "
                             "'conversations' or 'messages'.")
    if not docs:
        raise BenchError(f"{path} holds no documents.")
    return docs


ANSWERS = "answers"  # the target's own answers, from the run's teacher store


def answer_ids(store) -> list[list[int]]:
    """Each answers sequence of a teacher store (instruction and the target's greedy answer, as labelled), without
    its padding."""
    rows = [i for i in range(len(store)) if store.kind(i) == "answers"]
    if not rows:
        return []
    data = store.rows(rows, ("ids", "mask"))
    return [ids[mask].tolist() for ids, mask in zip(data["ids"], data["mask"])]


def datastore_artifact(source: str, tokenizer, teacher=None, target=None) -> Artifact:
    """The datastore of ``source`` (a packaged corpus name, ``answers``: the target's own answers in ``teacher``'s
    store, or a file) for ``tokenizer``: ``tokens.npy`` (uint32) and ``suffixes.npy`` (int64)."""
    named = source in CORPORA
    path = Path(source).expanduser()
    if source == ANSWERS:
        key = {"source": source, "target": model_fingerprint(target), "store": budget(teacher, 0)}
    elif named:
        key = {"source": source}
    else:
        key = {"file": path.name, "sha256": file_sha256(path) if path.is_file() else None}
    key["tokenizer"] = tokenizer_fingerprint(tokenizer)

    def build(folder: Path) -> dict:
        start = time.perf_counter()
        if source == ANSWERS:
            ids = answer_ids(teacher.store(target, tokenizer, "train"))
            docs = ids
        else:
            docs = list(corpus(source)) if named else file_documents(path)
            ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
        tokens = np.fromiter((t for doc in ids for t in doc), dtype=np.uint32)
        if len(tokens) < 2:
            raise BenchError(f"the datastore of {source} holds {len(tokens)} tokens; give a longer text.")
        tokenized = time.perf_counter() - start
        sa = suffix_array(tokens)
        np.save(folder / "tokens.npy", tokens)
        np.save(folder / "suffixes.npy", sa)
        return {"documents": len(docs), "tokens": int(len(tokens)), "tokenize_seconds": round(tokenized, 2),
                "suffix_array_seconds": round(time.perf_counter() - start - tokenized, 2),
                "bytes": int(tokens.nbytes + sa.nbytes)}

    def load(folder: Path) -> tuple[np.ndarray, np.ndarray]:
        return np.load(folder / "tokens.npy", mmap_mode="r"), np.load(folder / "suffixes.npy", mmap_mode="r")

    name = source if named or source == ANSWERS else path.stem
    return Artifact("datastore", f"{name}-{key['tokenizer']}", key, build, load,
                    trained_by="rest" if source == ANSWERS else None, same=("method.datastore",),
                    description=f"REST datastore of {source}")


class RestSettings(MethodSettings):
    """REST's settings (``method.*``); Spec-Bench's run: the defaults but ``choices=64`` over its chat datastore."""

    datastore: str = Field("lee+wiki", min_length=1, description="what is retrieved from: a packaged corpus (lee, "
                           "wiki, lee+wiki), answers (the target's own answers in the run's teacher store: built "
                           "under recipe=) or a .txt / .jsonl file (one document per line: a string or an object "
                           "with text, conversations or messages)")
    choices: int = Field(8, ge=1, description="draft tokens per step: the trie's most frequent nodes (Spec-Bench "
                         "and the paper: 64 on a GPU; CPU default measured)")
    max_span: int = Field(16, ge=1, description="the longest context suffix searched for (Spec-Bench: 16)")
    min_span: int = Field(2, ge=1, description="the shortest one tried before giving up (Spec-Bench: 2)")
    long: int = Field(10, ge=1, description="tokens of each match's continuation merged into the trie (the authors: "
                      "10)")
    matches: int = Field(5000, ge=1, description="occurrences read per step at most, first in suffix order (the "
                         "authors: 5000)")

    @model_validator(mode="after")
    def spans_in_order(self):
        if self.min_span > self.max_span:
            raise ValueError(f"min_span ({self.min_span}) must not exceed max_span ({self.max_span})")
        if self.datastore not in (*CORPORA, ANSWERS) and not Path(self.datastore).expanduser().is_file():
            raise ValueError(f"datastore '{self.datastore}' is neither a packaged corpus ({', '.join(CORPORA)}), "
                             f"{ANSWERS}, nor a file")
        return self


@register("rest")
class Rest(DraftVerify):
    lossless = True
    Config = RestSettings
    label_settings = ("datastore", "choices")  # a row always says what it retrieved from and how wide

    def __init__(self, cfg, pair):
        super().__init__(cfg, pair)
        self.tokens: np.ndarray | None = None
        self.sa: np.ndarray | None = None
        self.report: dict = {}

    @classmethod
    def check_pair(cls, settings, pair) -> None:
        super().check_pair(settings, pair)
        if settings.datastore == ANSWERS and pair.synthetic:
            raise BenchError(f"method.datastore={ANSWERS} retrieves the target's answers from its teacher store, which "
                             f"pair={pair.name} (random weights) never labels; retrieve from a packaged corpus "
                             f"({', '.join(CORPORA)}) or a file.")

    @classmethod
    def has_trained_parts(cls, pair_spec, settings=None) -> bool:
        return getattr(settings, "datastore", None) == ANSWERS  # read from the recipe's teacher store

    def setup(self, train_if_missing: bool = True) -> None:
        answers = self.cfg.datastore == ANSWERS
        art = datastore_artifact(self.cfg.datastore, self.pair.tokenizer, self.pair.teacher,
                                 self.pair.target.module if answers else None)
        # The target's answers are labelled into the teacher store first, which train_if_missing governs.
        self.tokens, self.sa = load_or_build(art, self.pair.cache, train_if_missing or not answers)
        self.report = report_of(art, self.pair.cache)

    class State(PromptState):
        """One prompt's retrieval figures."""

        spans: list[int]  # the matched suffix's length at each step (0: nothing matched)
        nodes: list[int]  # tokens the target scored at each call

    def start(self, state: State) -> None:
        assert self.tokens is not None, "call setup() before decode()"
        state.spans, state.nodes = [], []

    def retrieve(self, context: list[int]) -> tuple[int, np.ndarray]:
        """The longest suffix of ``context`` (at most ``max_span``, at least ``min_span`` tokens) found in the
        datastore, and the continuations of its first ``matches`` occurrences ``(m, long)`` (``0`` and none
        when no suffix is found)."""
        # Where a suffix is found every shorter one is too (it ends the same occurrence), so the longest found is a
        # binary search over the lengths: the same answer as trying them longest first, in ~4 searches, not ~15.
        shortest, longest, found = self.cfg.min_span, min(self.cfg.max_span, len(context)), None
        while shortest <= longest:
            span = (shortest + longest) // 2
            lo, hi = match_range(self.tokens, self.sa, context[-span:])
            if hi > lo:
                found, shortest = (span, lo, hi), span + 1
            else:
                longest = span - 1
        if found is None:
            return 0, np.zeros((0, self.cfg.long), dtype=np.int64)
        span, lo, hi = found
        return span, continuations(self.tokens, self.sa, (lo, min(hi, lo + self.cfg.matches)), span, self.cfg.long)

    def propose(self, state: State) -> Proposal:
        tree = Tree(state.seq[-1])
        if state.draft_budget > 0:
            span, rows = self.retrieve(state.seq)
            state.spans.append(span)
            ids: list[int] = []
            for depth, parent, token in draft_trie(rows[:, : state.draft_budget], self.cfg.choices):
                ids.append(tree.add_child(0 if parent < 0 else ids[parent], token, merge=False))
        state.nodes.append(len(tree))
        return Proposal(tree)

    def extra(self, state: State) -> dict:
        found = [s for s in state.spans if s > 0]
        return {
            "retrieved": len(found) / len(state.spans) if state.spans else float("nan"),  # steps with a match
            "mean_span": sum(found) / len(found) if found else float("nan"),
            "tree_tokens_per_call": sum(state.nodes) / len(state.nodes) if state.nodes else float("nan"),
        }
