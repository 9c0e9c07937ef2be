"""Hierarchy drafting (HD; Cho et al. 2024, "Lossless Acceleration of Large Language Models with Hierarchical
Drafting based on Temporal Locality in Speculative Decoding"): no draft model. Candidate continuations of
the current text come from three token databases, queried in order of temporal locality until
``num_candidates`` are found:

1. context-dependent: n-grams of the current prompt and of what has been generated for it so far;
2. model-dependent: n-grams of the target's own earlier generations: its greedy answers to packaged
   instructions (``model_db``; generated once by the harness and cached, keyed by the target), the outputs
   of the other prompts decoded by this method in this process, and optionally the outputs in a
   ``records.jsonl`` of an earlier run on the same pair; a prompt's own earlier output is never used, so
   warm-up decodes and repeated prompts do not leak the answer;
3. statistics-dependent: the most frequent continuations of each n-gram of packaged text
   (:class:`decoding.ngram.CorpusNGrams`, built once and cached).

All candidates are verified in ONE target forward: they are merged into a token tree (shared prefixes
once), flattened, and scored with a 4D attention mask in which each node sees the committed text and its
own ancestors only. The target then walks the tree from the root with its own choice at each node (greedy
argmax, or a sample from its distribution): while that choice is a child, the walk goes on. The drafts are
deterministic, so this is exactly the target's own decoding: lossless for greedy and for sampling. The
KV entries of the accepted path are moved next to the committed text and the rest is dropped: the cache
stays consistent without recomputing anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from decoding.corpus import check_corpus
from bench.counting import truncate_cache
from bench.errors import BenchError
from bench.metrics import ratio
from decoding.ngram import NGramIndex, load_corpus_ngrams
from bench.registry import register
from decoding.sampling import next_token
from methods.base import Decoded, Method
from methods.pld import check_ngram_settings

DATABASES = ("context", "model", "statistics")


class TokenTree:
    """Candidate continuations merged into a tree. Node 0 is the root: the pending (last committed) token.

    ``tokens[v]``, ``parent[v]``, ``depth[v]`` (root 0) and ``source[v]`` (the database whose candidate
    first created node v) describe node v; ``children[v]`` maps a token to its child node.
    """

    def __init__(self, root_token: int):
        self.tokens, self.parent, self.depth, self.source = [root_token], [-1], [0], [None]
        self.children: list[dict[int, int]] = [{}]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, candidate: list[int], source: str) -> int:
        """Insert a candidate path below the root; returns the number of new nodes it created."""
        node, new = 0, 0
        for tok in candidate:
            child = self.children[node].get(tok)
            if child is None:
                child = len(self.tokens)
                self.tokens.append(tok)
                self.parent.append(node)
                self.depth.append(self.depth[node] + 1)
                self.source.append(source)
                self.children.append({})
                self.children[node][tok] = child
                new += 1
            node = child
        return new

    def attention_mask(self, past: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Additive mask ``(1, 1, nodes, past + nodes)``: 0 where node i may attend (the committed text, its
        ancestors and itself), the dtype's minimum elsewhere."""
        n = len(self)
        allowed = torch.zeros((n, past + n), dtype=torch.bool)
        allowed[:, :past] = True
        for v in range(n):
            u = v
            while u >= 0:
                allowed[v, past + u] = True
                u = self.parent[u]
        mask = torch.zeros((n, past + n), dtype=dtype)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask.view(1, 1, n, past + n).to(device)


def keep_positions(cache, past: int, nodes: list[int]) -> None:
    """Keep, after the first ``past`` cache positions, only the tree nodes ``nodes`` (in that order): their
    keys and values move to positions ``past, past + 1, ...`` and the rest of the tree is cropped."""
    if nodes != list(range(len(nodes))):  # the common case (a path along the first nodes) needs no move
        src = torch.tensor(nodes, device=cache.layers[0].keys.device) + past
        for layer in cache.layers:
            # The gather on the right is a copy, so overlapping source and destination are safe.
            layer.keys[..., past:past + len(nodes), :] = layer.keys[..., src, :]
            layer.values[..., past:past + len(nodes), :] = layer.values[..., src, :]
    truncate_cache(cache, past + len(nodes))


def load_records_db(path: str, pair_name: str) -> list[tuple[tuple[int, ...], list[int]]]:
    """``(prompt_ids, output_ids)`` of every record of ``pair_name`` in a harness ``records.jsonl``."""
    docs = []
    for line in Path(path).expanduser().read_text().splitlines():
        rec = json.loads(line)
        if rec.get("pair") == pair_name and rec.get("output_ids"):
            docs.append((tuple(rec["prompt_ids"]), list(rec["output_ids"])))
    if not docs:
        raise BenchError(f"method.model_db_file '{path}' holds no outputs of pair '{pair_name}'.")
    return docs


def load_or_build_model_db(pair, settings, build_if_missing: bool) -> list[list[int]]:
    """The target's greedy answers (token ids) to ``settings.prompts`` packaged instructions, cached as JSON
    under ``cache/ngram/`` keyed by the target's weights and ``settings``; generated once when missing."""
    from bench.artifacts import Artifact, load_or_build, model_fingerprint
    from decoding.corpus import instruction_prompts
    from decoding.distill import target_answers

    target = pair.target.module

    def build(folder: Path) -> None:
        prompts = instruction_prompts(int(settings.prompts), int(settings.seed))
        with torch.inference_mode():
            docs = [answer.tolist() for _, answer, _, _ in target_answers(
                target, pair.tokenizer, prompts, int(settings.batch_size), int(settings.max_new_tokens),
                "hierarchy: target answers")]
        (folder / "docs.json").write_text(json.dumps(docs))

    def load(folder: Path) -> list[list[int]]:
        return [list(map(int, d)) for d in json.loads((folder / "docs.json").read_text())]

    art = Artifact("ngram", "model-db", {"target": model_fingerprint(target), "settings": settings}, build, load,
                   description="hierarchy model database")
    return load_or_build(art, pair.cache, build_if_missing)


@register("hierarchy")
class Hierarchy(Method):
    lossless = True

    @classmethod
    def check(cls, cfg) -> None:
        check_ngram_settings(cfg)
        check_ngram_settings(cfg, "stat_max_ngram", "stat_min_ngram")
        for key in ("draft_len", "num_candidates"):
            if int(cfg[key]) < 1:
                raise BenchError(f"method.{key} must be at least 1, got {cfg[key]}.")
        check_corpus(cfg.corpus)
        bad = [db for db in cfg.databases if db not in DATABASES]
        if bad or not cfg.databases:
            raise BenchError(f"method.databases must list some of {', '.join(DATABASES)}, got {list(cfg.databases)}.")
        if int(cfg.model_db.prompts) < 0 or int(cfg.model_db.max_new_tokens) < 1:
            raise BenchError("method.model_db needs prompts >= 0 and max_new_tokens >= 1.")
        path = cfg.get("model_db_file")
        if path and not Path(str(path)).expanduser().is_file():
            raise BenchError(f"method.model_db_file '{path}' does not exist.")

    def setup(self, train_if_missing: bool = True) -> None:
        self.check(self.cfg)
        cfg = self.cfg
        self.stats = None
        if "statistics" in cfg.databases:
            self.stats = load_corpus_ngrams(self.pair.tokenizer, cfg.corpus, int(cfg.stat_min_ngram),
                                            int(cfg.stat_max_ngram), int(cfg.draft_len), int(cfg.num_candidates),
                                            self.pair.cache)
        # The model-dependent database: outputs of earlier decodes, keyed by their prompt.
        self.history: dict[tuple[int, ...], list[int]] = {}
        self.file_docs = load_records_db(cfg.model_db_file, self.pair.name) if cfg.get("model_db_file") else []
        if "model" in cfg.databases and int(cfg.model_db.prompts) > 0:
            self.file_docs += [((), doc) for doc in load_or_build_model_db(self.pair, cfg.model_db, train_if_missing)]

    def model_index(self, prompt: tuple[int, ...]) -> NGramIndex | None:
        """An index over the target's outputs for every prompt but ``prompt`` (rebuilt per decode: small)."""
        docs = [out for p, out in self.file_docs if p != prompt]
        docs += [out for p, out in self.history.items() if p != prompt]
        if not docs:
            return None
        index = NGramIndex(int(self.cfg.min_ngram), int(self.cfg.max_ngram))
        for doc in docs:
            index.add_document(doc)
        return index

    def decode(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens) -> Decoded:
        cfg, target, device = self.cfg, self.pair.target, prompt_ids.device
        draft_len, n_cand = int(cfg.draft_len), int(cfg.num_candidates)
        prompt = tuple(prompt_ids[0].tolist())
        seq = list(prompt)
        context = NGramIndex(int(cfg.min_ngram), int(cfg.max_ngram))
        context.add_document(seq)
        model_db = self.model_index(prompt) if "model" in cfg.databases else None
        dbs = {"context": context if "context" in cfg.databases else None, "model": model_db, "statistics": self.stats}
        order = [name for name in cfg.databases if dbs[name] is not None]
        figures = {name: {"lookups": 0, "hits": 0, "proposed": 0, "accepted": 0} for name in cfg.databases}

        cache, _, seq, out, done = self.prefill(prompt_ids, max_new_tokens, sampling, generator, on_tokens)
        context.extend(out)
        accept_lengths, drafted = [], []
        while not done:
            # Never draft past the token budget: the target's own token fills the last slot.
            k = min(draft_len, max_new_tokens - len(out) - 1)
            tree = TokenTree(seq[-1])
            found = 0
            for name in order if k > 0 else ():
                if found >= n_cand:
                    break
                cands = dbs[name].continuations(seq, k, limit=n_cand - found)
                figures[name]["lookups"] += 1
                figures[name]["hits"] += bool(cands)
                for cand in cands:
                    new = tree.add(cand, name)
                    figures[name]["proposed"] += new
                    found += new > 0
            # One target forward scores the root and every node; positions follow each node's depth.
            past = cache.get_seq_length()
            ids = torch.tensor([tree.tokens], device=device)
            positions = torch.tensor([tree.depth], device=device) + past
            mask = tree.attention_mask(past, self.pair.dtype, device)
            logits = target(ids, cache, attention_mask=mask, position_ids=positions).logits[0]
            # Walk the tree with the target's own choice: go on while it is a drafted child.
            node, path = 0, []
            while True:
                choice = int(next_token(logits[node], sampling, generator))
                child = tree.children[node].get(choice)
                if child is None:
                    break
                path.append(child)
                figures[tree.source[child]]["accepted"] += 1
                node = child
            committed = [tree.tokens[v] for v in path] + [choice]
            keep_positions(cache, past, [0, *path])  # the root and the accepted path; the new token is pending
            seq.extend(committed)
            context.extend(committed)
            out.extend(committed)
            accept_lengths.append(len(committed))
            drafted.append(max(tree.depth))  # the longest candidate: what one chain of the tree could gain
            before = len(out)
            out, done = self.finish(out, max_new_tokens)
            on_tokens(len(committed) - (before - len(out)))
        self.history[prompt] = list(out)
        for fig in figures.values():
            fig["hit_rate"] = ratio(fig["hits"], fig["lookups"])  # lookups that returned a candidate
            fig["accept_rate"] = ratio(fig["accepted"], fig["proposed"])  # tree nodes it added that were kept
        extra = {
            "databases": figures,
            "tree_nodes": ratio(sum(f["proposed"] for f in figures.values()), len(accept_lengths)),  # per call
        }
        return Decoded(out, accept_lengths=accept_lengths, drafted=drafted, extra=extra)
