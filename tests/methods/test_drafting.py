"""Drafting without training: prompt lookup (`pld`), cascade drafting (`cascade`) and hierarchy drafting
(`hierarchy`). Each is lossless: greedy output equals `ar` token for token on tiny pairs, under several
settings; sampled output is distributed as the target's."""

import re

import pytest
import torch

from bench.validate import validate
from core.errors import BenchError
from methods.registry import get_method
from tests.helpers import (
    ROOT,
    build,
    decode,
    method_cfg,
    prompts_for,
    repeating_prompt,
    run,
    with_drafts,
)

CONFIGS = ROOT / "configs" / "method"


@pytest.fixture(scope="module")
def ar_outputs(tiny_pair):
    """``ar``'s greedy 40 tokens for three real prompts and a self-repeating one."""
    prompts = prompts_for(tiny_pair, 3) + [repeating_prompt(tiny_pair)]
    return [(ids, decode(tiny_pair, "ar", ids, max_new=40).output_ids) for ids in prompts]


def assert_equal_to_ar(method, ar_outputs):
    for ids, ref in ar_outputs:
        out = run(method, ids, 40)
        assert out.output_ids == ref
        assert sum(out.accept_lengths) + 1 == len(out.output_ids)  # the prefill gives the first token
        assert len(out.drafted) == len(out.accept_lengths)
        assert all(0 < a <= d + 1 for a, d in zip(out.accept_lengths, out.drafted))


# ------------------------------------------------------------------------------------------ pld


@pytest.mark.parametrize("settings", [{}, {"max_ngram": 2, "min_ngram": 2, "draft_len": 4}, {"draft_len": 1}])
def test_pld_equals_ar_greedy(tiny_pair, ar_outputs, settings):
    assert_equal_to_ar(build(tiny_pair, "pld", **settings), ar_outputs)


def test_pld_takes_several_tokens_per_call_when_the_text_repeats(tiny_pair, ar_outputs):
    ids, ref = ar_outputs[-1]
    out = run(build(tiny_pair, "pld"), ids, 40)
    assert out.output_ids == ref
    assert out.extra["hit_rate"] > 0.5 and out.extra["accepted"] > 0
    assert len(out.output_ids) / (len(out.accept_lengths) + 1) > 1.5  # tokens per target call, prefill included
    assert len(out.accept_lengths) < 26


# ------------------------------------------------------------------------------------------ cascade


@pytest.mark.parametrize("settings", [{}, {"k_matrix": [[2, 3], [1]]}, {"lenience": 3}, {"k_matrix": [[0, 0], [0]]}])
def test_cascade_equals_ar_greedy(tiny_pair, ar_outputs, settings):
    assert_equal_to_ar(build(tiny_pair, "cascade", **settings), ar_outputs)


def test_cascade_with_three_models_and_a_good_draft(tiny_pair, ar_outputs):
    """target <- draft (the target's own weights: always right) <- draft2 (random) <- statistics."""
    pair = with_drafts(tiny_pair, tiny_pair.target.module, tiny_pair.draft.module)
    method = build(pair, "cascade", lenience=2)
    assert method.k == [[4, 2, 1], [2, 1], [1]]
    pair.reset_counts()
    ids, ref = ar_outputs[0]
    out = run(method, ids, 40)
    assert out.output_ids == ref
    reviews = out.extra["reviews"]
    assert out.extra["levels"] == ["target", "draft", "draft2", "stat"]
    assert reviews["draft>target"]["accept_rate"] == 1.0  # the draft is the target: all of it stands
    assert {"draft2>target", "stat>target", "draft2>draft", "stat>draft", "stat>draft2"} <= reviews.keys()
    calls = pair.counts()
    assert calls["draft"]["calls"] > 0 and calls["draft2"]["calls"] > 0  # counted per level by role
    assert calls["target"]["calls"] == len(out.accept_lengths) + 1


def test_cascade_sampling_keeps_every_token_of_an_exact_draft(tiny_pair):
    """When the draft is the target, q = p for draft tokens, so the exact test accepts all of them."""
    pair = with_drafts(tiny_pair, tiny_pair.target.module)
    out = run(build(pair, "cascade"), prompts_for(tiny_pair, 1)[0], 30, temperature=0.8, seed=3)
    assert out.extra["reviews"]["draft>target"]["accept_rate"] == 1.0
    assert out.extra["lenience"] == 1


# ------------------------------------------------------------------------------------------ hierarchy


@pytest.mark.parametrize("settings", [
    {},
    {"databases": ["context"], "num_candidates": 1},
    {"databases": ["statistics"], "draft_len": 3},
    {"databases": ["model", "statistics", "context"], "num_candidates": 3, "draft_len": 1},
])
def test_hierarchy_equals_ar_greedy(tiny_pair, ar_outputs, settings):
    method = build(tiny_pair, "hierarchy", **settings)
    assert_equal_to_ar(method, ar_outputs)
    assert_equal_to_ar(method, ar_outputs[::-1])  # again, in the other order


def test_hierarchy_tree_keeps_the_cache_of_an_accepted_side_branch(tiny_pair):
    """The target accepts a path through the second candidate; the cache then equals a fresh prefill's."""
    from transformers import DynamicCache

    from decoding.tree import Tree, keep_path, score_tree

    ids = prompts_for(tiny_pair, 1)[0]
    g = decode(tiny_pair, "ar", ids, max_new=5).output_ids
    target = tiny_pair.target
    cache = DynamicCache()
    with torch.no_grad():
        target(torch.tensor([ids]), cache)
        tree = Tree(g[0])
        tree.add([(g[1] + 1) % 250, g[2], g[3]], "context")  # wrong at once
        tree.add([g[1], g[2], (g[3] + 1) % 250], "model")  # right for two tokens
        logits, _ = score_tree(target, cache, tree)
        assert [int(logits[v].argmax()) for v in (0, 4, 5)] == g[1:4]
        keep_path(cache, len(ids), [0, 4, 5])
        step = target(torch.tensor([[g[3]]]), cache).logits[0, -1]
        fresh = target(torch.tensor([ids + g[:4]]), DynamicCache()).logits[0, -1]
    assert cache.get_seq_length() == len(ids) + 4
    assert torch.allclose(step, fresh, atol=1e-4)
    assert int(step.argmax()) == g[4]


def test_hierarchy_model_database_uses_other_prompts_only(tiny_pair, ar_outputs, tmp_path):
    import json

    (a, ref_a), (b, ref_b) = ar_outputs[0], ar_outputs[3]
    # Outputs from a records.jsonl of a run on the same pair: a prompt never sees its own.
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"method": "ar", "pair": "tiny", "prompt_id": "a", "wall_s": 1.0, "new_tokens": len(ref_a), "prompt_ids": a, "output_ids": ref_a}) + "\n")
    from_file = build(tiny_pair, "hierarchy", databases=["model"], model_db_file=str(path), model_db={"prompts": 0})
    assert run(from_file, a, 40).extra["databases"]["model"]["lookups"] == 0  # its own output is never used
    out = run(from_file, b, 40)
    assert out.output_ids == ref_b and out.extra["databases"]["model"]["lookups"] > 0


def test_hierarchy_results_do_not_depend_on_prompt_order(tiny_pair, ar_outputs):
    """The model database does not grow from earlier prompts of the run: any order (or a resume) gives the
    same outputs and the same per-prompt figures."""
    def results(order):
        method = build(tiny_pair, "hierarchy", model_db={"prompts": 0})
        outs = {i: run(method, ar_outputs[i][0], 40) for i in order}
        return {i: (o.output_ids, o.accept_lengths, o.extra["databases"]) for i, o in outs.items()}

    assert results([0, 1, 2, 3]) == results([3, 2, 1, 0])


def test_hierarchy_model_database_of_target_answers_is_built_once_and_cached(tiny_pair, ar_outputs, tmp_path):
    import dataclasses

    pair = dataclasses.replace(tiny_pair, cache=tmp_path, roles={})
    settings = {"prompts": 4, "max_new_tokens": 24, "batch_size": 4, "seed": 0}
    method = build(pair, "hierarchy", databases=["model"], model_db=settings)
    (a, ref_a) = ar_outputs[0]
    out = run(method, a, 40)
    assert out.output_ids == ref_a and out.extra["databases"]["model"]["lookups"] > 0  # answers from the start
    (cached,) = (tmp_path / "ngram").glob("model-db-*/docs.json")
    stamp, docs = cached.stat().st_mtime_ns, cached.read_text()
    build(pair, "hierarchy", databases=["model"], model_db=settings)  # from the cache, not generated again
    assert cached.stat().st_mtime_ns == stamp
    cached.write_text("{not json")
    again = get_method("hierarchy")(method_cfg("hierarchy", databases=["model"], model_db=settings), pair)
    with pytest.raises(BenchError, match=r"hierarchy model database at .* cannot be used \(docs.json has 9 bytes"):
        again.setup(train_if_missing=False)
    build(pair, "hierarchy", databases=["model"], model_db=settings)  # building allowed: generated again
    assert cached.read_text() == docs


# ------------------------------------------------------------------------------------------ bad settings


@pytest.mark.parametrize("args,needle", [
    (["method=pld", "method.min_ngram=4"], "method=pld: min_ngram (4) must not exceed max_ngram (3)."),
    (["method=pld", "method.draft_len=0"], "method.draft_len=0 is not allowed; it takes an integer >= 1"),
    (["method=cascade", "method.k_matrix=[[1,2]]"], "k_matrix must be a triangle of rows"),
    (["method=cascade", "method.k_matrix=[[1,-1],[2]]"], "method.k_matrix.0.1=-1 is not allowed"),
    (["method=cascade", "method.lenience=0"], "method.lenience=0 is not allowed; it takes an integer >= 1"),
    (["method=cascade", "method.corpus=books"], "method.corpus='books' is not allowed; it takes one of: lee, wiki, lee+wiki"),
    (["method=hierarchy", "method.databases=[context,web]"], "method.databases.1='web' is not allowed; it takes a list drawn from: context, model, statistics"),
    (["method=hierarchy", "method.num_candidates=0"], "method.num_candidates=0 is not allowed"),
    (["method=hierarchy", "method.stat_min_ngram=0"], "method.stat_min_ngram=0 is not allowed"),
    (["method=hierarchy", "method.model_db_file=/no/such/records.jsonl"], "method.model_db_file: could not read results file '/no/such/records.jsonl'"),
])
def test_bad_settings_are_one_sentence_before_any_model_loads(compose_cfg, args, needle):
    with pytest.raises(BenchError, match=re.escape(needle)):
        validate(compose_cfg("pair=tiny", *args))


def test_cascade_k_matrix_must_fit_the_pair(compose_cfg):
    with pytest.raises(BenchError, match="has 3 rows but pair=tiny gives 2 reviewing levels"):
        validate(compose_cfg("pair=tiny", "method=cascade", "method.k_matrix=[[1,1,1],[1,1],[1]]"))


# ------------------------------------------------------------------------------------------ real pair


@pytest.mark.slow
def test_pld_equals_ar_greedy_on_default_target(real_target):
    ids = prompts_for(real_target, 1)[0]
    assert run(build(real_target, "pld"), ids, 32).output_ids == decode(real_target, "ar", ids, max_new=32).output_ids


@pytest.mark.slow
@pytest.mark.newest_only  # the oldest leg: pld's, above, with no draft distilled
@pytest.mark.parametrize("name", ["cascade", "hierarchy"])
def test_equals_ar_greedy_on_default_pair(real_pair, name):
    ids = prompts_for(real_pair, 1)[0]
    ref = decode(real_pair, "ar", ids, max_new=32).output_ids
    # A small model database of the target's answers: its size changes what is drafted, not the output.
    settings = {"model_db": {"prompts": 4, "max_new_tokens": 32}} if name == "hierarchy" else {}
    assert run(build(real_pair, name, **settings), ids, 32).output_ids == ref
