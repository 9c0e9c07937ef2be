"""Hierarchy drafting (HD; Cho et al. 2024, "Lossless Acceleration of Large Language Models with Hierarchical
Drafting based on Temporal Locality in Speculative Decoding"): no draft model. Candidate continuations of
the current text come from three token databases, queried in order of temporal locality until
``num_candidates`` are found:

1. context-dependent: n-grams of the current prompt and of what has been generated for it so far;
2. model-dependent: n-grams of the target's own generations: its greedy answers to packaged instructions
   (``model_db``; generated once by the harness and cached, keyed by the target) and, optionally, the outputs
   in a ``records.jsonl`` of an earlier run on the same pair (``model_db_file``; a prompt's own earlier output
   is never used). The paper's database also grows with the outputs of earlier prompts; here it does not,
   so a prompt's result does not depend on which prompts ran before it (order, resume, sweeps);
3. statistics-dependent: the most frequent continuations of each n-gram of packaged text
   (:class:`decoding.ngram.CorpusNGrams`, built once and cached).

All candidates are merged into one token tree (:class:`decoding.tree.Tree`, shared prefixes once) and
scored in ONE target forward; the shared tree verifier walks it with the target's own choice (greedy), or
with recursive rejection sampling over one-hot candidates (sampling): lossless either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, get_args

import torch
from pydantic import Field, field_validator, model_validator

from core import files
from core.corpus import Corpus
from core.errors import BenchError
from core.metrics import ratio
from core.schema import Settings
from decoding.ngram import CorpusNGrams, NGramIndex, load_corpus_ngrams, ngram_sizes
from decoding.tree import Tree
from methods.base import DraftVerify, MethodSettings, PromptState, Proposal
from methods.registry import register

Database = Literal["context", "model", "statistics"]
DATABASES = get_args(Database)


def load_records_db(path: str, pair_name: str) -> list[tuple[tuple[int, ...], list[int]]]:
    """``(prompt_ids, output_ids)`` of every record of ``pair_name`` in a harness ``records.jsonl``."""
    docs = []
    for rec in files.read_results_file(Path(path).expanduser()):  # checked: one sentence on a bad file
        if rec.get("pair") == pair_name and rec.get("output_ids"):
            docs.append((tuple(rec["prompt_ids"]), list(rec["output_ids"])))
    if not docs:
        raise BenchError(f"method.model_db_file '{path}' holds no outputs of pair '{pair_name}'.")
    return docs


def load_or_build_model_db(pair, settings, build_if_missing: bool) -> list[list[int]]:
    """The target's greedy answers (token ids) to ``settings.prompts`` packaged instructions, cached as JSON
    under ``cache/ngram/`` keyed by the target's weights and ``settings``; generated once when missing."""
    from core.artifacts import Artifact, load_or_build, model_fingerprint
    from core.corpus import instruction_prompts
    from training.labelling import target_answers

    target = pair.target.module

    def build(folder: Path) -> None:
        prompts = instruction_prompts(settings.prompts, settings.seed)
        with torch.inference_mode():
            docs = [answer.tolist() for _, answer, _, _ in target_answers(
                target, pair.tokenizer, prompts, settings.batch_size, settings.max_new_tokens,
                "hierarchy: target answers")]
        (folder / "docs.json").write_text(json.dumps(docs))

    def load(folder: Path) -> list[list[int]]:
        return [list(map(int, d)) for d in json.loads((folder / "docs.json").read_text())]

    art = Artifact("ngram", "model-db", {"target": model_fingerprint(target), "settings": settings}, build, load,
                   description="hierarchy model database")
    return load_or_build(art, pair.cache, build_if_missing)


class ModelDB(Settings):
    """Hierarchy's model database: the target's own answers to packaged instructions."""

    prompts: int = Field(32, ge=0, description="how many answers (0: none; the in-process history and "
                         "model_db_file still count)")
    max_new_tokens: int = Field(128, ge=1, description="tokens per answer at most")
    batch_size: int = Field(16, ge=1, description="answers generated per batch")
    seed: int = Field(0, ge=0, description="which instructions are drawn")


@register("hierarchy")
class Hierarchy(DraftVerify):
    lossless = True

    class Config(MethodSettings):
        databases: list[Database] = Field(list(DATABASES), min_length=1,
                                          description="queried in this order until num_candidates are found")
        num_candidates: int = Field(6, ge=1, description="candidate continuations per target call at most")
        draft_len: int = Field(6, ge=1, description="tokens per candidate at most")
        max_ngram: int = Field(3, ge=1, description="context and model databases: longest n-gram matched first ...")
        min_ngram: int = Field(1, ge=1, description="... down to this one")
        stat_max_ngram: int = Field(2, ge=1, description="statistics database: longest n-gram of its table")
        stat_min_ngram: int = Field(1, ge=1, description="statistics database: shortest n-gram of its table")
        corpus: Corpus = Field("lee", description="packaged text of the statistics database")
        model_db: ModelDB = Field(default_factory=lambda: ModelDB(), description="the target's greedy answers "
                                  "to packaged instructions, generated once and cached")
        model_db_file: str | None = Field(None, description="optional records.jsonl of an earlier run on the same "
                                          "pair: its outputs join the model database")

        @model_validator(mode="after")
        def sizes(self):
            ngram_sizes(self)
            return ngram_sizes(self, "stat_min_ngram", "stat_max_ngram")

        @field_validator("databases")
        @classmethod
        def each_once(cls, databases):
            if len(set(databases)) < len(databases):
                raise ValueError(f"databases lists one twice: {databases}.")
            return databases

        @field_validator("model_db_file")
        @classmethod
        def records_file(cls, path):
            """A finished records.jsonl of this harness (read now: before any model loads)."""
            if path:
                try:
                    files.read_results_file(Path(path).expanduser())
                except BenchError as err:
                    raise ValueError(str(err)) from None
            return path

    def setup(self, train_if_missing: bool = True) -> None:
        cfg = self.cfg
        self.stats = None
        if "statistics" in cfg.databases:
            self.stats = load_corpus_ngrams(self.pair.tokenizer, cfg.corpus, cfg.stat_min_ngram, cfg.stat_max_ngram,
                                            cfg.draft_len, cfg.num_candidates, self.pair.cache)
        # The model-dependent database: (prompt, output) of the target's earlier generations.
        self.model_docs: list[tuple[tuple[int, ...], list[int]]] = []
        if "model" in cfg.databases:
            if cfg.model_db_file:
                self.model_docs += load_records_db(cfg.model_db_file, self.pair.name)
            if cfg.model_db.prompts > 0:
                self.model_docs += [((), doc) for doc in load_or_build_model_db(self.pair, cfg.model_db, train_if_missing)]
        self.shared_index = self.index_of([out for _, out in self.model_docs])  # for prompts with no document

    def index_of(self, docs: list[list[int]]) -> NGramIndex | None:
        if not docs:
            return None
        index = NGramIndex(self.cfg.min_ngram, self.cfg.max_ngram)
        for doc in docs:
            index.add_document(doc)
        return index

    def model_index(self, prompt: tuple[int, ...]) -> NGramIndex | None:
        """An index over the target's outputs for every prompt but ``prompt``; the same for any prompt order.
        Built once, in setup, for every prompt that has no document of its own."""
        if not any(p == prompt for p, _ in self.model_docs):
            return self.shared_index
        return self.index_of([out for p, out in self.model_docs if p != prompt])

    class State(PromptState):
        """One prompt's databases, in query order, and what each of them found and got accepted."""

        context: NGramIndex  # n-grams of the prompt and its output so far
        dbs: dict[str, NGramIndex | CorpusNGrams]
        tally: dict[str, dict[str, int]]  # per database: lookups, hits, proposed, accepted

    def start(self, state: State) -> None:
        cfg = self.cfg
        state.context = NGramIndex(cfg.min_ngram, cfg.max_ngram)
        state.context.add_document(state.seq)
        model = self.model_index(tuple(state.seq)) if "model" in cfg.databases else None
        dbs = {"context": state.context if "context" in cfg.databases else None, "model": model, "statistics": self.stats}
        state.dbs = {name: dbs[name] for name in cfg.databases if dbs[name] is not None}  # in query order
        state.tally = {name: {"lookups": 0, "hits": 0, "proposed": 0, "accepted": 0} for name in cfg.databases}

    def propose(self, state: State) -> Proposal:
        state.context.extend(state.seq[len(state.context):])  # what was committed since the last step
        k, n_cand = min(self.cfg.draft_len, state.draft_budget), self.cfg.num_candidates
        tree, found = Tree(state.seq[-1]), 0
        for name, db in state.dbs.items() if k > 0 else ():
            if found >= n_cand:
                break
            cands = db.continuations(state.seq, k, limit=n_cand - found)
            state.tally[name]["lookups"] += 1
            state.tally[name]["hits"] += bool(cands)
            for cand in cands:
                new = tree.add(cand, name)
                state.tally[name]["proposed"] += new
                found += new > 0
        return Proposal(tree)

    def accepted(self, state: State, proposal: Proposal, path: list[int], hidden) -> None:
        for v in path[1:]:
            state.tally[proposal.tree.source[v]]["accepted"] += 1

    def extra(self, state: State) -> dict:
        for fig in state.tally.values():
            fig["hit_rate"] = ratio(fig["hits"], fig["lookups"])  # lookups that returned a candidate
            fig["accept_rate"] = ratio(fig["accepted"], fig["proposed"])  # tree nodes it added that were kept
        return {
            "databases": state.tally,
            "tree_nodes": ratio(sum(f["proposed"] for f in state.tally.values()), len(state.accept_lengths)),  # per call
        }
