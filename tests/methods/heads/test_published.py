"""The authors' published Medusa, Hydra and Hydra++ heads (``method.weights``), on the tiny pair.

Each checkpoint is written here in the published layout (the authors' file names, key names, config fields),
with random weights or with heads this harness trained, then read back: the loaded heads compute what the file's
tensors and the papers' equations say, decoding with them equals ``ar``, and every mismatch is one sentence.
"""

import dataclasses
import json

import pytest
import torch
from torch import nn

from core.checkpoints import Checkpoint, read_tensors
from methods.heads._published import published_heads
from tests.helpers import assert_greedy_equal_to_ar, assert_sampling_is_the_targets, build, prompts_for, refusal_of
from tests.helpers import decode as decode_with

VICUNA = "lmsys/vicuna-7b-v1.3"


@pytest.fixture()
def pair(tiny_pair):
    return dataclasses.replace(tiny_pair, roles={})


def sizes(pair) -> tuple[int, int]:
    config = pair.target.module.config
    return config.hidden_size, config.vocab_size


def save(folder, tensors: dict, config: dict, name: str):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if name.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name))
    else:
        torch.save(tensors, folder / name)
    return folder


def rand(*shape, scale=0.1, gen=None):
    return torch.randn(*shape, generator=gen) * scale


# ------------------------------------------------------------------------------- writing the published layouts


def medusa_file(folder, H, V, heads=5, layers=1, name="medusa_lm_head.pt", base=VICUNA, seed=0, values=None):
    """A Medusa checkpoint as the authors save it: head i = Sequential(ResBlock * layers, Linear(H, V, bias=False));
    the config says 2 heads whatever the file holds, as the published Vicuna ones do. ``values``: tensors to
    use instead of random ones, by the same keys."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(heads):
        for j in range(layers):
            tensors[f"{i}.{j}.linear.weight"] = rand(H, H, gen=gen)
            tensors[f"{i}.{j}.linear.bias"] = rand(H, gen=gen)
        tensors[f"{i}.{layers}.weight"] = rand(V, H, scale=1.0, gen=gen)
    tensors.update(values or {})
    config = {"medusa_num_heads": 2, "medusa_num_layers": layers, "base_model_name_or_path": base}
    return save(folder, tensors, config, name)


def hydra_file(folder, target, heads=3, layers=2, arch="prefix-mlp", seed=0, values=None, embed=True):
    """A Hydra checkpoint as the authors' ``HydraMLP`` / ``HydraPrefixMLP`` state dict holds it (grounded heads;
    prefix-mlp: dropouts between the blocks, the prefix ``LlamaModel`` with its unused token table and rotary
    buffer)."""
    from transformers import AutoModel

    config = target.config
    H, V = config.hidden_size, config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prefix = arch == "prefix-mlp"
    step, first = (2, 1) if prefix else (1, 0)
    tensors = {}
    for i in range(heads):
        width = (i + 2) * H
        for name in ("linear", "res_connection"):
            tensors[f"hydra_mlp.{i}.{first}.{name}.weight"] = rand(H, width, gen=gen)
            tensors[f"hydra_mlp.{i}.{first}.{name}.bias"] = rand(H, gen=gen)
        for j in range(1, layers):
            tensors[f"hydra_mlp.{i}.{first + j * step}.linear.weight"] = rand(H, H, gen=gen)
            tensors[f"hydra_mlp.{i}.{first + j * step}.linear.bias"] = rand(H, gen=gen)
        out = f"hydra_lm_head.{i}.1" if prefix else f"hydra_lm_head.{i}"
        tensors[out + ".weight"] = rand(V, H, scale=1.0, gen=gen)
        tensors[out + ".bias"] = rand(V, gen=gen)
    if embed:
        tensors["input_embed_fn.weight"] = target.get_input_embeddings().weight.detach().clone()
    if prefix:
        cut = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": 1})
        torch.manual_seed(seed)
        body = AutoModel.from_config(cut)
        for k, v in body.state_dict().items():
            tensors[f"prefix_embeding_layer.{k}"] = v.detach().clone()
        inv_freq = body.rotary_emb.inv_freq.detach().clone()
        tensors["prefix_embeding_layer.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq
    tensors.update(values or {})
    cfg = {"hydra_num_heads": heads, "hydra_num_layers": layers, "hydra_head_arch": arch, "grounded_heads": True,
           "hidden_state_offset": 0, "base_model_name_or_path": VICUNA}
    return save(folder, tensors, cfg, "hydra_lm_head.pt")


# ------------------------------------------------------------------------------- the equations, from the file


def test_medusa_heads_compute_the_papers_equation_from_the_file(pair, tmp_path):
    H, V = sizes(pair)
    for name, layers in (("medusa_lm_head.pt", 1), ("medusa_lm_head.safetensors", 2)):
        folder = medusa_file(tmp_path / name, H, V, layers=layers, name=name)
        heads, prefix, ck = published_heads("medusa", "medusa", str(folder), pair.target.module, VICUNA)
        assert prefix is None and heads.num_heads == 5  # the file's five, not the config's two
        f = read_tensors(ck.file)
        h = torch.randn(3, H)
        got = heads(h)  # (3, 5, V)
        for i in range(5):
            x = h
            for j in range(layers):  # x + SiLU(W x + b), as Medusa's ResBlock
                x = x + nn.functional.silu(x @ f[f"{i}.{j}.linear.weight"].T + f[f"{i}.{j}.linear.bias"])
            torch.testing.assert_close(got[:, i], x @ f[f"{i}.{layers}.weight"].T)
        assert torch.equal(heads.vocab_map, torch.arange(V))


@pytest.mark.parametrize("arch", ["mlp", "prefix-mlp"])
def test_hydra_heads_compute_the_papers_equation_from_the_file(pair, tmp_path, arch):
    from transformers import AutoModel

    target = pair.target.module
    H, V = sizes(pair)
    method = "hydra" if arch == "mlp" else "hydra_pp"
    folder = hydra_file(tmp_path / arch, target, arch=arch)
    heads, prefix, ck = published_heads("hydra", method, str(folder), target, VICUNA)
    f = read_tensors(ck.file)
    h, path = torch.randn(2, H), torch.randn(2, 3, H)
    step, first = (2, 1) if arch == "prefix-mlp" else (1, 0)
    for i in range(3):
        x_in = torch.cat([h, path[:, : i + 1].flatten(-2)], -1)
        a = f"hydra_mlp.{i}.{first}"
        x = (x_in @ f[f"{a}.res_connection.weight"].T + f[f"{a}.res_connection.bias"]
             + nn.functional.silu(x_in @ f[f"{a}.linear.weight"].T + f[f"{a}.linear.bias"]))
        b = f"hydra_mlp.{i}.{first + step}"
        x = x + nn.functional.silu(x @ f[f"{b}.linear.weight"].T + f[f"{b}.linear.bias"])
        out = f"hydra_lm_head.{i}.1" if arch == "prefix-mlp" else f"hydra_lm_head.{i}"
        torch.testing.assert_close(heads(h, path[:, : i + 1]), x @ f[out + ".weight"].T + f[out + ".bias"])
    if arch == "mlp":
        assert prefix is None
        return
    # Hydra++'s prefix layer is the authors' one-layer LlamaModel over the hidden states, its output read alone.
    cut = target.config.__class__.from_dict({**target.config.to_dict(), "num_hidden_layers": 1})
    reference = AutoModel.from_config(cut)
    reference.load_state_dict({k[len("prefix_embeding_layer."):]: v for k, v in f.items()
                               if k.startswith("prefix_embeding_layer.") and "inv_freq" not in k})
    seq = torch.randn(1, 5, H)
    torch.testing.assert_close(prefix(seq), reference(inputs_embeds=seq).last_hidden_state)


# ------------------------------------------------------------------------------- decoding with them


def trained_as_published(pair, name, folder):
    """Heads this harness trains (full vocabulary, tiny recipe), written in the authors' layout (Hydra's residual
    projection the identity on h, its output bias zero): decoding with the file must behave as with the heads."""
    H, V = sizes(pair)
    trained = build(pair, name, recipe={"vocab": V, "batch_size": 8}).heads.module
    assert torch.equal(trained.vocab_map, torch.arange(V))
    values = {}
    if name == "medusa":
        for i in range(trained.num_heads):
            values[f"{i}.0.linear.weight"] = trained.blocks[i].linear.weight.detach()
            values[f"{i}.0.linear.bias"] = trained.blocks[i].linear.bias.detach()
            values[f"{i}.1.weight"] = trained.proj[i].weight.detach()
        return medusa_file(folder, H, V, heads=trained.num_heads, values=values), trained
    for i in range(trained.num_heads):
        width = (i + 2) * H
        values[f"hydra_mlp.{i}.0.linear.weight"] = trained.blocks[i].linear.weight.detach()
        values[f"hydra_mlp.{i}.0.linear.bias"] = trained.blocks[i].linear.bias.detach()
        values[f"hydra_mlp.{i}.0.res_connection.weight"] = torch.eye(H, width)
        values[f"hydra_mlp.{i}.0.res_connection.bias"] = torch.zeros(H)
        values[f"hydra_lm_head.{i}.weight"] = trained.proj[i].weight.detach()
        values[f"hydra_lm_head.{i}.bias"] = torch.zeros(V)
    return hydra_file(folder, pair.target.module, heads=trained.num_heads, layers=1, arch="mlp", values=values), trained


@pytest.mark.parametrize("name", ["medusa", "hydra"])
def test_trained_heads_written_in_the_published_layout_decode_as_they_do(pair, tmp_path, name, looping_prompt):
    folder, trained = trained_as_published(pair, name, tmp_path / name)
    method = build(pair, name, weights=str(folder))
    loaded = method.heads.module
    assert method.report["file"] in ("medusa_lm_head.pt", "hydra_lm_head.pt") and len(method.report["sha256"]) == 64
    h = torch.randn(2, sizes(pair)[0])
    if name == "medusa":
        torch.testing.assert_close(loaded(h), trained(h))
    else:
        path = torch.randn(2, 2, h.shape[-1])
        torch.testing.assert_close(loaded(h, path), trained(h, path))
    prompts = prompts_for(pair, 2)
    assert_greedy_equal_to_ar(method, prompts, max_new=24)
    assert_sampling_is_the_targets(method, looping_prompt)


def test_hydra_pp_with_published_heads_equals_ar(pair, tmp_path):
    folder = hydra_file(tmp_path / "pp", pair.target.module, heads=4, layers=2)
    method = build(pair, "hydra_pp", weights=str(folder), tree="default")
    assert method.prefix is not None and method.prefix.module.gamma is None
    assert not type(method).trains(pair.spec, method.cfg)  # nothing trained: records name no recipe
    assert_greedy_equal_to_ar(method, prompts_for(pair, 2), max_new=24)
    assert pair.counts()["prefix"]["calls"] > 0


def test_the_published_tree_is_medusas(pair, tmp_path):
    H, V = sizes(pair)
    folder = medusa_file(tmp_path / "m", H, V)
    method = build(pair, "medusa", weights=str(folder), tree="mc_sim_7b_63")
    assert len(method.shape) == 64 and method.shape.max_depth == 4
    ids = prompts_for(pair, 1)[0]
    out = decode_with(pair, "medusa", ids, max_new=16, weights=str(folder), tree="mc_sim_7b_63")
    assert out.output_ids == decode_with(pair, "ar", ids, max_new=16).output_ids
    assert out.extra["tree_size"] == 64


def test_converted_heads_are_cached_by_the_files_checksum(pair, tmp_path):
    H, V = sizes(pair)
    folder = medusa_file(tmp_path / "m", H, V, heads=4)
    first = build(pair, "medusa", weights=str(folder))
    again = build(pair, "medusa", weights=str(folder))
    assert first.report == again.report  # read from the cache's manifest
    medusa_file(tmp_path / "m", H, V, heads=4, seed=1)  # the same name, other weights: converted anew
    other = build(pair, "medusa", weights=str(folder))
    assert other.report["sha256"] != first.report["sha256"]
    assert not torch.equal(other.heads.module.proj[0].weight, first.heads.module.proj[0].weight)


# ------------------------------------------------------------------------------- mismatches: one sentence


def refusal(pair, folder, method="medusa", kind="medusa", target_id=VICUNA) -> str:
    return refusal_of(published_heads, kind, method, str(folder), pair.target.module, target_id)


def test_mismatches_are_one_sentence_naming_the_file_and_key(pair, tmp_path):
    H, V = sizes(pair)
    target = pair.target.module
    # Another hidden size: the first key read names its shape.
    msg = refusal(pair, medusa_file(tmp_path / "hidden", H * 2, V))
    assert "medusa_lm_head.pt: '0.0.linear.weight' has shape" in msg
    # Another vocabulary.
    assert "'0.1.weight' has shape" in refusal(pair, medusa_file(tmp_path / "vocab", H, V + 7))
    # A key the layout does not have.
    folder = medusa_file(tmp_path / "extra", H, V, values={"medusa_extra.weight": torch.zeros(2)})
    assert "holds 'medusa_extra.weight'" in refusal(pair, folder)
    # A missing key (a head without its output layer).
    folder = medusa_file(tmp_path / "missing", H, V)
    tensors = torch.load(folder / "medusa_lm_head.pt", weights_only=True)
    del tensors["2.1.weight"]
    torch.save(tensors, folder / "medusa_lm_head.pt")
    assert "has no tensor '2.1.weight'" in refusal(pair, folder)
    # Weights trained for another base model.
    folder = medusa_file(tmp_path / "base", H, V, base="meta-llama/Llama-2-7b-hf")
    assert "trained for 'meta-llama/Llama-2-7b-hf'" in refusal(pair, folder)
    assert published_heads("medusa", "medusa", str(folder), target, "/models/Llama-2-7b-hf")  # the same name: fine
    # Hydra++ weights given to method=hydra, and a prefix layer made for another target.
    folder = hydra_file(tmp_path / "arch", target)
    assert "hydra_head_arch: prefix-mlp" in refusal(pair, folder, "hydra", "hydra") and "method=hydra_pp" in refusal(
        pair, folder, "hydra", "hydra")
    bad = torch.ones(target.config.hidden_size // target.config.num_attention_heads // 2)
    folder = hydra_file(tmp_path / "rope", target, values={"prefix_embeding_layer.layers.0.self_attn.rotary_emb.inv_freq": bad})
    assert "rotary frequencies" in refusal(pair, folder, "hydra_pp", "hydra")
    folder = hydra_file(tmp_path / "embed", target, values={"input_embed_fn.weight": torch.zeros(V, H)})
    assert "another target" in refusal(pair, folder, "hydra_pp", "hydra")


def test_bad_files_are_refused_in_one_sentence(pair, tmp_path):
    H, V = sizes(pair)
    assert "no such folder" in refusal(pair, tmp_path / "nowhere")
    assert "holds none of medusa_lm_head.safetensors, medusa_lm_head.pt" in refusal(pair, save(tmp_path / "empty", {}, {}, "x.pt"))
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "medusa_lm_head.pt").write_bytes(b"not a checkpoint at all")
    assert "is not a readable checkpoint" in refusal(pair, tmp_path / "garbage")
    (tmp_path / "code").mkdir()
    torch.save({"0.1.weight": Checkpoint}, tmp_path / "code" / "medusa_lm_head.pt")  # a pickled class: code
    assert "could run code); refused" in refusal(pair, tmp_path / "code")
    folder = medusa_file(tmp_path / "cfg", H, V)
    (folder / "config.json").write_text("{not json")
    assert "is not readable JSON" in refusal(pair, folder)


def test_a_bad_weights_folder_stops_the_run_in_one_sentence(tmp_path, cache_dir):
    from tests.bench.test_cli import bench

    out = tmp_path / "run"
    res = bench("run", "method=medusa", "pair=tiny", f"method.weights={tmp_path / 'nowhere'}", "max_new_tokens=4",
                "dataset.n_prompts=1", f"hydra.run.dir={out}", cache_dir=cache_dir)
    assert res.returncode == 2 and "no such folder" in res.stderr and not (out / "records.jsonl").exists()
