"""SAM-Decoding (methods/samd.py): the authors' rule for who drafts (against a brute-force search), per-prompt
automata, the corpus tree, and bad settings. The suffix automaton itself (decoding/suffix_automaton.py) is tested in
tests/decoding/test_suffix_automaton.py. Greedy equality with ar and the sampling distribution of the defaults
are checked for every method by tests/methods/test_methods.py; here the other drafters too."""

import pytest

from core.errors import BenchError
from decoding.suffix_automaton import SEP, SuffixAutomaton
from methods.registry import get_method
from tests.helpers import (
    assert_greedy_equal_to_ar,
    build,
    decode,
    forwards_run,
    longest_earlier,
    method_cfg,
    prompts_for,
    run,
    run_keeping_state,
)


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
        proposal = forwards_run(real(method, state))  # a generator (EAGLE's forwards, when it drafts)
        seen.append((seq, state.source, proposal.tree.tokens[1:], state.draft_budget))
        return proposal

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
