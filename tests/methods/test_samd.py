"""SAM-Decoding (methods/samd.py) and its suffix automaton (decoding/suffix_automaton.py): matches and positions
against a brute-force search, incremental growth against a build from scratch, the authors' rule for who drafts,
per-prompt automata, and bad settings. Greedy equality with ar and the sampling distribution of the defaults
are checked for every method by tests/methods/test_methods.py; here the other drafters too."""

import random

import pytest

from core.errors import BenchError
from decoding.suffix_automaton import SEP, SuffixAutomaton
from methods.registry import get_method
from tests.helpers import (
    assert_greedy_equal_to_ar,
    build,
    decode,
    method_cfg,
    prompts_for,
    run,
    run_keeping_state,
)


def longest_earlier(text, context):
    """Brute force: ``(length, first end)`` of the longest suffix of ``context`` occurring in ``text``."""
    for n in range(len(context), 0, -1):
        suffix = context[len(context) - n:]
        for end in range(n - 1, len(text)):
            if text[end - n + 1:end + 1] == suffix:
                return n, end
    return 0, -1


def random_texts(n=150, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        vocab = rng.randint(1, 4)  # a small vocabulary: long repeats
        yield [rng.randrange(vocab) for _ in range(rng.randint(0, 50))], rng


# ------------------------------------------------------------------------------------------ the automaton


def test_the_cursor_is_the_longest_earlier_match_and_its_first_occurrence():
    """Moving the cursor by each token before appending it (as the method reads committed text): its length is
    the longest suffix of the text so far occurring before the last token, its state's first end the earliest."""
    for text, rng in random_texts():
        sam, cursor = SuffixAutomaton(), (0, 0)
        for i, token in enumerate(text):
            cursor = sam.step(*cursor, token)
            length, end = longest_earlier(text[:i], text[:i + 1])
            assert cursor[1] == length, (text, i)
            assert length == 0 or sam.first_end[cursor[0]] == end, (text, i)
            sam.append(token)
        context = [rng.randrange(4) for _ in range(6)]
        state, length = sam.match(context)
        assert (length, sam.first_end[state] if length else -1) == longest_earlier(text, context)
        if length:
            assert sam.continuation(state, 5) == text[sam.first_end[state] + 1:sam.first_end[state] + 6]


def test_growing_equals_building_from_scratch():
    for text, rng in random_texts(60, seed=1):
        cut = rng.randint(0, len(text))
        grown = SuffixAutomaton(text[:cut])
        grown.extend(text[cut:])
        whole = SuffixAutomaton(text)
        for field in ("tokens", "next", "link", "length", "first_end"):
            assert getattr(grown, field) == getattr(whole, field), field
        assert whole.states <= max(2 * len(text) - 1, 1)  # the automaton's bound: linear in the text


def test_counts_are_occurrences_and_rank_the_transitions():
    for text, _ in random_texts(60, seed=2):
        sam = SuffixAutomaton(text)
        counts = sam.counts()
        for s in range(1, sam.states):
            end, n = sam.first_end[s], sam.length[s]
            longest = text[end - n + 1:end + 1]
            assert counts[s] == sum(text[j - n + 1:j + 1] == longest for j in range(n - 1, len(text)))
            ranked = [counts[c] for _, c in sam.top_next(s, 8)]
            assert ranked == sorted(ranked, reverse=True)


def test_documents_never_match_across_a_separator():
    sam = SuffixAutomaton()
    sam.add_document([1, 2, 3])
    sam.add_document([4, 5])
    assert sam.tokens == [1, 2, 3, SEP, 4, 5]
    assert sam.match([3, 4])[1] == 1  # only "4": "3 4" spans the separator
    state, _ = sam.match([2, 3])
    assert sam.continuation(state, 5) == []  # the first document ends there


def test_earlier_trades_match_length_for_a_longer_continuation():
    """The authors' to_anc: a long match near the end has little text after it; a suffix of it may occur earlier."""
    text = [7, 1, 2, 3, 4, 5, 6, 8, 9, 2, 3]
    sam = SuffixAutomaton(text)
    state, length = sam.match([9, 2, 3])
    assert length == 3 and sam.continuation(state, 4) == []  # "9 2 3" occurs only at the very end
    shorter = sam.earlier(state, 4)
    assert sam.length[shorter] < 3 and sam.continuation(shorter, 4) == [4, 5, 6, 8]
    assert sam.earlier(state, 0) == state


# ------------------------------------------------------------------------------------------ the method


@pytest.mark.parametrize("settings", [{"aux": "none"}, {"aux": "pld", "n_predicts": 40},
                                      {"aux": "none", "corpus": "lee", "alpha": 1.0},
                                      {"aux": "pld", "corpus": "lee", "len_threshold": 2, "len_bias": 0}])
def test_greedy_output_is_ars(tiny_pair, looping_prompt, settings):
    assert_greedy_equal_to_ar(build(tiny_pair, "samd", **settings), prompts_for(tiny_pair, 1) + [looping_prompt])


def test_the_automaton_drafts_several_tokens_per_call_on_repeating_text(tiny_pair, looping_prompt):
    out = run(build(tiny_pair, "samd", aux="none", n_predicts=16), looping_prompt, 40)
    assert out.extra["steps"]["automaton"] > 0 and out.extra["accept_rate"]["automaton"] > 0.5
    assert out.extra["mean_match"] > 5
    assert len(out.output_ids) / (len(out.accept_lengths) + 1) > 2  # tokens per target call, the prefill's too


@pytest.mark.parametrize("aux", ["none", "pld"])
def test_who_drafts_follows_the_authors_rule(tiny_pair, aux):
    """With an auxiliary drafter, the automaton drafts (n_predicts - 1 tokens, after the earliest occurrence of a
    suffix with that many after it) when its match reaches len_threshold, the auxiliary drafter otherwise; without,
    the automaton drafts int(alpha x match) tokens after the match's first occurrence."""
    method = build(tiny_pair, "samd", aux=aux, n_predicts=6, len_threshold=3, alpha=1.0)
    seen = []
    real = type(method).propose

    def spy(state):
        seq = list(state.seq)
        draft = real(method, state)
        seen.append((seq, state.source, draft.tree.tokens[1:], state.draft_budget))
        return draft

    method.propose = spy
    ids = prompts_for(tiny_pair, 1)[0]
    run(method, ids + ids[:12], 40)  # the prompt repeats its own start: long and short matches
    assert {"automaton", "none"} <= {s for _, s, _, _ in seen}
    for seq, source, tokens, budget in seen:
        k = min(5, budget)
        length, end = longest_earlier(seq[:-1], seq)
        if aux == "none" or length >= 3:
            assert source in ("automaton", "none")
            if aux == "none":
                assert tokens == seq[end + 1:end + 1 + min(k, length)]
            elif tokens:  # what followed the first occurrence of a suffix of the match
                assert len(tokens) <= k
                assert any(tokens == seq[e + 1:e + 1 + len(tokens)]
                           for e in (longest_earlier(seq[:-1], seq[len(seq) - n:])[1] for n in range(1, length + 1)))
        else:
            assert source in ("pld", "none")
    if aux == "pld":
        assert "pld" in {s for _, s, _, _ in seen}


def test_each_prompt_has_its_own_automaton(tiny_pair):
    a, b = prompts_for(tiny_pair, 2)
    method = build(tiny_pair, "samd")
    alone = run(method, a, 24)
    run(method, b, 24)
    again, state = run_keeping_state(method, a, 24)
    assert again.accept_lengths == alone.accept_lengths and again.output_ids == alone.output_ids
    # The prompt's own text only: what it committed up to the last step (the last commit is read at the next).
    assert state.sam.tokens == state.seq[: len(state.sam)] and len(a) < len(state.sam) < len(state.seq)


def test_the_corpus_tree_is_its_most_frequent_continuations(tiny_pair):
    """aux none, a corpus match longer than the text's: best-first by share of occurrences, at most 8 per depth."""
    method = build(tiny_pair, "samd", aux="none")
    docs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 6], [9, 2, 3, 5, 7]]
    method.corpus_sam = sam = SuffixAutomaton()
    for doc in docs:
        sam.add_document(doc)
    node, _ = sam.match([1, 2])
    tree = method.corpus_tree(2, node, size=5, depth=2)
    first = [tree.tokens[v] for v in tree.children[0]]
    assert first == [3, 6]  # "1 2 3" three times, "1 2 6" once
    three = tree.children[0][0]
    assert [tree.tokens[v] for v in tree.children[three]] == [5, 4]  # after "1 2 3": "5" twice, "4" once
    assert len(tree) == 5 and tree.max_depth == 2
    assert SEP not in tree.tokens
    assert len(method.corpus_tree(2, node, size=3, depth=1)) == 3 and method.corpus_tree(2, node, 9, 1).max_depth == 1


def test_the_corpus_drafts_when_its_match_is_longer(tiny_pair, looping_prompt):
    out = run(build(tiny_pair, "samd", aux="none", corpus="lee"), prompts_for(tiny_pair, 1)[0], 24)
    assert out.extra["steps"]["corpus"] > 0


def test_eagle_drafts_short_matches_and_stays_lossless(tiny_pair, looping_prompt):
    """aux eagle (Spec-Bench's SAMD): EAGLE-2's tree for short matches, the automaton for long ones; the draft layer
    reads the features of every committed token, whoever drafted them."""
    method = build(tiny_pair, "samd", aux="eagle")
    assert method.hidden
    ids = prompts_for(tiny_pair, 1)[0] + looping_prompt  # short matches first, then long ones
    out = run(method, ids, 24)
    assert out.output_ids == decode(tiny_pair, "ar", ids, max_new=24).output_ids
    assert out.extra["steps"]["automaton"] > 0 and out.extra["steps"]["eagle"] > 0


def test_only_the_eagle_drafter_trains():
    from omegaconf import OmegaConf

    spec = OmegaConf.create({"drafts": [{"source": "distilled"}]})
    samd = get_method("samd")
    assert not samd.trains(spec, samd.check_settings({"aux": "pld"}))
    assert samd.trains(spec, samd.check_settings({"aux": "eagle"}))


@pytest.mark.parametrize("settings, message", [
    ({"n_predicts": 1}, "method.n_predicts=1 is not allowed; it takes an integer >= 2"),
    ({"aux": "rest"}, "method.aux='rest' is not allowed; it takes one of: none, pld, eagle"),
    ({"corpus": "books"}, "method.corpus='books' is not allowed"),
    ({"alpha": 0.0}, "method.alpha=0.0 is not allowed"),
    ({"pld": {"min_ngram": 4}}, "min_ngram (4) must not exceed max_ngram (3)"),
])
def test_bad_settings_are_one_sentence(settings, message):
    with pytest.raises(BenchError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        method_cfg("samd", **settings)
    assert "\n" not in str(err.value)
