"""REST (methods/rest.py) on the tiny pair: retrieval from its datastores, and bad settings. The suffix array and
the draft trie themselves (decoding/suffix_array.py) are tested in tests/decoding/test_suffix_array.py."""

import dataclasses
import json

import numpy as np
import pytest

from core.errors import BenchError
from decoding.suffix_array import continuations, match_range
from methods.registry import get_method
from tests.helpers import assert_greedy_equal_to_ar, build, prompts_for, repeating_prompt, run


@pytest.fixture()
def pair(tiny_pair):
    return dataclasses.replace(tiny_pair, roles={})


@pytest.fixture()
def looping_file(pair, tmp_path):
    """A datastore holding the looping text (and ar's continuation of it): retrieval finds the loop."""
    from tests.helpers import decode

    ids = repeating_prompt(pair)
    ids += decode(pair, "ar", ids, max_new=40).output_ids
    path = tmp_path / "store.jsonl"
    path.write_text(json.dumps({"text": pair.tokenizer.decode(ids)}) + "\n")
    return path


def test_rest_equals_ar_and_drafts_from_its_datastore(pair, looping_file):
    method = build(pair, "rest", datastore=str(looping_file), choices=6)
    ids = repeating_prompt(pair)
    out = run(method, ids, 24)
    assert out.extra["retrieved"] >= 0.5 and max(out.accept_lengths) > 1  # the loop is found and accepted
    assert out.extra["tree_tokens_per_call"] <= 7
    assert_greedy_equal_to_ar(method, [ids, *prompts_for(pair, 2)], max_new=24)
    assert method.report["tokens"] > 0 and method.report["documents"] == 1


def test_the_packaged_datastore_decodes_as_ar(pair):
    method = build(pair, "rest")  # lee+wiki, as the registry walk runs it
    assert method.report["documents"] > 300
    assert_greedy_equal_to_ar(method, prompts_for(pair, 2), max_new=16)


def test_the_targets_own_answers_are_a_datastore(pair):
    """``answers``: the answers sequences of the run's teacher store (the smoke recipe's here), so the method now
    depends on the recipe (records name it) and decodes as ``ar``."""
    from methods.rest import answer_ids

    method = build(pair, "rest", datastore="answers")
    store = pair.teacher.store(pair.target.module, pair.tokenizer, "train")
    assert method.report["tokens"] == sum(len(a) for a in answer_ids(store)) > 0
    assert type(method).trains(pair.spec, method.cfg) and not type(method).trains(pair.spec, build(pair, "rest").cfg)
    assert_greedy_equal_to_ar(method, prompts_for(pair, 2), max_new=16)


def test_a_changed_file_is_a_new_datastore(pair, looping_file):
    first = build(pair, "rest", datastore=str(looping_file))
    looping_file.write_text(json.dumps("another text entirely") + "\n")
    second = build(pair, "rest", datastore=str(looping_file))
    assert second.report["tokens"] != first.report["tokens"]


def test_retrieval_finds_the_longest_suffix_in_the_datastore(pair, looping_file):
    """The binary search over suffix lengths gives what trying them longest first gives: the longest suffix of
    ``min_span`` .. ``max_span`` tokens that occurs in the datastore, and its continuations."""
    method = build(pair, "rest", datastore=str(looping_file), min_span=2, max_span=12)
    tokens, sa = method.tokens, method.sa
    rng = np.random.default_rng(0)
    starts, lengths, noise = rng.integers(0, len(tokens) - 20, 60), rng.integers(1, 16, 60), rng.integers(0, 3, 60)
    contexts = [tokens[i : i + n].tolist() + [int(t) for t in rng.integers(0, 250, k)]
                for i, n, k in zip(starts, lengths, noise)]
    spans = set()
    for context in contexts:
        longest = next((s for s in range(min(12, len(context)), 1, -1)
                        if np.diff(match_range(tokens, sa, context[-s:]))[0] > 0), 0)
        span, rows = method.retrieve(context)
        assert span == longest
        if span:
            want = continuations(tokens, sa, match_range(tokens, sa, context[-span:]), span, method.cfg.long)
            assert np.array_equal(rows, want[: method.cfg.matches])
        spans.add(span)
    assert 0 in spans and len(spans) >= 4  # no match, and matches of several lengths


@pytest.mark.parametrize("over, words", [
    ({"min_span": 5, "max_span": 3}, "min_span (5) must not exceed max_span (3)"),
    ({"datastore": "/nowhere/store.txt"}, "neither a packaged corpus (lee, wiki, lee+wiki), answers, nor a file"),
    ({"choices": 0}, "method.choices=0 is not allowed"),
])
def test_bad_settings_are_one_sentence(over, words):
    with pytest.raises(BenchError) as err:
        get_method("rest").check_settings(over)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_bad_datastore_file_is_one_sentence(pair, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"other": 1}\n')
    with pytest.raises(BenchError, match=r"bad.jsonl, line 2, has no text"):
        build(pair, "rest", datastore=str(path))
    path.write_text("not json\n")
    with pytest.raises(BenchError, match=r"line 1, is not JSON"):
        build(pair, "rest", datastore=str(path))
