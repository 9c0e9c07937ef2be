"""Real text that packages ship, used to train drafts, heads and verifiers offline.

- gensim's test data: the Lee news corpus (300 background articles + 50 test articles) and a shortened
  English Wikipedia dump (about 5.7 M characters of wiki markup).
"""

from __future__ import annotations

import bz2
import importlib.util
import re
from functools import cache
from pathlib import Path
from typing import Literal, get_args

from core.errors import BenchError


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


Instructions = Literal["news+wiki", "mixed"]  # which instructions the teacher store's answers follow


def instruction_prompts(n: int, seed: int = 0, split: str | None = None, mix: str = "news+wiki") -> list[str]:
    """``n`` varied instructions for the target to answer (self-distillation).

    ``news+wiki``: tasks on packaged text, Lee *background* articles (the benchmark's news prompts use the
    held-out ``test`` articles) and the Wikipedia extract. GSM8K is left out on purpose: the benchmark draws its
    math prompts there. ``mixed``: those for two slots in five, and one each of the kinds the benchmark's other
    prompts are (:func:`mixed_kinds`): advice and messages (conversation), explaining a topic (open QA), and
    arithmetic word problems solved step by step (maths), none of them a benchmark prompt.
    ``split``: ``train`` or ``test`` builds them from that split's articles only (Lee train / test, the wiki
    extract's first nine tenths / last tenth; every tenth of the written kinds), so a held-out evaluation never
    reads training text; ``None`` (hierarchy's model database, the scripts): Lee background and every wiki
    article, as before.
    """
    import random

    rng = random.Random(seed)
    packaged = _packaged_tasks(rng, split)
    if mix == "news+wiki":
        return packaged[:n]
    kinds = mixed_kinds(random.Random(seed + 1), split)
    pools = {"packaged": iter(packaged), **{name: iter(items) for name, items in kinds.items()}}
    order = ["packaged", "conversation", "packaged", "qa", "math"]  # two in five on packaged text
    out: list[str] = []
    while len(out) < n and pools:
        for name in order:
            item = next(pools[name], None) if name in pools else None
            if item is None:
                pools.pop(name, None)
                continue
            out.append(item)
    return out[:n]


def _packaged_tasks(rng, split: str | None) -> list[str]:
    """Tasks on Lee articles and Wikipedia passages (summaries, questions on a passage, ...), shuffled."""
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
    return pool


# -------------------------------------------------------------------- instructions of the benchmark's other kinds
# Written for the store, so that its answers cover what the benchmark asks beyond packaged text. None is a
# benchmark prompt: the default prompts' own topics (making friends in a new city, houseplants, thanking a
# colleague; the sky's colour, viruses and bacteria, refrigerators) are left out, and the maths is generated.

GOALS = (
    "learn to play the guitar", "run my first 10k race", "save money for a trip", "cook healthier meals",
    "get better sleep", "learn Spanish", "start a vegetable garden", "read more books", "organise my small apartment",
    "prepare for a job interview", "get better at public speaking", "start a small online business",
    "keep a daily journal", "learn to swim as an adult", "train my puppy", "reduce my screen time",
    "plan a birthday party on a budget", "study for exams more effectively", "learn to draw",
    "stay productive when working from home", "bake bread at home", "get back into exercise after an injury",
    "write a short story", "learn basic car maintenance", "stop procrastinating", "make my mornings calmer",
    "learn to code in Python", "take better photos with my phone", "waste less food at home",
    "ask my manager for a raise", "teach my child to ride a bike", "volunteer in my community", "learn chess",
    "travel alone for the first time", "meditate regularly", "eat less sugar", "paint my bedroom",
    "negotiate my rent", "become a better listener", "keep in touch with old friends",
)
CONVERSATION = (
    "I want to {}. Where should I start?",
    "My friend is trying to {} and asked me for tips. What should I tell them?",
    "I have been trying to {} for months without much progress. What might I be doing wrong?",
    "Write a short, encouraging message to a friend who wants to {}.",
    "What are three common mistakes people make when they try to {}?",
)
TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "earthquakes", "black holes", "the immune system",
    "vaccines", "electricity", "magnets", "the phases of the moon", "ocean tides", "climate change",
    "the greenhouse effect", "DNA", "evolution", "gravity", "the internet", "solar panels", "batteries",
    "rainbows", "the human heart", "antibiotics", "inflation", "democracy", "the Roman Empire",
    "the printing press", "the stock market", "recycling", "plate tectonics", "the speed of light", "sound waves",
    "the seasons", "clouds", "pollination", "digestion", "nuclear power", "how airplanes fly", "GPS",
    "compound interest", "the periodic table",
)
QA = (
    "What is {}? Explain it simply.",
    "Explain {} in a few sentences.",
    "What should everyone know about {}?",
    "Give a beginner a simple explanation of {}.",
)
NAMES = ("Maria", "Tom", "Aisha", "Kenji", "Lucas", "Priya", "Sam", "Elena", "Omar", "Grace")


def _word_problem(rng) -> str:
    """One arithmetic word problem (two or three steps) with fresh numbers, as the benchmark's maths prompts end."""
    name, other = rng.sample(NAMES, 2)
    r = rng.randint
    kind = r(0, 7)
    if kind == 0:
        q = (f"{name} has {r(5, 40)} stickers and buys {r(2, 6)} packs of {r(5, 12)} stickers each, then gives "
             f"{r(3, 15)} to {other}. How many stickers does {name} have now?")
    elif kind == 1:
        q = (f"A shop sells notebooks for ${r(2, 9)} each. {name} buys {r(2, 8)} of them and pays with a $100 bill. "
             f"How much change does {name} get back?")
    elif kind == 2:
        q = (f"A train travels at {r(40, 120)} km per hour for {r(2, 5)} hours, then at {r(40, 120)} km per hour for "
             f"{r(1, 4)} more hours. How far does it travel in total?")
    elif kind == 3:
        per_day = r(10, 40)
        q = (f"{name} reads {per_day} pages a day. The book has {per_day * r(8, 20) + r(0, 30)} pages. How many pages "
             f"are left after {r(3, 7)} days?")
    elif kind == 4:
        q = (f"{r(1, 9) * 10}% of the {r(2, 10) * 20} students in a school walk to school. How many students do not "
             "walk to school?")
    elif kind == 5:
        q = (f"{name} earns ${r(12, 30)} an hour and works {r(10, 40)} hours a week. How much does {name} earn in "
             f"{r(2, 6)} weeks?")
    elif kind == 6:
        batch = r(2, 4) * 6
        q = (f"A recipe needs {r(2, 5)} cups of flour for {batch} cookies. How many cups are needed for "
             f"{batch * r(2, 5)} cookies?")
    else:
        q = (f"{name} is {r(6, 15)} years old. {other} is {r(2, 9)} years older than twice {name}'s age. How old will "
             f"{other} be in {r(2, 10)} years?")
    return f"{q}\nSolve it step by step, then give the final answer."


def mixed_kinds(rng, split: str | None) -> dict[str, list[str]]:
    """``{"conversation", "qa", "math"}`` -> instructions of that kind, shuffled; ``split`` ``test`` keeps every
    tenth of each list as written (so a held-out advice request is one template's, on a goal the train split
    asks about in other words), ``train`` the rest, ``None`` all."""
    def part(items: list[str]) -> list[str]:
        if split is None:
            kept = items
        else:
            kept = [x for i, x in enumerate(items) if (i % 10 == 9) == (split == "test")]
        rng.shuffle(kept)
        return kept

    import random

    # The problems come from their own generator, before any shuffle: both splits cut the same list.
    problems = random.Random(0)
    written = {
        "conversation": [t.format(goal) for goal in GOALS for t in CONVERSATION],
        "qa": [t.format(topic) for topic in TOPICS for t in QA],
        "math": list(dict.fromkeys(_word_problem(problems) for _ in range(2000))),  # each problem once
    }
    return {name: part(items) for name, items in written.items()}


def _wiki_plain(text: str) -> str:
    """Wiki text without what gensim's filter leaves in: bold and italic quote marks (\'\'\'Autism\'\'\' -> Autism)
    and section headings (==History==)."""
    text = re.sub(r"={2,}[^=]{1,80}={2,}", " ", text.replace("\'\'\'", "").replace("\'\'", ""))
    return " ".join(text.split())


@cache
def wiki_documents() -> tuple[tuple[str, str], ...]:
    """``(doc_id, text)`` of every article of gensim's Wikipedia extract (``core.corpus.wiki_articles``), as
    plain text; ids ``wiki-<i>`` in the extract's order. The last tenth is the held-out split, as in
    ``core.corpus.corpus``. NEST's datastore reads the same ids, so its citations name these articles."""
    return tuple((f"wiki-{i}", _wiki_plain(text)) for i, text in enumerate(wiki_articles()))
