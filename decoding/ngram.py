"""Training-free drafters' data structures, shared by ``pld``, ``cascade`` and ``hierarchy``.

- :class:`NGramIndex`: where every n-gram occurs in a growing token text (the prompt and the output so far,
  or earlier outputs of the target), so the tail of the current text can be looked up and what followed it
  proposed as a draft (prompt lookup decoding; LLMA, Yang et al. 2023).
- :class:`CorpusNGrams`: the most frequent continuations of every n-gram of packaged text
  (:mod:`core.corpus`) tokenised with the pair's tokenizer.
- :class:`BigramTable`: the most frequent next token after each token in the same text.

The two corpus tables are built once (seconds) and cached under ``<cache>/ngram/`` by
:func:`core.artifacts.load_or_build`, keyed by the tokenizer and the recipe.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from pathlib import Path

import torch

from core.artifacts import Artifact, load_or_build, tokenizer_fingerprint
from core.errors import BenchError

log = logging.getLogger(__name__)

_SEP = -1  # between documents: no n-gram and no continuation crosses it


def ngram_sizes(node, min_key: str = "min_ngram", max_key: str = "max_ngram"):
    """A method's n-gram sizes must satisfy ``min <= max`` (each is declared ``>= 1``): the named cross-key
    rule of a settings node (``@model_validator``); returns the node, raises ``ValueError`` with one sentence."""
    lo, hi = getattr(node, min_key), getattr(node, max_key)
    if lo > hi:
        raise ValueError(f"{min_key} ({lo}) must not exceed {max_key} ({hi}).")
    return node


class NGramIndex:
    """Every n-gram (``min_n <= n <= max_n``) of a token text made of documents, with the positions that
    follow each occurrence. The last document can keep growing (:meth:`extend`)."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise BenchError(f"n-gram sizes need 1 <= min <= max, got min={min_n}, max={max_n}.")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> continuation starts
        self._doc_start = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def add_document(self, tokens) -> None:
        """Start a new document (nothing is matched across documents) holding ``tokens``."""
        if self.tokens:
            self.tokens.append(_SEP)
        self._doc_start = len(self.tokens)
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append ``tokens`` to the last document and index the n-grams that end in them."""
        old = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        toks, table = self.tokens, self.table
        for end in range(max(old + 1, self._doc_start + self.min_n), len(toks) + 1):
            for n in range(self.min_n, min(self.max_n, end - self._doc_start) + 1):
                # Keyed by where the continuation starts: an occurrence at the very end has none yet.
                table[tuple(toks[end - n:end])].append(end)

    def continuations(self, context: list[int], length: int, limit: int = 1,
                      max_n: int | None = None, min_n: int | None = None) -> list[list[int]]:
        """Up to ``limit`` distinct non-empty continuations (each at most ``length`` tokens) of the tail of
        ``context``: the longest matching n-gram first, its most recent occurrence first; a continuation
        that is a prefix of one already found adds nothing and is skipped (and replaces one it extends)."""
        max_n = min(self.max_n if max_n is None else max_n, len(context))
        min_n = max(self.min_n if min_n is None else min_n, 1)
        found: list[list[int]] = []
        for n in range(max_n, min_n - 1, -1):
            positions = self.table.get(tuple(context[-n:]))
            if not positions:
                continue
            # Bounded scan: a frequent unigram can have thousands of occurrences.
            for pos in positions[: -8 * limit - 1: -1]:
                cont = self.tokens[pos:pos + length]
                if _SEP in cont:
                    cont = cont[: cont.index(_SEP)]
                if _add_candidate(found, cont) and len(found) >= limit:
                    return found
        return found


def _add_candidate(found: list[list[int]], cont: list[int]) -> bool:
    """Add ``cont`` to ``found`` unless it adds nothing (empty, or a prefix of a candidate already there);
    a candidate it extends is replaced by it. True when ``found`` grew."""
    if not cont or any(f[: len(cont)] == cont for f in found):
        return False
    for i, f in enumerate(found):
        if cont[: len(f)] == f:
            found[i] = cont
            return False
    found.append(cont)
    return True


class CorpusNGrams:
    """For every n-gram of a corpus (``min_n..max_n`` tokens), its ``top`` most frequent continuations of
    up to ``length`` tokens (the statistics-dependent database of hierarchy drafting)."""

    def __init__(self, table: dict[tuple[int, ...], list[list[int]]], min_n: int, max_n: int):
        self.table, self.min_n, self.max_n = table, min_n, max_n

    def continuations(self, context: list[int], length: int, limit: int = 1) -> list[list[int]]:
        """Like :meth:`NGramIndex.continuations`, most frequent first within the longest matching n-gram."""
        found: list[list[int]] = []
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            for cont in self.table.get(tuple(context[-n:]), ()):
                cont = cont[:length]
                if _add_candidate(found, cont) and len(found) >= limit:
                    return found
        return found

    @classmethod
    def build(cls, docs: list[list[int]], min_n: int, max_n: int, length: int, top: int) -> CorpusNGrams:
        """Count, for each n-gram of ``docs`` (token lists), the continuations that follow it."""
        table: dict[tuple[int, ...], list[list[int]]] = {}
        for n in range(min_n, max_n + 1):
            places: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
            for d, doc in enumerate(docs):
                # Only places followed by a whole continuation: a cut-short one would count as a different one.
                for end in range(n, len(doc) - length + 1):
                    places[tuple(doc[end - n:end])].append((d, end))
            for key, where in places.items():
                counts = Counter(tuple(docs[d][end:end + length]) for d, end in where)
                table[key] = [list(c) for c, _ in counts.most_common(top)]
        return cls(table, min_n, max_n)

    def to_tensors(self) -> dict:
        """Packed for ``torch.save(weights_only)``: per n, keys ``(N, n)`` and continuations ``(N, top, length)``
        padded with -1."""
        out = {"min_n": self.min_n, "max_n": self.max_n}
        for n in range(self.min_n, self.max_n + 1):
            items = [(k, v) for k, v in self.table.items() if len(k) == n]
            top = max((len(v) for _, v in items), default=1)
            length = max((len(c) for _, v in items for c in v), default=1)
            conts = torch.full((len(items), top, length), -1, dtype=torch.int32)
            for i, (_, v) in enumerate(items):
                for j, c in enumerate(v):
                    conts[i, j, : len(c)] = torch.tensor(c, dtype=torch.int32)
            out[f"keys{n}"] = torch.tensor([k for k, _ in items], dtype=torch.int32).view(len(items), n)
            out[f"conts{n}"] = conts
        return out

    @classmethod
    def from_tensors(cls, blob: dict) -> CorpusNGrams:
        table = {}
        for n in range(blob["min_n"], blob["max_n"] + 1):
            for key, conts in zip(blob[f"keys{n}"].tolist(), blob[f"conts{n}"].tolist()):
                table[tuple(key)] = [[t for t in c if t >= 0] for c in conts if c[0] >= 0]
        return cls(table, blob["min_n"], blob["max_n"])


class BigramTable:
    """The most frequent next token after each token of a corpus; a token never seen is followed by the
    corpus's most frequent token. ``next`` is a plain list: one lookup per drafted token costs nothing."""

    def __init__(self, next_token: torch.Tensor):
        self.tensor = next_token  # LongTensor (vocab,)
        self.next = next_token.tolist()

    @classmethod
    def build(cls, docs: list[list[int]], vocab_size: int) -> BigramTable:
        pairs = Counter((a, b) for doc in docs for a, b in zip(doc, doc[1:]))
        unigram = Counter(t for doc in docs for t in doc)
        table = torch.full((vocab_size,), unigram.most_common(1)[0][0] if unigram else 0, dtype=torch.long)
        best: dict[int, int] = {}
        for (a, b), c in pairs.items():
            if c > best.get(a, 0):
                best[a] = c
                table[a] = b
        return cls(table)

    def chain(self, last: int, length: int) -> list[int]:
        """``length`` tokens, each the most frequent successor of the one before (starting after ``last``)."""
        out = []
        for _ in range(length):
            last = self.next[last] if 0 <= last < len(self.next) else self.next[0]
            out.append(last)
        return out


# ----------------------------------------------------------------------------------------------- caching


def corpus_token_docs(tokenizer, corpus_name: str) -> list[list[int]]:
    """The documents of a packaged corpus (:func:`core.corpus.corpus`, train split), tokenised."""
    from core.corpus import corpus

    docs = corpus(corpus_name, "train")
    return [list(ids) for ids in tokenizer(list(docs), add_special_tokens=False)["input_ids"]]


def _cached_table(kind: str, tokenizer, recipe: dict, cache: Path, build):
    """The tensors of table ``kind`` for this tokenizer and recipe: ``build()``, saved once as ``table.pt``.

    Always built when missing (seconds, no training); token ids are valid for the same tokenizer only, so
    its vocabulary is part of the key.
    """
    art = Artifact("ngram", kind, {"tokenizer": tokenizer_fingerprint(tokenizer), "table": kind, "recipe": recipe},
                   build=lambda folder: torch.save(build(), folder / "table.pt"),
                   load=lambda folder: torch.load(folder / "table.pt", weights_only=True),
                   description=f"{kind} table of corpus '{recipe['corpus']}'")
    return load_or_build(art, cache)


def load_bigram_table(tokenizer, vocab_size: int, corpus_name: str, cache: Path) -> BigramTable:
    """The corpus's bigram table for this tokenizer, built on first use and cached."""
    recipe = {"corpus": corpus_name, "vocab_size": int(vocab_size)}
    blob = _cached_table("bigram", tokenizer, recipe, cache,
                         lambda: {"next": BigramTable.build(corpus_token_docs(tokenizer, corpus_name),
                                                            vocab_size).tensor})
    return BigramTable(blob["next"])


def load_corpus_ngrams(tokenizer, corpus_name: str, min_n: int, max_n: int, length: int, top: int,
                       cache: Path) -> CorpusNGrams:
    """The corpus's n-gram continuation table for this tokenizer, built on first use and cached."""
    recipe = {"corpus": corpus_name, "min_n": min_n, "max_n": max_n, "length": length, "top": top}
    blob = _cached_table("ngrams", tokenizer, recipe, cache,
                         lambda: CorpusNGrams.build(corpus_token_docs(tokenizer, corpus_name),
                                                    min_n, max_n, length, top).to_tensors())
    return CorpusNGrams.from_tensors(blob)
