"""Amphista beyond the registry walk (``tests/methods/test_methods.py`` covers greedy equality and the sampling test at
its defaults): untrained parts are Medusa's heads, the adaptation layers read each committed position once with
the token after it, the roles are counted, training moves every new part, and bad settings."""

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from core.errors import BenchError
from decoding.sampling import Sampling
from methods.base import forwards_of
from methods.heads._amphista import AmphistaHeads
from methods.heads._heads import Heads
from tests.helpers import assert_greedy_equal_to_ar, build, prompts_for


@pytest.fixture()
def pair(tiny_pair):
    """The tiny pair with a role table of its own (the adapt and heads roles do not leak into other tests)."""
    return dataclasses.replace(tiny_pair, roles={})


@pytest.fixture()
def amphista(pair):
    return build(pair, "amphista", recipe={"vocab": 200, "batch_size": 8})


def test_untrained_amphista_heads_propose_what_medusas_do(tiny_pair):
    """Every new part starts as the identity, so untrained Amphista heads are untrained Medusa heads."""
    torch.manual_seed(0)
    target = tiny_pair.target.module
    vocab_map = torch.arange(200)
    amph = AmphistaHeads(target.config, 4, vocab_map, stages=2)
    amph.init_from(target)
    medusa = Heads("medusa", target.config.hidden_size, 4, vocab_map)
    medusa.init_from(target)
    hidden, emb = torch.randn(2, 9, 64), torch.randn(2, 9, 64)
    with torch.no_grad():
        staged = amph.adapt(hidden, emb)
        assert staged.shape == (2, 9, 2, 64) and torch.equal(staged[:, :, 1], hidden)
        torch.testing.assert_close(amph.eval()(staged), medusa.eval()(hidden))


@pytest.mark.parametrize("stages, heads, reads", [(2, 4, [0, 0, 1, 1]), (1, 4, [0, 0, 0, 0]), (3, 4, [0, 1, 2, 2]),
                                                  (4, 4, [0, 1, 2, 3])])
def test_later_heads_read_later_stages(tiny_pair, stages, heads, reads):
    amph = AmphistaHeads(tiny_pair.target.module.config, heads, torch.arange(10), stages=stages)
    assert amph.stage_of.tolist() == reads


def test_training_moves_every_new_part(amphista):
    heads = amphista.heads.module
    assert all(stage.gamma.abs().sum() > 0 for stage in heads.stages)  # the adaptation layers are no longer the identity
    assert heads.auto.layer.linear2.weight.abs().sum() > 0 and heads.auto.position.abs().sum() > 0
    assert len(amphista.report["agreement_after"]) == 4


def test_adaptation_layers_read_each_committed_position_once_with_the_token_after_it(pair, amphista):
    """The heads' input at every step equals the adaptation layers run over the whole committed sequence at
    once, each position with the token after it: the caches hold exactly the committed positions, in order."""
    heads = amphista.heads.module
    with torch.no_grad():
        for stage in heads.stages:
            torch.nn.init.normal_(stage.gamma)  # far from the identity, so the attention's output matters
    seen = []
    inner = amphista.heads_input

    def spy(hiddens, next_ids, memory):
        out = yield from forwards_of(inner(hiddens, next_ids, memory))
        seen.append(out)
        return out

    amphista.heads_input = spy
    ids = prompts_for(pair, 1)[0]
    pair.reset_counts()
    with torch.inference_mode():
        out = amphista.decode(torch.tensor([ids]), 40, Sampling(0.0, 1.0), torch.Generator().manual_seed(0), lambda n: None)
        seq = torch.tensor([ids + out.output_ids])
        hidden = pair.target.module(seq, output_hidden_states=True).hidden_states[-1]
        emb = pair.target.module.get_input_embeddings()(seq[:, 1:])
        whole = heads.adapt(hidden[:, :-1], emb)[0]  # (positions, S, H)
    steps = len(out.accept_lengths)
    ends = [len(ids) - 1] + [len(ids) - 1 + sum(out.accept_lengths[: i + 1]) for i in range(steps - 1)]
    assert len(seen) == len(ends) == steps > 2
    torch.testing.assert_close(torch.stack(seen), whole[ends], atol=1e-4, rtol=1e-4)
    counts = pair.counts()
    assert counts["target"]["calls"] == steps + 1  # still ONE target forward per tree
    stages = [f"adapt{s + 1}" for s in range(len(heads.stages))]
    for role in stages:  # every committed position, even before a last step with no room to draft
        assert counts[role]["calls"] == steps and counts[role]["tokens"] == len(ids) + sum(out.accept_lengths[:-1])
    assert steps - 1 <= counts["heads"]["calls"] <= steps
    assert 0 < counts["heads"]["flops"] and 0 < sum(counts[r]["flops"] for r in stages) < counts["target"]["flops"]


def test_amphista_with_one_stage_and_deeper_heads_is_lossless(pair, looping_prompt):
    method = build(pair, "amphista", recipe={"vocab": 200, "batch_size": 8, "stages": 1, "layers": 2})
    assert len(method.heads.module.stages) == 1 and method.heads.module.layers == 2
    assert_greedy_equal_to_ar(method, prompts_for(pair, 2) + [looping_prompt])


@pytest.mark.parametrize("over, words", [
    ({"recipe": {"stages": 5}}, r"recipe.stages \(5\) must not exceed recipe.num_heads \(4\)"),
    ({"recipe": {"stages": 0}}, "method.recipe.stages=0 is not allowed"),
    ({"recipe": {"prefix_layer": True}}, "staged adaptation layers take its place"),
])
def test_bad_settings_raise_one_sentence(compose_cfg, over, words):
    from bench.validate import validate

    cfg = compose_cfg("method=amphista", "pair=tiny")
    cfg.method = OmegaConf.merge(cfg.method, over)
    with pytest.raises(BenchError, match=words):
        validate(cfg)

