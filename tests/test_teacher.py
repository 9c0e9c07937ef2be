"""The teacher store on the tiny pair: what it holds equals the target's own outputs, growing keeps what was
labelled, a killed build resumes at the first missing shard, and ``train store`` builds it from the CLI."""

import json

import numpy as np
import pytest
import torch

from bench.errors import BenchError
from decoding import teacher
from decoding.teacher import StoreSettings, load_or_grow_store, shard_kinds

SMALL = dict(seq_len=32, shard_sequences=4, answers=1 / 3, answer_tokens=8, answer_batch=4, corpus="lee", topk=5,
             batch_size=4)
PER_SHARD = 4 * 32


def settings(shards: int, **over) -> StoreSettings:
    return StoreSettings(tokens=shards * PER_SHARD, **{**SMALL, **over})


@pytest.fixture
def counted_labels(monkeypatch):
    """Counts labelling calls (one per shard built); ``fail_at`` makes that call raise, as a kill would."""
    calls = {"n": 0, "fail_at": None}
    real = teacher.label

    def label(target, ids, s):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise KeyboardInterrupt("killed")
        return real(target, ids, s)

    monkeypatch.setattr(teacher, "label", label)
    return calls


def test_shards_hold_the_targets_own_outputs(tiny_pair, tmp_path):
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    store = load_or_grow_store(target, tok, settings(3), tmp_path)
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
    stream = teacher._Sources(tok, store.settings).stream
    assert rows["ids"][:8].flatten().tolist() == stream[: 8 * 32]
    assert rows["mask"][:8].all()  # text has no padding
    src = teacher._Sources(tok, store.settings)
    answers = teacher.target_answers(target, tok, src.prompts[:4], 4, 8, "answers")
    for ids, mask, (prompt, answer, _, _) in zip(rows["ids"][8:], rows["mask"][8:], answers):
        n = int(mask.sum())
        assert mask[:n].all() and (ids[n:] == tok.eos_token_id).all()  # the row, then EOS padding
        assert ids[:n].tolist() == torch.cat([prompt, answer]).tolist()[-32:]  # the prompt's end, then the answer


def test_growing_keeps_what_was_labelled(tiny_pair, tmp_path, counted_labels):
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    small = load_or_grow_store(target, tok, settings(2), tmp_path)
    assert counted_labels["n"] == 2
    big = load_or_grow_store(target, tok, settings(4), tmp_path)
    assert counted_labels["n"] == 4  # only shards 2 and 3 were labelled
    assert len(big) == 2 * len(small) and big.folder == small.folder
    assert np.array_equal(big.shards[1]["prob"], small.shards[1]["prob"])
    assert big.report()["shards"] == 4 and big.report()["answers"]["shards"] == 1


def test_a_killed_build_resumes_at_the_first_missing_shard(tiny_pair, tmp_path, counted_labels):
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    counted_labels["fail_at"] = 2
    with pytest.raises(KeyboardInterrupt):
        load_or_grow_store(target, tok, settings(3, answers=0), tmp_path)
    folder = next((tmp_path / "teacher").iterdir())
    assert sorted(p.name.split("-")[1] for p in folder.iterdir() if not p.name.startswith(".")) == ["00000"]
    counted_labels["fail_at"] = None
    store = load_or_grow_store(target, tok, settings(3, answers=0), tmp_path)
    assert counted_labels["n"] == 2 + 2 and len(store) == 12  # shard 0 kept; 1 (killed) and 2 built
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]  # nothing half-written left behind


def test_missing_store_and_exhausted_corpus_are_one_sentence(tiny_pair, tmp_path):
    target, tok = tiny_pair.target.module, tiny_pair.tokenizer
    with pytest.raises(BenchError, match="no cached teacher store shard 0 .*python -m bench train store"):
        load_or_grow_store(target, tok, settings(1), tmp_path, build_if_missing=False)
    with pytest.raises(BenchError, match=r"store.corpus 'lee' \(test\) holds .* tokens, enough for"):
        load_or_grow_store(target, tok, StoreSettings(tokens=10**7, answers=0, corpus="lee", split="test"), tmp_path)


def test_train_store_from_the_command_line(tmp_path, capsys):
    from bench.__main__ import main

    args = ["train", "store", "pair=tiny", f"cache_dir={tmp_path}", f"tokens={2 * PER_SHARD}",
            *(f"store.{k}={v}" for k, v in {**SMALL, "answers": 0}.items())]
    assert main(args) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert report["shards"] == 2 and report["sequences"] == 8 and report["text"]["tokens"] == 2 * PER_SHARD
    assert report["answers"]["shards"] == 0 and report["text"]["tokens_per_s"] > 0


def test_store_settings_are_checked_before_any_model_loads(capsys):
    from bench.__main__ import main

    assert main(["train", "store", "pair=tiny", "tokens=0"]) == 2
    assert "store.tokens=0 is not allowed; it takes an integer >= 1" in capsys.readouterr().err
