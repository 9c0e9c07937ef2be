"""Medusa / Hydra draft heads and tree verification, on the tiny random pair (heads trained in seconds)."""

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from core.errors import BenchError
from decoding.sampling import Sampling
from methods.registry import get_method
from tests.helpers import decode, forwards_run, prompts_for
from tests.helpers import method_cfg as shipped_cfg

TINY_RECIPE = {"vocab": 200, "batch_size": 8}  # and the tiny pair's smoke recipe: 4096 teacher tokens
HEAD_METHODS = ["medusa", "hydra", "hydra_pp"]


def smoke(cache):
    """The smoke recipe's teacher, its stores and trained parts under ``cache``."""
    from training.recipes import RECIPES
    from training.teacher import Teacher

    return Teacher(RECIPES["smoke"], cache)


def cached_heads(target, tok, kind, recipe, cache, train_if_missing=True):
    """``((heads, prefix), report)`` of ``kind`` under the smoke recipe's teacher in ``cache``, as a method's setup
    reads them (trained first when missing and ``train_if_missing``)."""
    from methods.heads._train import heads_artifact
    from training.kit import load_or_train

    return load_or_train(heads_artifact(target, tok, kind, recipe, smoke(cache)), cache, train_if_missing)


def method_cfg(name, **over):
    """The shipped settings of ``name`` with a tiny training recipe (and ``over`` on top), as keywords."""
    cfg = OmegaConf.merge(shipped_cfg(name), {"recipe": TINY_RECIPE}, over)
    return {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "name"}


@pytest.fixture()
def pair(tiny_pair):
    """The tiny pair with a role table of its own, so the heads role does not leak into other tests."""
    return dataclasses.replace(tiny_pair, roles={})


@pytest.mark.parametrize("name", HEAD_METHODS)
def test_heads_equal_ar_greedy(pair, name):
    cfg = method_cfg(name)
    for ids in prompts_for(pair, 3):
        ar = decode(pair, "ar", ids, max_new=40)
        out = decode(pair, name, ids, max_new=40, **cfg)
        assert out.output_ids == ar.output_ids
        assert sum(out.accept_lengths) + 1 == len(out.output_ids)
        assert out.extra["tree_size"] == 20 and max(out.drafted) == 4  # depth: per-position acceptance follows
    # Hydra++ runs its prefix layer (a role of its own); the others have none.
    assert (pair.counts().get("prefix", {}).get("calls", 0) > 0) == (name == "hydra_pp")


def test_heads_equal_ar_with_a_wide_odd_tree(pair):
    """A tree with gaps in its ranks and an uneven shape; the budget prunes it near the end."""
    tree = [[0], [2], [5], [0, 3], [2, 0], [2, 1], [0, 3, 0], [2, 1, 4]]
    for name in ("medusa", "hydra"):
        ids = prompts_for(pair, 1)[0]
        ar = decode(pair, "ar", ids, max_new=29)
        out = decode(pair, name, ids, max_new=29, **method_cfg(name, tree=tree))
        assert out.output_ids == ar.output_ids
        assert out.extra["tree_size"] == 9


def test_heads_are_counted_and_report_agreement(pair):
    cfg = OmegaConf.create({"name": "hydra", **method_cfg("hydra")})
    method = get_method("hydra")(cfg, pair)
    method.setup()
    assert len(method.report["agreement_after"]) == 4
    assert all(0 <= a <= 1 for a in method.report["agreement_after"])
    assert len(method.report["answer_token_agreement"]) == 4 and all(
        0 <= a <= 1 for a in method.report["answer_token_agreement"])
    pair.reset_counts()
    out = decode(pair, "hydra", prompts_for(pair, 1)[0], max_new=30, **method_cfg("hydra"))
    counts = pair.counts()
    steps = len(out.accept_lengths)
    assert counts["target"]["calls"] == steps + 1  # prefill + ONE forward per tree
    assert counts["heads"]["calls"] > 0 and counts["heads"]["flops"] > 0


def _hydra_pp(pair):
    method = get_method("hydra_pp")(OmegaConf.create({"name": "hydra_pp", **method_cfg("hydra_pp")}), pair)
    method.setup()
    return method


def test_prefix_layer_is_counted_as_its_own_role(pair):
    method = _hydra_pp(pair)
    assert method.report["prefix_layer"] is True and len(method.report["agreement_after"]) == 4
    assert method.prefix.module.gamma.abs().sum() > 0  # trained with the heads: no longer the identity
    ids = prompts_for(pair, 1)[0]
    pair.reset_counts()
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        out = method.decode(torch.tensor([ids]), 30, Sampling(0.0, 1.0), gen, lambda n: None)
    counts = pair.counts()
    steps = len(out.accept_lengths)
    assert steps > 1 and counts["target"]["calls"] == steps + 1  # still ONE target forward per tree
    # Fed once after the prefill and after every step but the last: each committed position exactly once.
    assert counts["prefix"]["calls"] == steps
    assert counts["prefix"]["tokens"] == len(ids) + sum(out.accept_lengths[:-1])
    assert counts["prefix"]["flops"] > 0
    assert counts["prefix"]["flops"] < counts["target"]["flops"]  # one layer, no output head


def test_untrained_prefix_layer_is_the_identity(tiny_pair):
    from methods.heads._heads import PrefixLayer

    layer = PrefixLayer.from_target(tiny_pair.target.module)
    hidden = torch.randn(2, 7, 64)
    with torch.no_grad():
        assert torch.equal(layer(hidden), hidden)  # so untrained Hydra++ heads start where Hydra's do
        layer.gamma.fill_(1.0)
        assert not torch.allclose(layer(hidden), hidden)


def test_prefix_layer_cache_equals_the_whole_sequence_at_once(tiny_pair):
    from methods.heads._heads import PrefixLayer

    torch.manual_seed(0)
    layer = PrefixLayer.from_target(tiny_pair.target.module).eval()
    torch.nn.init.normal_(layer.gamma)  # far from the identity, so the attention's output matters
    hidden = torch.randn(1, 23, 64)
    with torch.no_grad():
        whole = layer(hidden)
        cache = DynamicCache()
        parts = [layer(hidden[:, a:b], cache) for a, b in [(0, 9), (9, 10), (10, 14), (14, 15), (15, 23)]]
    assert cache.get_seq_length() == 23
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_prefix_layer_while_decoding_equals_it_over_the_committed_sequence(pair):
    """The heads' input at every step equals the prefix layer run over the target's hidden states of the
    whole committed sequence at once: the layer's cache holds exactly the committed positions, in order."""
    method = _hydra_pp(pair)
    with torch.no_grad():
        torch.nn.init.normal_(method.prefix.module.gamma)
    seen = []
    inner = method.heads_input
    method.heads_input = lambda *args: seen.append(forwards_run(inner(*args))) or seen[-1]
    ids = prompts_for(pair, 1)[0]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        out = method.decode(torch.tensor([ids]), 40, Sampling(0.0, 1.0), gen, lambda n: None)
        seq = torch.tensor([ids + out.output_ids])
        hidden = pair.target.module(seq, output_hidden_states=True).hidden_states[-1]
        whole = method.prefix.module(hidden)[0]
    # After the prefill the last committed position is the prompt's last; after step i, i accept lengths on.
    ends = [len(ids) - 1] + [len(ids) - 1 + sum(out.accept_lengths[: i + 1]) for i in range(len(out.accept_lengths) - 1)]
    assert len(seen) == len(ends) > 2
    torch.testing.assert_close(torch.stack(seen), whole[ends], atol=1e-4, rtol=1e-4)


def test_sampling_verifies_the_tree_and_typical_is_lossy(pair):
    ids = prompts_for(pair, 1)[0]
    a = decode(pair, "medusa", ids, max_new=20, temperature=0.8, seed=3, **method_cfg("medusa"))
    b = decode(pair, "medusa", ids, max_new=20, temperature=0.8, seed=3, **method_cfg("medusa"))
    assert a.output_ids == b.output_ids and len(a.output_ids) == 20
    assert a.extra["verify"] == "tree" and "typical" not in a.extra
    t = decode(pair, "hydra", ids, max_new=20, temperature=0.8, seed=3, **method_cfg("hydra", typical=True))
    assert t.extra["verify"] == "typical" and t.extra["typical"] is True and len(t.output_ids) == 20
    cfg = OmegaConf.create({"name": "hydra", **method_cfg("hydra", typical=True)})
    method = get_method("hydra")(cfg, pair)
    assert method.is_lossless(Sampling(0.8)) is False and method.is_lossless(Sampling(0.0)) is True


@pytest.mark.parametrize("over, words", [
    ({"tree": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]}, "only 4 heads"),
    ({"tree": [[0], [1, 0]]}, "no parent"),
    ({"tree": [[0], [-1]]}, r"method.tree=\[\[0\], \[-1\]\] is not allowed; it takes a non-empty string or a list of lists of integers >= 0"),
    ({"tree": "mc_sim_7b_64"}, r"tree .mc_sim_7b_64. is not a known tree \(default, mc_sim_7b_63\)"),
    ({"tree": []}, r"method.tree=\[\] is not allowed"),
    ({"tree": "wide"}, "tree .wide. is not a known tree"),
    ({"recipe": {"loss": "mse"}}, "recipe.loss"),
    ({"recipe": {"num_heads": 0}}, "num_heads"),
    ({"recipe": {"prefix_layer": "yes"}}, "prefix_layer"),
    ({"posterior_alpha": 2.0}, "posterior_alpha"),
])
def test_bad_settings_raise_one_sentence(compose_cfg, over, words):
    from bench.validate import validate

    cfg = compose_cfg("method=medusa", "pair=tiny")
    cfg.method = OmegaConf.merge(cfg.method, over)
    with pytest.raises(BenchError, match=words):
        validate(cfg)


def test_corrupt_heads_cache_is_retrained_or_one_sentence(tmp_path, tiny_pair):
    from methods.heads._train import heads_artifact

    recipe = OmegaConf.create(method_cfg("medusa")["recipe"])
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    with pytest.raises(BenchError, match=r"no cached medusa heads at .*; run 'python -m bench train method method=medusa'"):
        cached_heads(target, tok, "medusa", recipe, tmp_path, train_if_missing=False)
    (heads, _), report = cached_heads(target, tok, "medusa", recipe, tmp_path)
    assert len(report["agreement_after"]) == heads.num_heads  # the training report comes with the cached heads
    path = heads_artifact(target, tok, "medusa", recipe, smoke(tmp_path)).folder(tmp_path) / "heads.pt"
    size = path.stat().st_size
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(BenchError, match=r"medusa heads at .* cannot be used \(heads.pt has 16 bytes.*python -m bench"):
        cached_heads(target, tok, "medusa", recipe, tmp_path, train_if_missing=False)
    (again, _), _ = cached_heads(target, tok, "medusa", recipe, tmp_path)  # building allowed: retrained
    assert path.stat().st_size == size and again.num_heads == heads.num_heads


def write_foreign_heads(folder, blob):
    """A heads file saved under ``folder`` with a manifest that matches it (as an older build would leave):
    only loading it can tell that it does not fit."""
    import json

    from core.artifacts import file_sha256

    folder.mkdir(parents=True, exist_ok=True)
    torch.save(blob, folder / "heads.pt")
    files = {"heads.pt": {"bytes": (folder / "heads.pt").stat().st_size, "sha256": file_sha256(folder / "heads.pt")}}
    (folder / "manifest.json").write_text(json.dumps({"files": files}))


def test_heads_cache_without_the_recipes_prefix_layer_is_retrained_or_one_sentence(tmp_path, tiny_pair):
    """A heads file that lacks (or carries a broken) prefix layer the recipe asks for: one sentence naming the
    folder, no traceback; retrained when building is allowed."""
    from methods.heads._heads import Heads, PrefixLayer
    from methods.heads._train import heads_artifact

    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    recipe = OmegaConf.create(method_cfg("hydra_pp")["recipe"])
    folder = heads_artifact(target, tok, "hydra", recipe, smoke(tmp_path)).folder(tmp_path)
    heads = Heads("hydra", 64, 4, torch.arange(200))
    blob = {"kind": "hydra", "hidden": 64, "num_heads": 4, "state": heads.state_dict(), "prefix": None}
    write_foreign_heads(folder, blob)
    with pytest.raises(BenchError, match=r"hydra heads at .* cannot be loaded \(ValueError: it lacks a prefix layer, "
                                         r"unlike method.recipe.prefix_layer\); run 'python -m bench train method"):
        cached_heads(target, tok, "hydra", recipe, tmp_path, train_if_missing=False)
    state = PrefixLayer.from_target(target).state_dict()
    state["gamma"] = torch.zeros(65)  # saved for another target
    write_foreign_heads(folder, {**blob, "prefix": state})
    with pytest.raises(BenchError, match=r"cannot be loaded \(RuntimeError"):
        cached_heads(target, tok, "hydra", recipe, tmp_path, train_if_missing=False)
    (_, prefix), _ = cached_heads(target, tok, "hydra", recipe, tmp_path)  # building allowed: retrained
    assert prefix is not None
    no_prefix = OmegaConf.merge(recipe, {"prefix_layer": False})
    write_foreign_heads(heads_artifact(target, tok, "hydra", no_prefix, smoke(tmp_path)).folder(tmp_path),
                        {**blob, "prefix": PrefixLayer.from_target(target).state_dict()})
    with pytest.raises(BenchError, match="it has a prefix layer"):  # a prefix layer where the recipe has none
        cached_heads(target, tok, "hydra", no_prefix, tmp_path, train_if_missing=False)


def test_typical_acceptance_breaks_ties_by_likelihood():
    """Two equally deep paths both stand: the one the target finds more likely wins (Medusa's
    evaluate_posterior), not the first in breadth-first order."""
    from decoding.tree import Tree
    from methods.heads._tree_heads import typical_path

    tree = Tree.from_paths([[0], [1]]).fill([0, 1, 2])  # root, then tokens 1 and 2 as siblings
    logits = torch.full((3, 5), -10.0)
    logits[0, 1], logits[0, 2] = 0.0, 1.0  # after the root: token 2 is likelier than token 1, both above the bar
    path, _ = typical_path(tree, logits, Sampling(1.0, 1.0), torch.Generator().manual_seed(0), 0.09, 0.3)
    assert path == [0, 2]
    logits[0, 1], logits[0, 2] = 1.0, 0.0
    path, _ = typical_path(tree, logits, Sampling(1.0, 1.0), torch.Generator().manual_seed(0), 0.09, 0.3)
    assert path == [0, 1]


@pytest.mark.parametrize("name", ["medusa", "hydra", "hydra_pp", "amphista"])
def test_heads_need_the_stores_hidden_states(name, capsys):
    """Said before any model loads, as for eagle and koala."""
    from bench.__main__ import main

    assert main(["run", "pair=tiny", f"method={name}", "recipe.store.hidden=false"]) == 2
    assert f"method={name} reads the target's hidden states" in capsys.readouterr().err
