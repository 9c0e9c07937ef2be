"""The training-free drafters' n-gram tables (decoding/ngram.py): the growing index, the corpus tables, caching."""

from types import SimpleNamespace

import pytest

from core.corpus import corpus
from core.errors import BenchError
from decoding.ngram import (
    BigramTable,
    CorpusNGrams,
    NGramIndex,
    corpus_token_docs,
    load_bigram_table,
    load_corpus_ngrams,
    ngram_sizes,
)


def test_ngram_index_longest_match_most_recent_first_within_documents():
    index = NGramIndex(1, 3)
    index.add_document([1, 2, 3, 4, 9, 2, 3, 5, 6])
    assert index.continuations([7, 2, 3], 2) == [[5, 6]]  # the 2-gram (2, 3): its most recent occurrence
    assert index.continuations([7, 2, 3], 2, limit=3) == [[5, 6], [4, 9]]  # then the older one
    assert index.continuations([1, 2, 3], 3, limit=1) == [[4, 9, 2]]  # the 3-gram wins over the 2-gram
    assert index.continuations([8], 2) == []
    index.add_document([6, 1])
    assert index.continuations([5, 6], 4, limit=2) == [[1]]  # the (5, 6) match stops at the document end
    index.extend([8, 8])
    assert index.continuations([6, 1], 4) == [[8, 8]]  # the last document keeps growing
    with pytest.raises(BenchError, match="1 <= min <= max"):
        NGramIndex(3, 2)


def test_ngram_sizes_refuse_a_minimum_above_the_maximum():
    node = SimpleNamespace(min_ngram=2, max_ngram=2, stat_min_ngram=3, stat_max_ngram=1)
    assert ngram_sizes(node) is node  # min == max is allowed; the node comes back
    with pytest.raises(ValueError, match=r"^stat_min_ngram \(3\) must not exceed stat_max_ngram \(1\)\.$"):
        ngram_sizes(node, "stat_min_ngram", "stat_max_ngram")


def test_corpus_tables_count_and_round_trip():
    docs = [[1, 2, 3, 1, 2, 4, 1, 2, 3], [5, 1, 2, 3]]
    table = CorpusNGrams.build(docs, 1, 2, length=2, top=2)
    assert table.continuations([9, 1, 2], 2, limit=2) == [[3, 1], [4, 1]]  # (3, 1) follows (1, 2) most often
    again = CorpusNGrams.from_tensors(table.to_tensors())
    assert again.table == table.table
    bigram = BigramTable.build(docs, vocab_size=10)
    assert bigram.chain(1, 3) == [2, 3, 1]
    assert bigram.next[7] == 1  # never seen: the most frequent token


def test_corpus_table_is_cached_and_a_corrupt_cache_is_rebuilt(tiny_pair, tmp_path):
    load = lambda: load_corpus_ngrams(tiny_pair.tokenizer, "lee", 1, 1, 2, 1, tmp_path)  # noqa: E731
    first = load()
    [path] = list(tmp_path.glob("ngram/ngrams-*/table.pt"))
    stamp = path.stat().st_mtime_ns
    assert load().table == first.table and path.stat().st_mtime_ns == stamp  # from the cache
    path.write_bytes(path.read_bytes()[:100])
    assert load().table == first.table  # tables are always built when missing: a truncated one is rebuilt
    assert path.stat().st_mtime_ns != stamp


def test_the_bigram_table_is_the_tokenised_corpus_s_and_cached_per_vocabulary(tiny_pair, tmp_path):
    tok, vocab = tiny_pair.tokenizer, tiny_pair.target.module.config.vocab_size
    docs, texts = corpus_token_docs(tok, "lee"), corpus("lee", "train")
    assert len(docs) == len(texts) > 0  # one token list per training document, in order, no special tokens
    assert [tok.decode(d) for d in docs[:5]] == list(texts[:5])
    table = load_bigram_table(tok, vocab, "lee", tmp_path)
    assert table.next == BigramTable.build(docs, vocab).next
    [path] = list(tmp_path.glob("ngram/bigram-*/table.pt"))
    stamp = path.stat().st_mtime_ns
    assert load_bigram_table(tok, vocab, "lee", tmp_path).next == table.next  # from the cache
    assert path.stat().st_mtime_ns == stamp
    assert len(load_bigram_table(tok, vocab + 1, "lee", tmp_path).next) == vocab + 1  # another size: another table
    assert len(list(tmp_path.glob("ngram/bigram-*/table.pt"))) == 2
