"""The authors' published EAGLE-3 draft (``method=eagle3 method.weights=DIR``), on the tiny pair: a checkpoint
written in their layout (their state-dict names, ``d2t`` / ``t2d``, ``draft_vocab_size``) loads tensor for tensor,
decodes equal to ``ar``, and every mismatch is one sentence."""

import dataclasses
import json

import pytest
import torch

from core.checkpoints import Checkpoint
from core.errors import BenchError
from methods._eagle3_draft import Eagle3Draft
from methods._eagle3_published import FILES, WHAT, eagle3_draft
from tests.helpers import assert_greedy_equal_to_ar, build, prompts_for


@pytest.fixture()
def pair(tiny_pair):
    return dataclasses.replace(tiny_pair, roles={})


def eagle3_file(folder, target, vocab_map=None, drop=(), extra=None, config_over=None, seed=0):
    """EAGLE-3's published files for ``target``: the draft's state dict under the authors' names (no ``d2t`` /
    ``t2d`` when the draft vocabulary is the whole one, as the authors' loader deletes them) and its config."""
    c = target.config
    vocab_map = torch.arange(c.vocab_size) if vocab_map is None else vocab_map
    torch.manual_seed(seed)
    draft = Eagle3Draft(c, vocab_map)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    tensors = {k: v.clone() for k, v in draft.state_dict().items()}
    if len(vocab_map) == c.vocab_size:
        del tensors["d2t"], tensors["t2d"]
    for key in drop:
        del tensors[key]
    tensors.update(extra or {})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
              "draft_vocab_size": len(vocab_map), "rms_norm_eps": 1e-6, **(config_over or {})}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(tensors, folder / "pytorch_model.bin")
    return folder, draft.eval()


def test_a_published_draft_loads_tensor_for_tensor_and_decodes_as_ar(pair, tmp_path):
    vocab_map = torch.tensor(sorted(torch.randperm(pair.target.module.config.vocab_size)[:100].tolist()))
    folder, written = eagle3_file(tmp_path / "e3", pair.target.module, vocab_map)
    method = build(pair, "eagle3", weights=str(folder))
    loaded = method.draft.module
    assert torch.equal(loaded.vocab_map, vocab_map) and torch.equal(loaded.t2d, written.t2d)
    for name, value in written.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name].float(), value.float())
    assert not type(method).trains(pair.spec, method.cfg) and method.report["file"] == "pytorch_model.bin"
    assert_greedy_equal_to_ar(method, prompts_for(pair, 2), max_new=16)


def test_the_whole_vocabulary_needs_no_d2t(pair, tmp_path):
    folder, _ = eagle3_file(tmp_path / "full", pair.target.module)
    draft = eagle3_draft(Checkpoint(folder, FILES, WHAT), pair.target.module)
    assert torch.equal(draft.vocab_map, torch.arange(pair.target.module.config.vocab_size))


def refusal(pair, folder) -> str:
    with pytest.raises(BenchError) as err:
        eagle3_draft(Checkpoint(folder, FILES, WHAT), pair.target.module)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_mismatches_are_one_sentence(pair, tmp_path):
    target = pair.target.module
    V, H = target.config.vocab_size, target.config.hidden_size
    part = torch.arange(0, V, 2)
    bad_t2d = torch.zeros(V, dtype=torch.bool)
    folder, _ = eagle3_file(tmp_path / "t2d", target, part, extra={"t2d": bad_t2d})
    assert "'d2t' and 't2d' do not describe the same draft vocabulary" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "nod2t", target, part, drop=("d2t",))
    assert "has no tensor 'd2t'" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "extra", target, extra={"layers.0.mlp.up_proj.weight": torch.zeros(2)})
    assert "holds 'layers.0.mlp.up_proj.weight'" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "emb", target, extra={"embed_tokens.weight": torch.zeros(V, H)})
    assert "is not this target's token embedding" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "wide", target, config_over={"target_hidden_size": 2 * H})
    assert f"target_hidden_size: {2 * H}, but this target's is {H}" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "kv", target, config_over={"num_key_value_heads": 1})
    assert "num_key_value_heads: 1" in refusal(pair, folder)
    folder, _ = eagle3_file(tmp_path / "own", target, extra={"embed_tokens.weight": target.get_input_embeddings().weight.detach()})
    assert eagle3_draft(Checkpoint(folder, FILES, WHAT), target) is not None  # the target's own embedding: fine
