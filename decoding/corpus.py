"""Real text that packages ship, used to train drafts, heads and verifiers offline.

- gensim's test data: the Lee news corpus (300 background articles + 50 test articles) and a shortened
  English Wikipedia dump (about 5.7 M characters of wiki markup).
"""

from __future__ import annotations

import bz2
import importlib.util
from functools import cache
from pathlib import Path
from typing import Literal, get_args

from bench.errors import BenchError


def gensim_test_data() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("package 'gensim' is not installed; it ships the training text (run scripts/setup.sh).")
    return Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data"


@cache
def lee_articles(split: str = "train") -> tuple[str, ...]:
    """Lee news articles: ``train`` = the 300 background articles, ``test`` = the 50 held-out ones."""
    name = {"train": "lee_background.cor", "test": "lee.cor"}[split]
    lines = (gensim_test_data() / name).read_text(encoding="utf-8", errors="replace").splitlines()
    return tuple(line.strip() for line in lines if line.strip())


@cache
def wiki_articles(limit: int = 200, min_chars: int = 2000) -> tuple[str, ...]:
    """Plain text of the first ``limit`` long articles of gensim's shortened English Wikipedia dump."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = gensim_test_data() / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    out = []
    with bz2.open(path, "rb") as fh:
        for _title, text, _pageid in extract_pages(fh):
            plain = " ".join(filter_wiki(text).split())
            if len(plain) >= min_chars:
                out.append(plain)
            if len(out) >= limit:
                break
    return tuple(out)


Corpus = Literal["lee", "wiki", "lee+wiki"]  # the packaged corpora, as a settings type
CORPORA = get_args(Corpus)


def corpus(name: str, split: str = "train") -> tuple[str, ...]:
    """Documents of a named corpus: ``lee``, ``wiki`` or ``lee+wiki``."""
    parts = name.split("+")
    docs: list[str] = []
    for part in parts:
        if part == "lee":
            docs.extend(lee_articles(split))
        elif part == "wiki":
            wiki = wiki_articles()
            cut = int(len(wiki) * 0.9)  # the last tenth is held out
            docs.extend(wiki[:cut] if split == "train" else wiki[cut:])
        else:
            raise BenchError(f"unknown training corpus '{part}'; use lee, wiki or lee+wiki.")
    return tuple(docs)


def _sentences(text: str, n: int) -> str:
    return " ".join(text.split(". ")[:n]).strip()


def instruction_prompts(n: int, seed: int = 0, split: str | None = None) -> list[str]:
    """``n`` varied instructions built from packaged text, for the target to answer (self-distillation).

    Sources: Lee *background* articles (the benchmark's news prompts use the held-out ``test`` articles)
    and the Wikipedia extract. GSM8K is left out on purpose: the benchmark draws its math prompts there.
    ``split``: ``train`` or ``test`` builds them from that split's articles only (Lee train / test, the wiki
    extract's first nine tenths / last tenth), so a held-out evaluation never reads training text;
    ``None`` (hierarchy's model database, the scripts): Lee background and every wiki article, as before.
    """
    import random

    rng = random.Random(seed)
    articles = [a[:900] for a in lee_articles(split or "train")]
    wiki = [w[:700] for w in (corpus("wiki", split) if split else wiki_articles())]
    templates = [
        lambda a: f"Summarize the following news article in three sentences.\n\n{a}",
        lambda a: f"What are the main points of this text?\n\n{a}",
        lambda a: f"Write a short headline for this news story:\n\n{a}",
        lambda a: f"Passage: {a}\n\nQuestion: According to the passage, what happened and who was involved?",
        lambda a: f"Translate into French: {_sentences(a, 1)}",
        lambda a: f"Explain this to a ten-year-old: {_sentences(a, 2)}",
        lambda a: f"Write a friendly email to a colleague about this news: {_sentences(a, 2)}",
        lambda a: f"Give three questions a reader might ask after reading this:\n\n{a}",
    ]
    wiki_templates = [
        lambda w: f"Explain the following passage in simple terms.\n\n{w}",
        lambda w: f"What is this text about? Answer in a few sentences.\n\n{w}",
        lambda w: f"{_sentences(w, 1)}. Tell me more about this topic.",
        lambda w: f"Write a short quiz question with its answer based on this text:\n\n{w}",
    ]
    pool = [t(a) for a in articles for t in templates] + [t(w) for w in wiki for t in wiki_templates]
    rng.shuffle(pool)
    return pool[:n]
