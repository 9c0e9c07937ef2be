"""NEST's datastore and its per-prompt token index (the method is :mod:`methods.nest`).

- :func:`documents`: the packaged text NEST retrieves from and cites: the Lee news articles (``news``: the 50
  held-out ones that ``dataset=news`` summarises; ``lee``: all 350) and gensim's Wikipedia extract (``wiki``:
  the 100 articles ``dataset=wiki_local`` draws from), each with the id its prompts carry.
- :func:`load_or_build_datastore`: documents cut to ``doc_tokens`` tokens and into passages of ``passage_len``
  tokens; for every passage position, the target's hidden state entering its last decoder layer (the key the
  authors' code uses) with the passage read on its own from its first token, as the authors encode retrieved
  passages; stored as fp16 (``keys.npy``, memory-mapped on load) beside the tokens and the passages' texts.
  Built once per (target weights, tokenizer, corpus, cut) through :mod:`core.artifacts`; a folder given as
  ``method.datastore`` is checked against the same fingerprints and refused when built for another model.
- :class:`Datastore.retrieve`: the passage-level search, TF-IDF cosine over the passages' texts (scikit-learn).
- :class:`TokenIndex`: a prompt's retrieved passages' keys on the device, searched by L2 distance.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from core.errors import BenchError
from core.kv_cache import lm_forward
from core.layer_taps import LayerTaps
from core.model_parts import decoder_layers

log = logging.getLogger(__name__)

VERSION = 1  # the files' format: bump when build writes something new
KEYS, TOKENS, INDEX = "keys.npy", "tokens.npy", "passages.json"
TITLE_WORDS = 8  # a document's "title": its first words (the packaged texts have no titles)


def documents(corpus: str) -> list[tuple[str, str]]:
    """``(doc_id, text)`` of a datastore corpus: ``news``, ``lee``, ``wiki`` or two joined by ``+``. Ids are those
    of the prompts drawn from the same text (``lee-test-3`` for ``dataset=news``, ``wiki-91`` for
    ``dataset=wiki_local``), so a citation can be checked against the prompt's own article."""
    from core.corpus import lee_articles, wiki_documents

    docs: list[tuple[str, str]] = []
    for part in corpus.split("+"):
        if part in ("news", "lee"):
            docs += [(f"lee-test-{i}", a) for i, a in enumerate(lee_articles("test"))]
        if part == "lee":
            docs += [(f"lee-train-{i}", a) for i, a in enumerate(lee_articles("train"))]
        if part == "wiki":
            docs += list(wiki_documents())
    return docs


def title_of(text: str) -> str:
    words = text.split()
    return " ".join(words[:TITLE_WORDS]) + (" …" if len(words) > TITLE_WORDS else "")


@dataclass
class Datastore:
    """A built datastore. ``tokens``: ``(T,)`` int32, every document's tokens concatenated; ``docs``: per document
    ``{"id", "title", "start", "length"}`` into ``tokens``; ``passages``: per passage ``{"doc", "start",
    "length", "key"}`` (start: position in its document; key: its first row in ``keys``); ``keys``: ``(N, hidden)``
    fp16, row ``key + i`` is the state at the passage's position i (i < length - 1), whose value is the
    document's token at ``start + i + 1``."""

    folder: Path
    docs: list[dict]
    passages: list[dict]
    texts: list[str]
    tokens: np.ndarray
    keys: np.ndarray
    report: dict
    _tfidf: tuple | None = field(default=None, repr=False)

    def doc_tokens(self, doc: int) -> np.ndarray:
        d = self.docs[doc]
        return self.tokens[d["start"]: d["start"] + d["length"]]

    def retrieve(self, query: str, top: int) -> list[int]:
        """The ``top`` passages nearest ``query`` by TF-IDF cosine (English stop words out, sublinear tf), best first."""
        if self._tfidf is None:  # fitted once per load, in a few hundred milliseconds
            from sklearn.feature_extraction.text import TfidfVectorizer

            vec = TfidfVectorizer(stop_words="english", sublinear_tf=True)
            self._tfidf = (vec, vec.fit_transform(self.texts))
        vec, matrix = self._tfidf
        scores = (matrix @ vec.transform([query]).T).toarray().ravel()  # rows are L2-normalised: cosine
        return [int(i) for i in np.argsort(-scores, kind="stable")[:top]]


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the passages of an n-token document; a tail shorter than a quarter joins the last."""
    cuts = list(range(0, n, size))
    if len(cuts) > 1 and n - cuts[-1] < size // 4:
        cuts.pop()
    return [(s, (cuts[i + 1] if i + 1 < len(cuts) else n) - s) for i, s in enumerate(cuts)]


def build(folder: Path, model: torch.nn.Module, tokenizer, settings: dict, batch: int = 16) -> dict:
    """Write a datastore for ``model`` into ``folder``; returns its report (documents, passages, tokens, MB)."""
    from tqdm.auto import tqdm

    docs, passages, texts, all_tokens = [], [], [], []
    at = 0
    for doc_id, text in documents(settings["corpus"]):
        # Cut the text before tokenising: no tokenizer packs more than 16 characters into a token here.
        ids = tokenizer(text[: 16 * settings["doc_tokens"]], add_special_tokens=False)["input_ids"][: settings["doc_tokens"]]
        if len(ids) < 2:
            continue
        d = len(docs)
        for start, length in _chunks(len(ids), settings["passage_len"]):
            if length >= 2:
                passages.append({"doc": d, "start": start, "length": length})
                texts.append(tokenizer.decode(ids[start: start + length]))
        docs.append({"id": doc_id, "title": title_of(text), "start": at, "length": len(ids)})
        all_tokens.append(np.asarray(ids, dtype=np.int32))
        at += len(ids)
    if not passages:
        raise BenchError(f"corpus '{settings['corpus']}' gave no passages for the NEST datastore.")
    tokens = np.concatenate(all_tokens)
    rows = 0
    for p in passages:
        p["key"], rows = rows, rows + p["length"] - 1
    hidden = int(model.config.hidden_size)
    keys = np.lib.format.open_memmap(folder / KEYS, mode="w+", dtype=np.float16, shape=(rows, hidden))
    device = next(model.parameters()).device
    order = sorted(range(len(passages)), key=lambda i: -passages[i]["length"])  # similar lengths batch together
    last = len(decoder_layers(model)) - 1  # the keys: the states entering the last layer (the authors' hidden_states[-2])
    with torch.inference_mode(), LayerTaps(model, (last,)) as taps, tqdm(total=rows, desc="nest: datastore keys",
                                                                         unit="tok") as bar:
        for b in range(0, len(order), batch):
            group = [passages[i] for i in order[b: b + batch]]
            width = max(p["length"] for p in group)
            x = torch.zeros(len(group), width, dtype=torch.long)
            for j, p in enumerate(group):
                start = docs[p["doc"]]["start"] + p["start"]
                x[j, : p["length"]] = torch.from_numpy(tokens[start: start + p["length"]].astype(np.int64))
            # Right padding needs no mask: a causal model's states at a position never read later positions.
            lm_forward(model, x.to(device), logits_to_keep=1)
            states = taps.input(last).float().cpu().numpy()
            for j, p in enumerate(group):
                keys[p["key"]: p["key"] + p["length"] - 1] = states[j, : p["length"] - 1]
                bar.update(p["length"] - 1)
    keys.flush()
    del keys
    np.save(folder / TOKENS, tokens)
    (folder / INDEX).write_text(json.dumps({"docs": docs, "passages": passages, "texts": texts}))
    return {"documents": len(docs), "passages": len(passages), "keys": rows, "hidden": hidden,
            "megabytes": round(rows * hidden * 2 / 2**20, 1), **settings}


def load(folder: Path) -> Datastore:
    from core.artifacts import read_manifest

    index = json.loads((folder / INDEX).read_text())
    return Datastore(folder, index["docs"], index["passages"], index["texts"], np.load(folder / TOKENS),
                     np.load(folder / KEYS, mmap_mode="r"), (read_manifest(folder) or {}).get("report") or {})


def datastore_key(pair, settings: dict) -> dict:
    """What a datastore's content depends on: the target's weights, the tokenizer and the build settings."""
    from core.artifacts import model_fingerprint, tokenizer_fingerprint

    return {"target": model_fingerprint(pair.target.module), "tokenizer": tokenizer_fingerprint(pair.tokenizer),
            "keys": "input of the last decoder layer", **settings}


def check_folder(path: str) -> str | None:
    """Why ``path`` is not a built NEST datastore folder (``None`` when it looks like one); read before any model
    loads, so a wrong ``method.datastore`` costs nothing."""
    folder = Path(path).expanduser()
    if not folder.exists():
        return f"{folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    from core.artifacts import read_manifest

    manifest = read_manifest(folder)
    if not isinstance(manifest, dict):
        return f"{folder} has no readable manifest.json (a datastore folder is cache_dir/nest/datastore-<key>)"
    if manifest.get("kind") != "nest" or not isinstance(manifest.get("key"), dict):
        return f"{folder} is not a NEST datastore (its manifest says kind {manifest.get('kind')!r})"
    return None


def open_given(path: str, pair, settings: dict) -> Datastore:
    """The datastore folder ``path`` (``method.datastore``), refused in one sentence when damaged, built for
    another target or tokenizer (its manifest's fingerprints differ from this pair's), or from other build
    ``settings`` (corpus, doc_tokens, passage_len) than the run names, which its records would then misstate."""
    from core.artifacts import problem, read_manifest

    folder = Path(path).expanduser()
    if (why := check_folder(path)) is not None:
        raise BenchError(f"method.datastore: {why}.")
    if (why := problem(folder)) is not None:
        raise BenchError(f"method.datastore: the NEST datastore at {folder} cannot be used ({why}).")
    key, want = read_manifest(folder)["key"], datastore_key(pair, settings)  # as built, and as this run would build
    if key.get("tokenizer") != want["tokenizer"]:
        raise BenchError(f"method.datastore: the NEST datastore at {folder} was built for another tokenizer "
                         f"than pair={pair.name}'s; build one for this pair (leave method.datastore unset).")
    have, target = key.get("target") or {}, want["target"]
    if have.get("weights") != target["weights"]:
        raise BenchError(f"method.datastore: the NEST datastore at {folder} was built for another target "
                         f"({have.get('name')}, weights {have.get('weights')}) than pair={pair.name}'s "
                         f"({target['name']}, weights {target['weights']}); its keys are another model's hidden "
                         "states.")
    differ = {k: key.get(k) for k in settings if key.get(k) != want[k]}
    if differ:
        built = ", ".join(f"method.{k}={v}" for k, v in differ.items())
        raise BenchError(f"method.datastore: the NEST datastore at {folder} was built with {built}; run with the "
                         "same settings or leave method.datastore unset to build one for these.")
    return load(folder)


def load_or_build_datastore(pair, settings: dict, build_if_missing: bool) -> Datastore:
    """The datastore of ``settings`` (corpus, doc_tokens, passage_len) for ``pair``'s target and tokenizer, from
    ``cache_dir/nest/``, built first when missing."""
    from core.artifacts import Artifact, load_or_build

    module = pair.target.module
    art = Artifact("nest", "datastore", datastore_key(pair, settings),
                   lambda folder: build(folder, module, pair.tokenizer, settings), load, version=VERSION,
                   description="NEST datastore")
    return load_or_build(art, pair.cache, build_if_missing)


class TokenIndex:
    """The token keys of one prompt's retrieved passages, on the device, searched exactly (L2).

    ``vals``: ``(M,)`` the token after each key; ``doc`` / ``pos``: where that token sits (document index,
    position in the document): a span continues from there. A copied position is dropped (:meth:`drop`) so
    the same text is not proposed twice, as the authors' code masks used positions.
    """

    def __init__(self, store: Datastore, passages: list[int], device: torch.device):
        rows, doc, pos = [], [], []
        for i in passages:
            p = store.passages[i]
            n = p["length"] - 1
            rows.append(np.arange(p["key"], p["key"] + n))
            doc.append(np.full(n, p["doc"]))
            pos.append(np.arange(p["start"] + 1, p["start"] + 1 + n))
        rows_np = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        self.doc = np.concatenate(doc) if doc else np.zeros(0, dtype=np.int64)
        self.pos = np.concatenate(pos) if pos else np.zeros(0, dtype=np.int64)
        vals = [int(store.tokens[store.docs[d]["start"] + q]) for d, q in zip(self.doc, self.pos)]
        self.vals = torch.tensor(vals, dtype=torch.long, device=device)
        self.keys = torch.from_numpy(np.asarray(store.keys[rows_np], dtype=np.float32)).to(device)  # (M, hidden)
        self.sq = (self.keys**2).sum(-1)
        self.alive = torch.ones(len(vals), dtype=torch.bool, device=device)
        self.where = {(int(d), int(q)): r for r, (d, q) in enumerate(zip(self.doc, self.pos))}

    def __len__(self) -> int:
        return int(self.alive.sum())

    def search(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` nearest live keys of each query ``h (n, hidden)``: ``(squared L2 distances (n, k'),
        rows (n, k'))``, nearest first; k' = min(k, live keys)."""
        h = h.float()
        d2 = (h**2).sum(-1, keepdim=True) + self.sq - 2 * h @ self.keys.T
        d2 = d2.clamp_min(0).masked_fill(~self.alive, float("inf"))
        return torch.topk(d2, min(k, len(self)), dim=-1, largest=False)

    def drop(self, doc: int, pos: int) -> None:
        row = self.where.get((doc, pos))
        if row is not None:
            self.alive[row] = False
