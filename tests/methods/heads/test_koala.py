"""KOALA beyond the registry walk (``tests/methods/test_methods.py`` covers its defaults, base=eagle): the medusa base
decodes losslessly, both bases train K layers against a discriminator, the discriminator's term pulls a head
towards the target, the base methods' cached parts keep their keys, and bad input."""

import pytest
import torch

from core.artifacts import recipe_key
from training.adversarial import Adversary, AdversaryRecipe
from methods.eagle._draft import eagle_artifact
from tests.helpers import (
    assert_greedy_equal_to_ar,
    assert_sampling_is_the_targets,
    build,
    decode,
    method_cfg,
    prompts_for,
)


def test_the_medusa_base_is_lossless_with_k_layer_heads(tiny_pair, looping_prompt):
    method = build(tiny_pair, "koala", base="medusa")
    heads = method.base.heads.module
    assert heads.layers == 2 and all(len(d) == 1 for d in heads.deeper)  # K = 2 blocks per head
    assert 0.0 <= method.report["discriminator_auc_mean"] <= 1.0
    assert_greedy_equal_to_ar(method, prompts_for(tiny_pair, 2) + [looping_prompt])
    assert_sampling_is_the_targets(method, looping_prompt)


def test_the_eagle_base_has_k_decoder_layers_and_decodes_as_eagle(tiny_pair, looping_prompt):
    method = build(tiny_pair, "koala", eagle={"draft": "chain", "gamma": 3, "recipe": {"layers": 3}})
    draft = method.base.draft
    assert draft.module.config.num_hidden_layers == 3 and len(draft.module.body.layers) == 3
    assert method.report["layers"] == 3 and "discriminator_auc_mean" in method.report
    assert_greedy_equal_to_ar(method, prompts_for(tiny_pair, 2) + [looping_prompt])
    out = decode(tiny_pair, "koala", looping_prompt, max_new=16, eagle={"draft": "chain", "recipe": {"layers": 3}})
    assert out.extra["base"] == "eagle" and out.extra["draft"] == "chain"
    assert tiny_pair.roles["eagle"].calls > 0  # the K-layer draft is the counted role, its FLOPs K layers'


def test_adversarial_null_keeps_the_k_layers_without_a_discriminator(tiny_pair):
    method = build(tiny_pair, "koala", base="medusa", medusa={"recipe": {"adversarial": None}})
    assert method.base.heads.module.layers == 2 and "discriminator_auc_mean" not in method.report


def test_the_adversarial_term_pulls_a_head_towards_the_targets_distributions():
    """A "head" of free logits, trained by the adversarial term alone against a target that always puts its
    mass on token 0, moves its mass there; the discriminator first tells the two apart."""
    torch.manual_seed(0)
    vocab = 16
    logits = torch.zeros(64, vocab, requires_grad=True)
    p = torch.full((64, vocab), 0.01)
    p[:, 0] = 1 - 0.01 * (vocab - 1)
    adversary = Adversary(vocab, AdversaryRecipe(weight=1.0, hidden=32, lr=1e-3, positions=64))
    opt = torch.optim.Adam([logits], lr=0.05)
    keep = torch.ones(64, dtype=torch.bool)
    before = torch.softmax(logits, -1)[:, 0].mean().item()
    for step in range(150):
        loss = adversary.term(torch.log_softmax(logits, -1), lambda rows: p[rows], keep)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 10:  # before the head has moved much, the discriminator tells them apart
            assert adversary.report()["discriminator_auc_last"] > 0.9
    after = torch.softmax(logits, -1)[:, 0].mean().item()
    assert before == pytest.approx(1 / vocab) and after > 0.5
    assert all(w.grad is not None for w in adversary.disc.parameters())  # it trained, on its own loss


def test_the_base_methods_keep_their_cache_keys(tiny_pair):
    """The settings KOALA added to the base recipes are keyed only when set: EAGLE's and Medusa's parts trained
    before them are still found; KOALA's, with K layers and a discriminator, are cached apart."""
    eagle = method_cfg("eagle").recipe
    assert recipe_key(eagle, layers=1, adversarial=None) == {k: v for k, v in dict(eagle).items()
                                                             if k not in ("layers", "adversarial")}
    koala = method_cfg("koala").eagle.recipe
    assert {"layers", "adversarial"} <= set(recipe_key(koala, layers=1, adversarial=None))
    teacher = tiny_pair.teacher
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    assert eagle_artifact(target, tok, eagle, teacher).folder(teacher.cache) != \
        eagle_artifact(target, tok, koala, teacher).folder(teacher.cache)


def test_bad_input_is_one_sentence(compose_cfg, capsys):
    from bench.__main__ import main

    assert main(["run", "pair=tiny", "method=koala", "method.base=hydra"]) == 2
    err = capsys.readouterr().err
    assert "method.base='hydra' is not allowed; it takes one of: medusa, eagle" in err and err.count("\n") == 1
    assert main(["run", "pair=tiny", "method=koala", "recipe.store.hidden=false"]) == 2
    assert "method=koala reads the target's hidden states" in capsys.readouterr().err
    assert main(["run", "pair=tiny", "method=koala", "method.eagle.recipe.layers=0"]) == 2
    assert "method.eagle.recipe.layers" in capsys.readouterr().err


def test_train_all_trains_koala_over_each_base(cache_dir, capsys):
    import json

    from bench.__main__ import main

    assert main(["train", "all", "pair=tiny", f"cache_dir={cache_dir}", "recipe=smoke"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert reports["koala (base=medusa)"]["layers"] == reports["koala (base=eagle)"]["layers"] == 2
    assert {"medusa", "eagle", "hydra", "sprinter"} <= set(reports)
