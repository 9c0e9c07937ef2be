"""Every registered method, walked from the registry: a method added later is covered without a new test.

- it runs through the harness on the tiny pair with its shipped settings (records written, counts sane);
- if it is lossless, its greedy output equals ``ar``'s token for token, and its sampled output follows the
  target's distribution (a chi-square test on a token a draft can propose, with a power check);
- if it is lossy, its records say so and carry quality figures.

The sampling test runs on the tiny target with a draft that is a noisy copy of it (so drafts are often,
not always, accepted) and a prompt that ends inside the target's own greedy loop (so the text-based and
trained drafters find something to propose).
"""

import json

import pytest

from decoding.sampling import Sampling
from methods.registry import get_method, known_methods
from tests.helpers import (
    assert_greedy_equal_to_ar,
    assert_sampling_is_the_targets,
    build,
    decode,
    noisy_copy,
    prompts_for,
    run,
    with_drafts,
)

METHODS = known_methods()


@pytest.fixture(scope="module")
def good_pair(tiny_pair):
    """The tiny pair whose first draft is a noisy copy of the target (and whose second is the random draft)."""
    return with_drafts(tiny_pair, noisy_copy(tiny_pair.target.module), tiny_pair.drafts[0].module)


def test_every_registered_method_is_a_config_option():
    """A method's settings are declared in its file and stored for Hydra from there: the registry is the list
    of ``method=`` options (a method registered later in the process, e.g. the README's example, included)."""
    from bench.cli import choices
    from methods.registry import known_methods

    assert set(METHODS) <= set(known_methods()) == set(choices("method"))


@pytest.mark.parametrize("name", METHODS)
def test_runs_through_the_harness_on_the_tiny_pair(name, compose_cfg, tmp_path):
    from bench.runner import run

    run(compose_cfg("pair=tiny", f"method={name}", "max_new_tokens=12", "dataset.n_prompts=2", "warmup=0"), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    mine = [r for r in records if r["method"] == name]
    assert len(mine) == 2 and all(0 < r["new_tokens"] <= 12 and r["target_calls"] >= 1 for r in mine)
    assert all(r["lossless"] == get_method(name).lossless for r in mine)


@pytest.mark.parametrize("name", [m for m in METHODS if get_method(m).lossless])
def test_lossless_greedy_equals_ar(name, good_pair, tiny_pair):
    # Both a weak (random) and a good draft: acceptance changes, the output must not.
    for pair in (tiny_pair, good_pair):
        assert_greedy_equal_to_ar(build(pair, name), prompts_for(pair, 3))


# The compiled forward itself (the transformers layers it calls) is tested under both releases in
# tests/core/test_compiled.py; what each method does with it is the same code whichever release computed it.
@pytest.mark.newest_only
@pytest.mark.parametrize("name", [m for m in METHODS if get_method(m).lossless])
def test_lossless_greedy_equals_ar_compiled(name, good_pair, compiled):
    """With the target's and the draft models' forwards compiled per bucket (compile=true), greedy output stays ar's,
    and every step takes what it takes eagerly (the same accepted lengths: a method reading stale hidden states from
    the compiled forwards would draft otherwise); a method that says it cannot run compiled is refused, never silently
    run."""
    from omegaconf import OmegaConf

    from bench.runner import compile_parts, uncompile_parts
    from core.compiled import no_recompiles

    pair = compiled(good_pair)
    method = build(pair, name)
    # The method's own parts compiled too, as a compile=true run does: cache-free ones (draft heads) per bucket of rows,
    # those with a KV cache (EAGLE's layer, Hydra++'s prefix layer, Amphista's stages, GliDe's draft) per bucket of
    # query rows (two: their catch-ups and trees' levels padded to 16; their prompt's read beyond).
    parts = compile_parts(OmegaConf.create({"compile": True, "compile_buckets": [1, 16]}), [method], batch=1,
                          longest=1024)
    cached = {part.role for part in method.batch_parts()}
    heads = {"medusa", "hydra", "hydra_pp", "amphista"} | ({"koala"} if getattr(method.cfg, "base", None) == "medusa" else set())
    assert set(parts) - cached == ({"heads"} if name in heads else {"verifier"} if name == "sprinter" else set()), name
    assert cached <= set(parts) and bool(cached) == (name in {"eagle", "eagle3", "glide", "hydra_pp", "amphista"}
                                                     or name == "koala" and method.cfg.base == "eagle"), name
    # A prompt within the largest bucket (a compiled prefill) and one beyond it (an uncompiled one).
    prompts = [min(prompts_for(good_pair, 8), key=len), prompts_for(good_pair, 3)[2]]
    eager = build(good_pair, name)
    with no_recompiles():
        for ids in prompts:
            ref = decode(good_pair, "ar", ids, max_new=24)
            pair.reset_counts()
            out = run(method, ids, 24)
            # A draft model's forwards run compiled too (all but a prompt beyond its largest bucket, 8 rows here).
            assert all(pair.roles[d.role].uncompiled_calls <= 1 for d in pair.drafts), name
            plain = run(eager, ids, 24)
            assert out.output_ids == ref.output_ids == plain.output_ids, f"{name} compiled differs from ar"
            assert out.accept_lengths == plain.accept_lengths
            for role in parts:  # every call of a compiled part ran through its graphs (a prompt's read beyond them)
                assert pair.roles[role].calls > 0 and pair.roles[role].uncompiled_calls <= (role in cached), (name, role)
    uncompile_parts([method], 1)
    assert all(pair.roles[role].compiled is None for role in parts)


def loop_settings(name: str, pair, looping_prompt, folder) -> dict:
    """What a method needs beyond its shipped settings to meet the loop: REST retrieves from a datastore, not from
    the prompt, so it is given one holding the loop's text."""
    if name != "rest":
        return {}
    path = folder / "loop.txt"
    path.write_text(pair.tokenizer.decode(looping_prompt))
    return {"datastore": str(path)}


@pytest.mark.newest_only
@pytest.mark.parametrize("name", [m for m in METHODS if get_method(m).lossless])
def test_lossless_sampling_follows_the_target(name, good_pair, looping_prompt, tmp_path):
    method = build(good_pair, name, **loop_settings(name, good_pair, looping_prompt, tmp_path))
    if name == "ar":  # nothing is drafted: the plain sampler alone is tested
        from tests.helpers import second_token_counts, second_token_probs

        counts, _, _ = second_token_counts(method, looping_prompt, 0.05, 200)
        expected = second_token_probs(good_pair, looping_prompt, 0.05) * 200
        assert counts[expected < 1e-6].sum() == 0
        return
    assert method.is_lossless(Sampling(0.05))
    assert_sampling_is_the_targets(method, looping_prompt)


@pytest.mark.parametrize("name", [m for m in METHODS if not get_method(m).lossless])
def test_lossy_methods_say_so(name, tiny_pair):
    assert not build(tiny_pair, name).is_lossless(Sampling(0.0))
