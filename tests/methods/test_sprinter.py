"""SPRINTER on the tiny pair: verifier training and caching, and the decoding rules that do not depend on
how good the verifier is (always flag = SD with gamma 1 = AR greedily; never flag = one target call per
max_run tokens)."""

import copy
import re

import numpy as np
import pytest
import torch

from core.errors import BenchError
from tests.helpers import decode, prompts_for

# A verifier small enough for seconds on 2 cores (tiny random models; the smoke recipe: 4k training positions).
TINY_RECIPE = dict(batch_size=8, label="greedy", temperature=1.0, probs=True, width=32, train_batch=256, lr=1e-3,
                   weight_decay=0.01, seed=0)
REPORT_KEYS = {"accuracy", "precision", "recall", "reject_recall", "roc_auc", "accept_rate", "train_examples",
               "heldout_examples", "threshold"}


def sprinter(pair, threshold=0.5, max_run=4, **recipe):
    from omegaconf import OmegaConf

    from methods.sprinter import Sprinter

    cfg = OmegaConf.create({"name": "sprinter", "threshold": threshold, "max_run": max_run,
                            "verifier": {**TINY_RECIPE, **recipe}})
    return Sprinter(cfg, pair)  # its settings are checked against Sprinter.Config here


def test_training_reports_and_caches(tiny_pair):
    from methods._sprinter_verifier import verifier_dir

    m = sprinter(tiny_pair)
    m.setup()
    assert REPORT_KEYS <= m.report.keys()
    assert m.report["train_examples"] == 4096 and m.report["heldout_examples"] == 1024
    assert 0 <= m.report["accuracy"] <= 1
    folder = verifier_dir(tiny_pair, m.cfg.verifier)
    assert (folder / "verifier.pt").is_file() and (folder / "manifest.json").is_file()
    stamp = (folder / "verifier.pt").stat().st_mtime_ns
    again = sprinter(tiny_pair)
    again.setup(train_if_missing=False)  # loads the cached one, does not retrain
    assert (folder / "verifier.pt").stat().st_mtime_ns == stamp and again.report == m.report
    assert "verifier" in tiny_pair.roles  # registered for counting


def test_a_retrained_draft_gets_its_own_verifier(tiny_pair):
    """Same recipe, other draft weights: the verifier cache key must change (it depends on the weights)."""
    from core.counting import CountedLM
    from methods._sprinter_verifier import verifier_dir

    recipe = sprinter(tiny_pair).cfg.verifier
    other = copy.copy(tiny_pair)
    draft = copy.deepcopy(tiny_pair.draft.module)
    with torch.no_grad():
        next(draft.parameters()).add_(0.01)
    other.drafts = [CountedLM(draft, "draft")]
    assert verifier_dir(other, recipe) != verifier_dir(tiny_pair, recipe)
    assert verifier_dir(copy.copy(tiny_pair), recipe) == verifier_dir(tiny_pair, recipe)


def test_sampling_labels_train(tiny_pair):
    m = sprinter(tiny_pair, label="sampling", temperature=0.8, width=0)  # logistic regression
    m.setup()
    assert REPORT_KEYS <= m.report.keys()


def test_missing_and_corrupt_cache_are_one_sentence_or_retrained(tiny_pair, tmp_path):
    from methods._sprinter_verifier import verifier_dir

    pair = copy.copy(tiny_pair)
    pair.cache = tmp_path
    pair.roles = dict(tiny_pair.roles)
    with pytest.raises(BenchError, match="no cached SPRINTER verifier at .*; run 'python -m bench train method "
                                         "method=sprinter' with the same pair= and recipe="):
        sprinter(pair).setup(train_if_missing=False)
    m = sprinter(pair)
    m.setup()
    path = verifier_dir(pair, m.cfg.verifier) / "verifier.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(BenchError, match=r"SPRINTER verifier at .* cannot be used \(verifier.pt has 16 bytes"):
        sprinter(pair).setup(train_if_missing=False)
    again = sprinter(pair)
    again.setup()  # building allowed: retrained
    assert REPORT_KEYS <= again.report.keys() and path.stat().st_size > 16


@pytest.mark.parametrize("cfg,needle", [
    (dict(threshold=-0.1), "method.threshold=-0.1 is not allowed; it takes a number in [0, 1]"),
    (dict(threshold=1.5), "method.threshold=1.5 is not allowed; it takes a number in [0, 1]"),
    (dict(threshold="high"), "method.threshold='high' is not allowed"),
    (dict(label="beam"), "method.verifier.label='beam' is not allowed; it takes one of: greedy, sampling"),
    (dict(label="sampling", temperature=0), "method.verifier.temperature=0 is not allowed; it takes a number > 0"),
    (dict(train_batch=0), "method.verifier.train_batch=0 is not allowed; it takes an integer >= 1"),
])
def test_bad_settings(cfg, needle):
    from omegaconf import OmegaConf

    from methods.sprinter import Sprinter

    threshold = cfg.pop("threshold", 0.5)
    c = OmegaConf.create({"name": "sprinter", "threshold": threshold, "max_run": 4, "verifier": {**TINY_RECIPE, **cfg}})
    with pytest.raises(BenchError, match=re.escape(needle)):
        Sprinter.settings(c)


@pytest.mark.parametrize("max_run", [1, 4])
def test_always_flag_equals_ar_greedy(tiny_pair, max_run):
    """threshold 1: the verifier flags every token (no score exceeds 1), so each one is checked by the target
    (SD, gamma 1)."""
    for ids in prompts_for(tiny_pair, 3):
        ar = decode(tiny_pair, "ar", ids, max_new=40)
        s = decode(tiny_pair, "sprinter", ids, max_new=40, threshold=1.0, max_run=max_run, verifier=TINY_RECIPE)
        assert s.output_ids == ar.output_ids
        assert s.extra["unchecked_tokens"] == 0
        assert set(s.drafted) <= {0, 1}


def test_never_flag_calls_target_once_per_max_run(tiny_pair):
    """threshold 0: nothing is flagged; each target call follows max_run drafted tokens, whose first
    max_run - 1 are committed unchecked (the verifier scores exactly those)."""
    max_run, max_new = 5, 60
    for ids in prompts_for(tiny_pair, 3):
        tiny_pair.reset_counts()
        s = decode(tiny_pair, "sprinter", ids, max_new=max_new, threshold=0.0, max_run=max_run, verifier=TINY_RECIPE)
        counts = tiny_pair.counts()
        x = s.extra
        assert x["runs_flagged"] == 0
        assert counts["target"]["calls"] == 1 + len(s.drafted)  # the prefill, then one call per run
        full = [k for k in s.drafted if k == max_run]
        assert len(full) == x["runs_max_run"]
        assert x["runs_max_run"] + x["runs_eos"] + x["runs_budget"] == len(s.drafted)
        # The last token of a run is checked by the target, so the verifier never scores it.
        assert counts["verifier"]["calls"] == x["unchecked_tokens"] == sum(max(k - 1, 0) for k in s.drafted)
        # Runs shorter than max_run end only at a drafted EOS (always checked) or at the token budget.
        assert sum(k < max_run for k in s.drafted) == x["runs_eos"] + x["runs_budget"]
        assert x["runs_budget"] <= 2  # the last one or two calls, where fewer than max_run tokens are left


def test_max_run_is_respected_and_tokens_add_up(tiny_pair):
    for ids in prompts_for(tiny_pair, 3):
        s = decode(tiny_pair, "sprinter", ids, max_new=50, threshold=0.5, max_run=3, verifier=TINY_RECIPE)
        assert max(s.drafted) <= 3
        assert len(s.output_ids) <= 50
        assert sum(s.accept_lengths) + 1 >= len(s.output_ids)  # prefill token + committed (cut at EOS/budget)
        assert all(1 <= a <= k + 1 for a, k in zip(s.accept_lengths, s.drafted, strict=True))


def test_perfect_draft_never_flagged_still_equals_ar(tiny_pair):
    """With a draft identical to the target, unchecked tokens are the target's own: output equals AR and
    every run is max_run tokens plus a bonus."""
    from core.counting import CountedLM

    pair = copy.copy(tiny_pair)
    pair.drafts = [CountedLM(tiny_pair.target.module, "draft")]
    pair.roles = {**tiny_pair.roles, "draft": pair.drafts[0]}
    ids = prompts_for(tiny_pair, 1)[0]
    ar = decode(pair, "ar", ids, max_new=31)
    s = decode(pair, "sprinter", ids, max_new=31, threshold=0.0, max_run=4, verifier=TINY_RECIPE)
    assert s.output_ids == ar.output_ids
    assert s.accept_lengths == [5] * 6 and s.extra["checked_rejected"] == 0


def test_sampling_is_reproducible(tiny_pair):
    ids = prompts_for(tiny_pair, 1)[0]
    kw = dict(max_new=24, temperature=0.8, top_p=0.9, seed=3, threshold=0.5, max_run=4, verifier=TINY_RECIPE)
    a, b = decode(tiny_pair, "sprinter", ids, **kw), decode(tiny_pair, "sprinter", ids, **kw)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 24


def test_roc_auc_by_hand():
    from methods._sprinter_verifier import classification_report, roc_auc

    labels = np.array([1, 1, 0, 0], dtype=bool)
    assert roc_auc(np.array([0.9, 0.8, 0.3, 0.1]), labels) == 1.0
    assert roc_auc(np.array([0.1, 0.2, 0.8, 0.9]), labels) == 0.0
    assert roc_auc(np.array([0.5, 0.5, 0.5, 0.5]), labels) == 0.5  # ties count half
    assert roc_auc(np.array([0.9, 0.2, 0.5, 0.1]), labels) == 0.75
    assert np.isnan(roc_auc(np.array([0.1, 0.2]), np.array([1, 1], dtype=bool)))
    r = classification_report(np.array([0.9, 0.2, 0.6, 0.1]), labels)
    assert (r["accuracy"], r["precision"], r["recall"], r["reject_recall"]) == (0.5, 0.5, 0.5, 0.5)


# A bad threshold on the command line: tests/bench/test_schema.py walks every key of every method (one sentence, exit 2).


@pytest.mark.newest_only
def test_cli_trains_verifier_and_prints_report(cache_dir, capsys):
    """``train method method=sprinter`` through the command line's entry point, in-process (the other tests run the
    real one's exits as subprocesses): the verifier's report printed."""
    import json

    from bench.__main__ import main

    recipe = [f"method.verifier.{k}={v}" for k, v in TINY_RECIPE.items()]
    assert main(["train", "method", "pair=tiny", "method=sprinter", f"cache_dir={cache_dir}", *recipe]) == 0
    out = capsys.readouterr().out
    assert REPORT_KEYS <= json.loads(out[out.index("{"):]).keys()


def test_compiled_decodes_what_eager_decodes(tiny_pair, compiled):
    """compile=true: the draft's forwards (and the hidden states the verifier reads from them) and the target's run
    compiled, and SPRINTER, lossy, still decodes the eager run's tokens with the same flags (a verifier fed stale or
    misread hidden states would flag otherwise)."""
    from core.compiled import no_recompiles
    from tests.helpers import run

    pair = compiled(tiny_pair)
    ids = min(prompts_for(tiny_pair, 6), key=len)
    eager, fast = sprinter(tiny_pair, threshold=0.5), sprinter(pair, threshold=0.5)
    eager.setup(), fast.setup()  # the same verifier (trained once, cached by the models' weights)
    with no_recompiles():
        out = run(fast, ids, 24)
    ref = run(eager, ids, 24)
    assert out.output_ids == ref.output_ids and out.drafted == ref.drafted
    assert pair.draft.uncompiled_calls <= 1  # the prompt, if beyond the largest bucket


@pytest.mark.newest_only
def test_a_compiled_verifier_decodes_what_the_eager_one_does(tiny_pair):
    """compile=true compiles the verifier (bench.runner.compile_parts): every call goes through its graph, and the run
    decodes the tokens, runs and flags the eager verifier gives; released at the end, it runs eagerly again."""
    from omegaconf import OmegaConf

    from bench.runner import compile_parts, uncompile_parts
    from core.compiled import no_recompiles
    from decoding.sampling import Sampling

    method = sprinter(tiny_pair, max_run=4)
    method.setup()

    def run(ids):
        with torch.inference_mode():
            return method.decode(torch.tensor([ids]), 30, Sampling(0.0), torch.Generator().manual_seed(0), lambda n: None)

    prompts = prompts_for(tiny_pair, 3)
    eager = [run(ids) for ids in prompts]
    parts = compile_parts(OmegaConf.create({"compile": True}), [method], batch=1)
    assert set(parts) == {"verifier"} and method.verifier.compiled is parts["verifier"]
    try:
        method.verifier.reset()
        with no_recompiles():
            got = [run(ids) for ids in prompts]
        assert method.verifier.calls > 0 and method.verifier.uncompiled_calls == 0
    finally:
        uncompile_parts([method], 1)
    assert method.verifier.compiled is None
    assert [(o.output_ids, o.accept_lengths) for o in got] == [(o.output_ids, o.accept_lengths) for o in eager]
