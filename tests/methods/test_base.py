"""The method base: one commit (EOS, budget, cache rollback, the harness's token callback) for every method."""

import torch
from transformers import DynamicCache

from decoding.sampling import Sampling
from methods.base import PromptState
from methods.registry import get_method
from tests.helpers import method_cfg


def new_state(pair, prompt_len=5, max_new=10, calls=None):
    method = get_method("ar")(method_cfg("ar"), pair)
    on_tokens = (calls if calls is not None else []).append
    return PromptState(method, torch.arange(1, prompt_len + 1).view(1, -1), max_new, Sampling(), None, on_tokens)


def filled_cache(length):
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, length, 4), torch.zeros(1, 1, length, 4), 0)
    return cache


def test_commit_keeps_the_first_eos_and_stops(tiny_pair):
    eos = tiny_pair.tokenizer.eos_token_id
    calls = []
    state = new_state(tiny_pair, calls=calls)
    state.commit([7], drafted=None)
    state.commit([15, 16, eos, 18], drafted=3)
    assert state.out == [7, 15, 16, eos] and state.done
    assert calls == [1, 3]  # the harness hears of every committed token once, none past EOS
    assert state.accept_lengths == [4] and state.drafted == [3]  # what the call gained, before the cut


def test_commit_cuts_at_the_budget(tiny_pair):
    calls = []
    state = new_state(tiny_pair, max_new=4, calls=calls)
    state.commit([7], drafted=None)
    assert state.draft_budget == 2 and not state.done  # two may be drafted: the target's own token fills the last slot
    state.commit([11, 12, 13, 14], drafted=3)
    assert state.out == [7, 11, 12, 13] and state.done and calls == [1, 3] and state.draft_budget == -1


def test_commit_rolls_every_tracked_cache_back_to_the_pending_token(tiny_pair):
    state = new_state(tiny_pair, prompt_len=5)
    state.cache = filled_cache(9)  # the prompt + the pending token + 3 rejected proposals
    draft_cache = filled_cache(7)
    short = filled_cache(3)  # a cache behind the text is left as it is
    state.track(draft_cache)
    state.track(short)
    state.commit([17, 18], drafted=None)  # seq = 5 + 2 tokens: caches hold 6, the last token is pending
    assert state.cache.get_seq_length() == 6 and draft_cache.get_seq_length() == 6 and short.get_seq_length() == 3
