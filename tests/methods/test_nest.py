"""NEST (methods/nest.py, methods/_nest.py) on the tiny pair, with a datastore of the 50 held-out Lee articles
(built in a second): the mixture is a distribution, a copied span is proposed, kept and cited, the relaxed rule
can reject, attribution adds up, the records carry it with quality figures, and bad datastores are refused."""

import dataclasses
import json
import shutil

import pytest
import torch

from core.corpus import lee_articles
from core.errors import BenchError
from tests.core.test_bad_files import assert_one_sentence, cli
from tests.helpers import build, noisy_copy, run, run_keeping_state

NEWS = {"corpus": "news"}  # the small datastore: 50 articles, ~23k tokens on the byte-level tiny tokenizer


@pytest.fixture(scope="module")
def nest(tiny_pair):
    return build(tiny_pair, "nest", **NEWS)


@pytest.fixture(scope="module")
def article(tiny_pair):
    """A held-out Lee article as the prompt: the datastore holds it, so retrieval finds it."""
    return tiny_pair.tokenizer(lee_articles("test")[0], add_special_tokens=False)["input_ids"]


def test_knn_distribution_and_mixture_are_distributions(nest, tiny_pair):
    from methods._nest import TokenIndex

    store = nest.store
    index = TokenIndex(store, store.retrieve(lee_articles("test")[3], 4), tiny_pair.device)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, tiny_pair.target.module.config.hidden_size, generator=gen)
    logits = torch.randn(5, tiny_pair.target.module.config.vocab_size, generator=gen)
    for mix in (nest.mixture(index, logits, h), nest.mixture(index, None, h)):
        for p in (mix.p, mix.p_knn):
            assert (p >= 0).all() and torch.allclose(p.sum(-1), torch.ones(5), atol=1e-5)
        assert ((mix.lam >= 0) & (mix.lam <= 1)).all() and (mix.top >= 0).all()
        # The best neighbour's token is one p_kNN gives mass to.
        assert (mix.p_knn.gather(1, index.vals[mix.top][:, None]) > 0).all()
    mix = nest.mixture(index, logits, h)
    assert ((mix.lam > 0) & (mix.lam < 1)).all()  # the RRC weight is a sigmoid: strictly inside
    index.alive[:] = False  # every position copied: the LM alone, lambda = 1
    alone = nest.mixture(index, logits, h)
    assert torch.equal(alone.lam, torch.ones(5)) and torch.allclose(alone.p, torch.softmax(logits / 0.7, -1))


def _cited_tokens_are_the_sources(method, out, state):
    """Every cited output token is its source document's token at its position; returns the cited count."""
    cited = 0
    assert len(state.sources) == len(out.output_ids)
    for tok, src in zip(out.output_ids, state.sources):
        if src is not None:
            assert tok == int(method.store.doc_tokens(src[0])[src[1]])
            cited += 1
    return cited


def test_a_copied_span_is_proposed_kept_and_cited(tiny_pair, article):
    # delta = 1 copies whenever retrieval has a neighbour; gamma = 0 keeps every copied token (p_M > 0).
    method = build(tiny_pair, "nest", delta=1.0, gamma=0.0, **NEWS)
    out, state = run_keeping_state(method, article, 40)
    x = out.extra
    assert x["spans_proposed"] >= 2 and x["spans_accepted"] == x["spans_proposed"]
    assert x["span_tokens_accepted"] == x["span_tokens_proposed"] == sum(out.drafted) > 0
    assert max(out.accept_lengths) > 1 and sum(out.accept_lengths) / len(out.accept_lengths) > 2
    assert x["attribution_rate"] > 0.9 and x["attribution_rate_spans"] > 0.9
    assert x["retrieved"][0] == "lee-test-0" and x["sources"][0]["doc"] == "lee-test-0"
    assert _cited_tokens_are_the_sources(method, out, state) == x["attributed_tokens"]


def test_compiled_nest_reads_the_queries_the_eager_one_reads(tiny_pair, article, compiled):
    """compile=true: NEST's queries (the states entering the target's last layer) come out of the compiled forwards'
    graphs instead of a hook, which would not run inside them: the same copies, kept and cited, the same tokens."""
    eager = build(tiny_pair, "nest", delta=1.0, gamma=0.0, **NEWS)
    method = build(compiled(tiny_pair), "nest", delta=1.0, gamma=0.0, **NEWS)
    want = run(eager, article, 40)
    got = run(method, article, 40)
    assert got.output_ids == want.output_ids and got.accept_lengths == want.accept_lengths
    assert got.extra["spans_proposed"] >= 2
    # The same spans and sources; the mixture's mean weight only to rounding (the compiled kernels sum otherwise).
    assert got.extra["retrieval_weight"] == pytest.approx(want.extra["retrieval_weight"], rel=1e-5)
    assert {**got.extra, "retrieval_weight": 0} == {**want.extra, "retrieval_weight": 0}
    assert method.pair.target.compiled.tapped == 0  # the taps let go when the decode ended


def test_the_relaxed_rule_can_reject(tiny_pair, article):
    # gamma = 1.9: a token stays only with p_M(x) > 0.95 max p_M. The neighbour's token that starts a copy holds
    # the mixture's maximum (retrieval is confident on the article), so copies start; their tokens do not stay.
    method = build(tiny_pair, "nest", gamma=1.9, **NEWS)
    out = run(method, article, 30)
    assert out.extra["spans_proposed"] > 0 and out.extra["span_tokens_accepted"] == 0
    assert out.extra["spans_accepted"] == 0 and set(out.accept_lengths) == {1}
    assert len(out.output_ids) == 30


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_attribution_adds_up(nest, article, temperature):
    out, state = run_keeping_state(nest, article, 32, temperature=temperature)
    x = out.extra
    n = len(out.output_ids)
    assert x["attributed_tokens"] == _cited_tokens_are_the_sources(nest, out, state)
    assert x["attribution_rate"] == pytest.approx(x["attributed_tokens"] / n)
    assert sum(s["tokens"] for s in x["sources"]) == x["attributed_tokens"]
    assert 0 <= x["attribution_rate_spans"] <= x["attribution_rate"]
    assert all(s["title"] for s in x["sources"])
    assert x["span_tokens_accepted"] <= x["span_tokens_proposed"] and x["spans_accepted"] <= x["spans_proposed"]
    assert sum(out.accept_lengths) + 1 == n  # the prefill gives the first token
    # A copied position is never retrieved again.
    cited = [s for s in state.sources if s is not None]
    assert len(set(cited)) == len(cited)


def test_records_carry_quality_and_attribution(compose_cfg, tmp_path):
    from bench.runner import run as run_harness

    run_harness(compose_cfg("pair=tiny", "method=nest", "method.corpus=news", "dataset=news", "max_new_tokens=12",
                            "dataset.n_prompts=2", "warmup=0"), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    mine = [r for r in records if r["method"] == "nest"]
    assert len(mine) == 2 and all(r["lossless"] is False for r in mine)
    assert all({"token_agreement", "rougeL_vs_baseline", "perplexity"} <= set(r["quality"]) for r in mine)
    assert all(0 <= r["extra"]["attribution_rate"] <= 1 and "sources" in r["extra"] for r in mine)
    assert all(r["quality"]["attribution"] == r["extra"]["attribution_rate"] for r in mine)
    from bench.summary import display_table, run_summary

    table = display_table(run_summary(tmp_path))
    assert "attribution" in table.columns and table.loc[table["label"] == "ar", "attribution"].isna().all()


def test_wiki_local_prompts_come_from_packaged_text(compose_cfg):
    from bench.data import load_prompts

    prompts = load_prompts(compose_cfg("dataset=wiki_local").dataset, 0)
    assert len(prompts) == 6 and all(p.prompt_id.startswith("wiki-") and p.reference for p in prompts)
    assert all(p.reference not in p.turns[0] and len(p.turns[0]) <= 1500 for p in prompts)


# ------------------------------------------------------------------------------------------- bad datastores


def test_a_missing_datastore_is_one_sentence_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = cli(["run", "pair=tiny", "method=nest", f"method.datastore={tmp_path}/nowhere",
                     f"hydra.run.dir={out}"], capsys)
    assert_one_sentence(code, err, "method.datastore", "does not exist")
    assert not out.exists()
    (tmp_path / "empty").mkdir()
    code, err = cli(["run", "pair=tiny", "method=nest", f"method.datastore={tmp_path}/empty",
                     f"hydra.run.dir={out}"], capsys)
    assert_one_sentence(code, err, "method.datastore", "no readable manifest.json")
    assert not out.exists()


def test_a_datastore_of_another_target_or_tokenizer_is_refused(nest, tiny_pair, tmp_path):
    from core.counting import CountedLM

    folder = nest.store.folder
    assert build(tiny_pair, "nest", datastore=str(folder), **NEWS).store.report["keys"] == nest.store.report["keys"]
    with pytest.raises(BenchError, match=r"was built with method.corpus=news; run with the same settings"):
        build(tiny_pair, "nest", datastore=str(folder))  # the default corpus is news+wiki: records would misstate it
    other = dataclasses.replace(tiny_pair, target=CountedLM(noisy_copy(tiny_pair.target.module), "target"), roles={})
    with pytest.raises(BenchError, match="was built for another target") as err:
        build(other, "nest", datastore=str(folder), **NEWS)
    assert len(str(err.value).splitlines()) == 1
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["key"]["tokenizer"] = "0" * 16
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BenchError, match="was built for another tokenizer"):
        build(tiny_pair, "nest", datastore=str(copy), **NEWS)
    (copy / "keys.npy").write_bytes(b"torn")
    with pytest.raises(BenchError, match="cannot be used"):
        build(tiny_pair, "nest", datastore=str(copy), **NEWS)


def test_the_key_capture_is_let_go_when_a_decode_fails(nest, article, monkeypatch):
    """The hook NEST puts on the target's last layer for one prompt is removed however the decode ends, by an error
    too (the base closes what a prompt opened): the target is left as it was for whatever runs next."""
    from core.model_parts import decoder_layers

    layer = decoder_layers(nest.pair.target.module)[-1]
    before = len(layer._forward_pre_hooks)

    def broken(state):
        assert len(layer._forward_pre_hooks) == before + 1  # the capture is on while the prompt decodes
        raise RuntimeError("a failing step")

    monkeypatch.setattr(nest, "propose", broken)
    with pytest.raises(RuntimeError, match="a failing step"):
        run(nest, article, 8)
    assert len(layer._forward_pre_hooks) == before
