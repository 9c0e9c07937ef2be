"""Every registered method on every model family users bring, walked from the registry × the tiny family pairs.

``pair=tiny`` (Llama-style) is walked by ``tests/methods/test_methods.py``; here the same walk runs on random pairs of
the other families (``configs/pair/tiny_<family>.yaml``: target and draft of one family, the byte-level
tokenizer): GPT-2 (learned absolute positions, Conv1D projections, a tied head), Qwen2 (q/k/v biases), Mistral
(a sliding window) and Gemma (scaled embeddings, its own head_dim, a tied head). For each (family, method):

- a method that cannot serve the family says so in one sentence from its ``check_pair``, before any model
  loads, and that exact refusal is what :data:`REFUSED` lists (nothing is skipped silently: a new refusal, or a
  listed one that no longer happens, fails the walk);
- otherwise it is set up with its shipped settings (trained parts under ``recipe=smoke``, from the family's own
  teacher store) and decodes; a lossless method's greedy output equals ``ar``'s token for token (a method that
  runs a draft model: with the random draft and with a noisy copy of the target, which is often right), a
  lossy one's stays within the budget.

The tiny targets are initialised at a larger scale than the families' own (``initializer_range`` 0.4): their
greedy text varies with context and position, so equality with ``ar`` catches a wrong position after a rollback
or in a tree (GPT-2's learned positions) where a target repeating one token would not.

A method registered later is walked without a new test. Kept small for CI: one pair per family (module-scoped),
two prompts, 16 new tokens.
"""

import pytest

from core.errors import BenchError
from methods.registry import get_method, known_methods
from tests.helpers import (
    assert_greedy_equal_to_ar,
    build,
    decode,
    local_folder,
    noisy_copy,
    prompts_for,
    run,
    run_batch,
    trained_pair,
    with_drafts,
)

FAMILIES = ("gpt2", "qwen2", "mistral", "gemma")
METHODS = known_methods()
MAX_NEW = 16

# (method, family): the one sentence its check_pair answers with, before any model loads.
REFUSED = {
    ("glide", "gpt2"): "method=glide needs a target with rotary attention (Llama, Qwen2, Mistral, Gemma): its draft "
                       "rotates its queries to meet the target's rotated keys, and pair=tiny_gpt2's target is gpt2, "
                       "whose keys carry learned absolute positions instead.",
}


@pytest.fixture(scope="module")
def family_pair(compose_cfg):
    """``family -> (pair, good, prompts)``, each loaded once for the module: the family's tiny pair, the same pair
    whose first draft is a noisy copy of the target (drafts often, not always, accepted: partial acceptance,
    rollbacks mid-chain) and two prompts."""
    from bench.models import load_pair

    loaded = {}

    def get(family):
        if family not in loaded:
            pair = load_pair(compose_cfg(f"pair=tiny_{family}"))
            good = with_drafts(pair, noisy_copy(pair.target.module, scale=0.1), pair.drafts[0].module)
            loaded[family] = pair, good, prompts_for(pair, 2)
        return loaded[family]

    return get


def refusal(name, family, compose_cfg):
    """The sentence ``method=name`` refuses ``pair=tiny_<family>`` with (``None``: it takes the pair)."""
    from bench.models import PairSettings
    from bench.validate import plain
    from core.schema import check

    cls = get_method(name)
    pair = check(PairSettings, plain(compose_cfg(f"pair=tiny_{family}"))["pair"], "pair")
    try:
        cls.check_pair(cls.check_settings({}), pair)
    except BenchError as err:
        return str(err)
    return None


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_pair_is_that_family(family, family_pair):
    pair, _, prompts = family_pair(family)
    assert pair.target.module.config.model_type == family == pair.drafts[0].module.config.model_type
    assert pair.target.module.config.vocab_size == len(pair.tokenizer) and all(prompts)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", METHODS)
def test_every_method_on_every_family(name, family, family_pair, compose_cfg):
    refused = refusal(name, family, compose_cfg)
    assert refused == REFUSED.get((name, family)), refused
    if refused is not None:
        return
    pair, good, prompts = family_pair(family)
    method = build(pair, name)
    if get_method(name).lossless:
        assert_greedy_equal_to_ar(method, prompts, max_new=MAX_NEW)
        if get_method(name).drafts:  # a weak (random) and a good draft: acceptance changes, the output must not
            assert_greedy_equal_to_ar(build(good, name), prompts, max_new=MAX_NEW)
    else:
        for ids in prompts:
            out = run(method, ids, MAX_NEW)
            assert 0 < len(out.output_ids) <= MAX_NEW and len(out.accept_lengths) == len(out.drafted)


# The methods batched under both transformers releases: each reaches the family's layers through another batch path
# (one-token steps, chains, a tree, a batched draft model, a draft layer reading the target's hidden states, swapped
# input embeddings: Gemma scales them). The oldest leg leaves the rest to these; the first leg walks every method.
BATCHED_UNDER_BOTH = ("ar", "pld", "recycling", "sd", "eagle", "space")


def batch_cases():
    for family in FAMILIES:
        for name in METHODS:
            if get_method(name).lossless and (name, family) not in REFUSED:
                marks = () if name in BATCHED_UNDER_BOTH else (pytest.mark.newest_only,)
                yield pytest.param(name, family, marks=marks, id=f"{name}-{family}")


@pytest.mark.parametrize("name,family", list(batch_cases()))
def test_every_method_decodes_a_batch_on_every_family(name, family, family_pair, compose_cfg):
    """Issue 41 on each family: the two prompts (of different lengths) decoded as one batch, through the batch
    forwards a run builds (``bench.runner.batch_models``: the target's, the batched draft models', the method's own
    parts', eager), each row ``ar``'s tokens alone, with the accepted lengths of its decode alone (a noisy draft:
    ragged commits across the rows)."""
    from bench.runner import batch_models

    _, good, prompts = family_pair(family)
    assert len(set(map(len, prompts))) == len(prompts)
    method = build(good, name)
    cfg = compose_cfg(f"pair=tiny_{family}", f"method={name}", f"batch_size={len(prompts)}", f"max_new_tokens={MAX_NEW}")
    graphs = batch_models(cfg, good, prompts, [method])
    try:
        got = run_batch(method, prompts, MAX_NEW)
    finally:
        for lm in (good.target, *good.drafts, *method.batch_parts()):  # the module's pair decodes alone again
            lm.compiled = None
    assert "target" in graphs and not any(g.compiles for g in graphs.values())
    for ids, out in zip(prompts, got):
        alone = run(method, ids, MAX_NEW)
        assert out.output_ids == decode(good, "ar", ids, max_new=MAX_NEW).output_ids == alone.output_ids, name
        assert out.accept_lengths == alone.accept_lengths


@pytest.mark.parametrize("family", FAMILIES)
def test_a_draft_of_all_the_targets_layers_is_the_target(family, family_pair):
    """training/distill.py's draft built through core.model_parts from every layer of the target (and the whole
    vocabulary) computes the target's own logits: the embeddings (GPT-2's position table too), layers, final
    norm and head all came across."""
    import torch

    from training.distill import draft_from_target

    pair, _, prompts = family_pair(family)
    target = pair.target.module
    draft = draft_from_target(target, list(range(target.config.num_hidden_layers)), torch.arange(len(pair.tokenizer)))
    x = torch.tensor([prompts[1]])
    with torch.no_grad():
        assert torch.allclose(draft.eval()(x).logits, target(x).logits, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_distilled_draft_of_the_family_is_greedy_equal_to_ar(family, compose_cfg):
    """The harness-distilled draft (training/distill.py: the target's own embeddings, layers, final norm and
    head rows, through core.model_parts) on each family, run by ``sd``."""
    pair = trained_pair(compose_cfg(f"pair=tiny_{family}", "pair.drafts=[{source: distilled, recipe: {layers: [0, 2]}}]"))
    assert type(pair.draft.module).__name__ == "DraftLM"
    assert_greedy_equal_to_ar(build(pair, "sd"), prompts_for(pair, 2), max_new=MAX_NEW)


@pytest.mark.parametrize("family", FAMILIES)
def test_runs_through_the_harness(family, compose_cfg, tmp_path):
    """The harness end to end on the family: validation, loading, timing, records."""
    import json

    from bench.runner import run as harness_run

    harness_run(compose_cfg(f"pair=tiny_{family}", "method=sd", "max_new_tokens=8", "dataset.n_prompts=1", "warmup=0"),
                tmp_path)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"sd", "ar"} and all(r["new_tokens"] > 0 for r in records)
    assert all(r["matches_baseline"] for r in records if r["method"] == "sd")


def test_refusals_come_before_any_model_loads(capsys):
    """Each refusal of :data:`REFUSED` is also what the command line says: one sentence, exit status 2."""
    from bench.__main__ import main

    assert REFUSED, "nothing to check: the table of refused (method, family) pairs is empty"
    for (name, family), sentence in REFUSED.items():
        assert main(["run", f"pair=tiny_{family}", f"method={name}"]) == 2
        assert capsys.readouterr().err.strip() == f"error: {sentence}"


@pytest.mark.parametrize("args,needle", [
    (["pair=tiny", "pair.target.family=falcon9"], "pair.target.family='falcon9' is not allowed; it takes one of: llama, "
                                                  "gpt2, qwen2, mistral, gemma"),
    (["pair=tiny_gpt2", "pair.target.config.hidden_sizes=3"], "config has keys GPT2Config does not know: hidden_sizes"),
    (["pair=tiny_gpt2", "pair.target.config.n_embd=30"], "GPT2Config refuses config: `embed_dim` must be divisible by "
                                                         "num_heads"),
    (["pair=tiny_gemma", "pair.drafts.0.config.num_key_value_heads=3"], "GemmaConfig refuses config: "
                                                                         "num_attention_heads (2) must be a multiple"),
])
def test_bad_family_settings_are_one_sentence(args, needle, capsys, tmp_path):
    from bench.__main__ import main

    assert main(["run", *args, f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "run").exists()


UNREADABLE = {  # families whose layout core.model_parts does not know: OPT (model.decoder.layers), Mamba (no attention)
    "opt": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64, word_embed_proj_dim=32),
    "mamba": dict(hidden_size=32, num_hidden_layers=2, state_size=4),
}


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("family", list(UNREADABLE))
def test_a_local_folder_of_an_unsupported_family_names_the_supported_ones(family, role, tmp_path, capsys):
    """Refused at validation (no weights load), in one sentence naming the key, the family and the supported ones."""
    from bench.__main__ import main

    folder = local_folder(tmp_path / family, family, **UNREADABLE[family])
    key = "pair.target.id" if role == "target" else "pair.drafts.0.id"
    other = [] if role == "target" else [f"pair.target.id={local_folder(tmp_path / 'gpt2', 'gpt2', n_embd=32, n_layer=2, n_head=2)}"]
    capsys.readouterr()  # saving's progress bars
    assert main(["run", "pair=gpt2", *other, f"{key}={folder}", "method=ar", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {key}: '{folder}' holds a model of family '{family}'")
    assert err.endswith("supported families: llama, qwen2, mistral, gemma, gpt2."), err
    assert not (tmp_path / "run").exists()


def test_a_local_folder_of_an_untested_family_with_a_known_layout_runs(compose_cfg, tmp_path, caplog):
    """Qwen3 keeps Llama's layout: it is taken with a warning that it is untested, and sd on it is ar's output."""
    from bench.models import load_pair
    from bench.validate import validate

    folder = local_folder(tmp_path / "qwen3", "qwen3", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=64, head_dim=16, initializer_range=0.4)
    cfg = validate(compose_cfg("pair=gpt2", f"pair.target.id={folder}", f"pair.drafts.0.id={folder}"))
    assert "family 'qwen3'" in caplog.text and "untested" in caplog.text
    validate(cfg)  # as the Hydra task validates again what the command line checked: said once per folder
    assert caplog.text.count("untested") == 1
    pair = load_pair(cfg)
    assert_greedy_equal_to_ar(build(pair, "sd"), prompts_for(pair, 2), max_new=MAX_NEW)


def test_a_local_folder_whose_config_transformers_cannot_build_is_one_sentence(tmp_path):
    import json

    from core.model_parts import check_folder_family

    folder = local_folder(tmp_path / "qwen3", "qwen3", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=64, head_dim=16)
    config = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    (tmp_path / "qwen3" / "config.json").write_text(json.dumps({**config, "head_dim": None}))
    with pytest.raises(BenchError, match=r"^transformers cannot build a model from '.*qwen3/config.json' "
                                         r"\(.*head_dim.*\)\.$"):
        check_folder_family(folder)
