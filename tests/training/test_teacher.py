"""The teacher store on the tiny pair: what it holds equals the target's own outputs, growing keeps what was
labelled, a killed build resumes at the first missing shard, and ``train store`` builds it from the CLI."""

import json

import numpy as np
import pytest
import torch

from core.errors import BenchError
from training import store as teacher_store
from training.recipes import StoreSettings
from training.store import load_or_grow_store, shard_kinds

SMALL = dict(seq_len=32, shard_sequences=4, answers=1 / 3, answer_tokens=8, answer_batch=4, corpus="lee", topk=5,
             batch_size=4)
PER_SHARD = 4 * 32


def grow(pair, shards: int, cache, split="train", build=True, **over):
    """The tiny pair's store of ``shards`` shards of SMALL (``over`` on top) under ``cache``."""
    settings = StoreSettings(**{**SMALL, **over})
    return load_or_grow_store(pair.target.module, pair.tokenizer, settings, cache, shards * PER_SHARD, split, build)


@pytest.fixture
def counted_labels(monkeypatch):
    """Counts labelling calls (one per shard built); ``fail_at`` makes that call raise, as a kill would."""
    calls = {"n": 0, "fail_at": None}
    real = teacher_store.label

    def label(target, ids, s):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise KeyboardInterrupt("killed")
        return real(target, ids, s)

    monkeypatch.setattr(teacher_store, "label", label)
    return calls


def test_shards_hold_the_targets_own_outputs(tiny_pair, tmp_path):
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    store = grow(tiny_pair, 3, tmp_path)
    assert [k for k, _ in shard_kinds(store.settings, 3)] == ["text", "text", "answers"]
    assert len(store) == 12 and store.tokens <= 3 * PER_SHARD
    assert isinstance(store.shards[0]["hidden"], np.memmap)  # read from disk on demand
    rows = store.rows(range(12))
    with torch.inference_mode():
        out = target(rows["ids"], output_hidden_states=True)
    probs = torch.softmax(out.logits.float(), -1)
    m = rows["mask"]
    # idx[..., 0] is the target's greedy next token wherever a position is labelled; prob its probability.
    assert torch.equal(rows["idx"][..., 0][m], out.logits.argmax(-1)[m])
    assert torch.allclose(rows["prob"][..., 0][m], probs.max(-1).values[m], atol=2e-3)
    assert (rows["prob"][..., :-1] >= rows["prob"][..., 1:]).all()  # top-k in order
    assert torch.allclose(rows["hidden"][m], out.hidden_states[-1][m], atol=2e-2, rtol=1e-2)
    # Text shards are the corpus stream in order; answer rows end in the target's greedy continuation.
    stream = teacher_store._Sources(tok, store.settings, "train").stream
    assert rows["ids"][:8].flatten().tolist() == stream[: 8 * 32]
    assert rows["mask"][:8].all()  # text has no padding
    src = teacher_store._Sources(tok, store.settings, "train")
    answers = teacher_store.target_answers(target, tok, src.prompts[:4], 4, 8, "answers")
    assert not rows["answer"][:8].any()  # text: no position is followed by an answer token
    for ids, mask, on, (prompt, answer, _, _) in zip(rows["ids"][8:], rows["mask"][8:], rows["answer"][8:], answers):
        n = int(mask.sum())
        assert mask[:n].all() and (ids[n:] == tok.eos_token_id).all()  # the row, then EOS padding
        assert ids[:n].tolist() == torch.cat([prompt, answer]).tolist()[-32:]  # the prompt's end, then the answer
        # ``answer`` marks the positions whose label (the next token) is the answer's: the target's greedy choice.
        at = on.nonzero().flatten()
        assert at.tolist() == list(range(n - len(answer) - 1, n - 1)) and len(at) == len(answer)
        # (their labels are the target's prediction from the row's context: a prompt cut to fit the row can make
        # it other than the token it generated from the whole prompt)


def test_growing_keeps_what_was_labelled(tiny_pair, tmp_path, counted_labels):
    small = grow(tiny_pair, 2, tmp_path)
    assert counted_labels["n"] == 2
    big = grow(tiny_pair, 4, tmp_path)
    assert counted_labels["n"] == 4  # only shards 2 and 3 were labelled
    assert len(big) == 2 * len(small) and big.folder == small.folder
    assert np.array_equal(big.shards[1]["prob"], small.shards[1]["prob"])
    assert big.report()["shards"] == 4 and big.report()["answers"]["shards"] == 1


def test_a_killed_build_resumes_at_the_first_missing_shard(tiny_pair, tmp_path, counted_labels):
    counted_labels["fail_at"] = 2
    with pytest.raises(KeyboardInterrupt):
        grow(tiny_pair, 3, tmp_path, answers=0)
    folder = next((tmp_path / "teacher").iterdir())
    assert sorted(p.name.split("-")[1] for p in folder.iterdir() if not p.name.startswith(".")) == ["00000"]
    counted_labels["fail_at"] = None
    store = grow(tiny_pair, 3, tmp_path, answers=0)
    assert counted_labels["n"] == 2 + 2 and len(store) == 12  # shard 0 kept; 1 (killed) and 2 built
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]  # nothing half-written left behind


def test_missing_store_and_exhausted_corpus_are_one_sentence(tiny_pair, tmp_path):
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    with pytest.raises(BenchError, match="no cached teacher store shard 0 .*python -m bench train store"):
        grow(tiny_pair, 1, tmp_path, build=False)
    with pytest.raises(BenchError, match=r"recipe.store.corpus 'lee' \(test split\) holds .* tokens, enough for"):
        load_or_grow_store(target, tok, StoreSettings(answers=0, corpus="lee"), tmp_path, 10**7, "test")


def test_train_store_from_the_command_line(tmp_path, capsys):
    from bench.__main__ import main

    args = ["train", "store", "pair=tiny", f"cache_dir={tmp_path}", f"tokens={2 * PER_SHARD}", f"eval_tokens={PER_SHARD}",
            *(f"recipe.store.{k}={v}" for k, v in {**SMALL, "answers": 0}.items())]
    assert main(args) == 0
    out = capsys.readouterr().out
    reports = json.loads(out[out.index("{"):])
    assert reports["test"]["sequences"] == 4 and "store-test-" in reports["test"]["folder"]
    report = reports["train"]
    assert report["shards"] == 2 and report["sequences"] == 8 and report["text"]["tokens"] == 2 * PER_SHARD
    assert report["answers"]["shards"] == 0 and report["text"]["tokens_per_s"] > 0


def test_store_settings_are_checked_before_any_model_loads(capsys):
    from bench.__main__ import main

    assert main(["train", "store", "pair=tiny", "tokens=0"]) == 2
    assert "recipe.tokens=0 is not allowed; it takes an integer >= 1" in capsys.readouterr().err


def test_a_trainer_reads_only_its_recipes_share_of_a_grown_store(tiny_pair, tmp_path):
    grow(tiny_pair, 4, tmp_path)
    store = grow(tiny_pair, 2, tmp_path, build=False)  # what a recipe of 2 shards' tokens reads
    assert len(store) == 8 and len(store.shards) == 2
    assert store.rows([7])["ids"].shape == (1, 32)
    with pytest.raises(IndexError):
        store.rows([8])


def test_too_little_disk_is_said_before_any_labelling(tiny_pair, tmp_path, counted_labels, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(BenchError, match=r"the teacher store needs .* GiB more for 2 shards but .* has 0.00 GiB free"):
        grow(tiny_pair, 2, tmp_path)
    assert counted_labels["n"] == 0


def test_every_trainer_reads_the_store_and_labels_nothing_itself(compose_cfg, tmp_path, monkeypatch):
    """Once ``train store`` has run, the distilled draft, Medusa/Hydra/Amphista heads, the SPRINTER verifier, EAGLE's
    draft layer, GliDe's draft and KOALA's heads all train from it: labelling (the target's teacher-forced pass or
    its answers) would fail the test. (GliDe's keys and values are a pass over the stored ids, not labelling.)"""
    from omegaconf import OmegaConf

    from bench.models import load_pair
    from methods.registry import get_method
    from tests.helpers import trained_pair

    cfg = compose_cfg("pair=tiny", f"cache_dir={tmp_path}")
    cfg.pair.drafts = [OmegaConf.create({"source": "distilled", "recipe": {"layers": [0], "vocab": 64}})]
    bare = load_pair(cfg, n_drafts=0)
    for split in ("train", "test"):
        bare.teacher.store(bare.target.module, bare.tokenizer, split)

    def no_labelling(*args, **kwargs):
        raise AssertionError("a trainer labelled text itself instead of reading the store")

    monkeypatch.setattr(teacher_store, "teacher_pass", no_labelling)
    monkeypatch.setattr(teacher_store, "target_answers", no_labelling)
    pair = trained_pair(cfg)  # distils the draft from the store
    reports = {"draft": pair.draft.module is not None}
    for name in ("medusa", "hydra", "hydra_pp", "amphista", "sprinter", "eagle", "glide"):
        method = get_method(name)(get_method(name).settings({"recipe": {"vocab": 64}} if name != "sprinter" else {}), pair)
        method.setup()
        reports[name] = method.report["recipe"]
    for base in ("medusa", "eagle"):  # KOALA's K-layer heads, trained against a discriminator
        method = get_method("koala")(get_method("koala").settings({"base": base, base: {"recipe": {"vocab": 64}}}), pair)
        method.setup()
        reports[f"koala/{base}"] = method.report["recipe"]
    assert reports == {"draft": True, "medusa": "smoke", "hydra": "smoke", "hydra_pp": "smoke", "amphista": "smoke",
                       "sprinter": "smoke", "glide": "smoke",
                       "eagle": "smoke", "koala/medusa": "smoke", "koala/eagle": "smoke"}


def test_a_truncated_shard_is_rebuilt_and_a_foreign_one_refused(tiny_pair, tmp_path, counted_labels):
    store = grow(tiny_pair, 2, tmp_path, answers=0)
    shard = sorted(p for p in store.folder.iterdir() if p.is_dir())[1]
    hidden = shard / "hidden.npy"
    hidden.write_bytes(hidden.read_bytes()[:1000])  # a copy cut short, a disk that filled up
    with pytest.raises(BenchError, match=r"teacher store shard 1 at .* cannot be used \(hidden.npy has 1000 bytes"):
        grow(tiny_pair, 2, tmp_path, build=False, answers=0)
    assert len(grow(tiny_pair, 2, tmp_path, answers=0)) == 8 and counted_labels["n"] == 3  # shard 1 labelled again
    # A shard whose manifest says it was labelled by other weights (files copied in by hand): refused, kept.
    manifest = json.loads((shard / "manifest.json").read_text())
    manifest["key"]["target"]["weights"] = "0" * 16
    (shard / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BenchError, match=r"shard 1 at .* was built for something else \(its target.weights differs\); "
                                         r"delete that folder"):
        grow(tiny_pair, 2, tmp_path, answers=0)
    assert counted_labels["n"] == 3


def test_mixed_instructions_cover_the_benchmarks_kinds_without_its_prompts():
    """``recipe.store.instructions=mixed``: packaged-text tasks two in five, then advice, explanations and word
    problems; the splits share nothing, and no instruction trained on is one of the default prompts."""
    from bench.data import builtin_prompts
    from core.corpus import CONVERSATION, GOALS, QA, TOPICS, instruction_prompts

    train, test = (instruction_prompts(10**6, 0, split, "mixed") for split in ("train", "test"))
    assert not set(train) & set(test)
    first = train[:500]
    maths = [p for p in first if p.endswith("Solve it step by step, then give the final answer.")]
    advice = [p for p in first if p in {t.format(g) for t in CONVERSATION for g in GOALS}]
    topics = [p for p in first if p in {t.format(x) for t in QA for x in TOPICS}]
    assert len(maths) == len(advice) == len(topics) == 100
    assert not {p.turns[0] for p in builtin_prompts({})} & set(train)  # (the held-out split reads Lee's test articles)
    assert instruction_prompts(50, 0, "train") == instruction_prompts(50, 0, "train", "news+wiki")


def test_mixed_instructions_share_the_text_shards_and_key_their_answers(tiny_pair, tmp_path, counted_labels):
    """Only answer shards depend on the instructions: a mixed store labels its answers anew and reuses the
    text shards; the default's keys are those of before the setting existed (no ``instructions`` in them)."""
    assert "instructions" not in StoreSettings().key() and StoreSettings(instructions="mixed").key()["instructions"]
    plain = grow(tiny_pair, 3, tmp_path)
    assert counted_labels["n"] == 3
    mixed = grow(tiny_pair, 3, tmp_path, instructions="mixed")
    assert counted_labels["n"] == 4  # its one answers shard
    assert np.array_equal(mixed.shards[0]["ids"], plain.shards[0]["ids"])
    assert not np.array_equal(mixed.shards[2]["ids"], plain.shards[2]["ids"])


def test_the_default_instructions_leave_run_keys_and_recipe_labels_as_they_were(compose_cfg):
    """Runs resumed across the setting's arrival keep their records: with ``news+wiki`` a trained method's run key
    and an overridden recipe's label are those of a config without ``instructions``; ``mixed`` changes both."""
    from omegaconf import OmegaConf

    from bench.results import run_key
    from bench.validate import validate
    from core.artifacts import content_key
    from training.recipes import RecipeSettings

    cfg = validate(compose_cfg("method=medusa"))
    before = OmegaConf.to_container(cfg, resolve=True)
    del before["recipe"]["store"]["instructions"]
    key = run_key({"name": "medusa"}, cfg, "p0", trained=True)
    assert key == run_key({"name": "medusa"}, OmegaConf.create(before), "p0", trained=True)
    mixed = validate(compose_cfg("method=medusa", "recipe.store.instructions=mixed"))
    assert run_key({"name": "medusa"}, mixed, "p0", trained=True) != key
    recipe = RecipeSettings(name="quick", tokens=1000)
    old = recipe.model_dump(mode="json")
    del old["store"]["instructions"]
    assert recipe.label == f"quick~{content_key(old)[:6]}"
    assert RecipeSettings(name="quick", tokens=1000, store={"instructions": "mixed"}).label != recipe.label
