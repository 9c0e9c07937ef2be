"""The authors' published EAGLE draft layer (EAGLE-1 and EAGLE-2 share it; ``method.weights``), mapped onto
:class:`methods.eagle._draft.EagleDraft`.

Layout, as the authors' ``ea_model.py`` / ``cnets.py`` build and read it (``load_state_dict(strict=True)``;
Spec-Bench's ``model/eagle``, ``model/eagle2``), e.g. ``yuhuili/EAGLE-Vicuna-7B-v1.3``:

- ``config.json``: a Llama config of the draft (``hidden_size``, ``intermediate_size``, heads, ``rms_norm_eps``,
  ``num_hidden_layers``: 1, ``vocab_size``, ...) and optionally ``bias`` (``fc``'s; absent: true);
- ``pytorch_model.bin`` (or ``model.safetensors``): ``embed_tokens.weight (V, H)``, a copy of the base model's
  token embedding; ``fc.weight (H, 2H)`` over ``[e(x_{t+1}); f_t]``, the embedding FIRST (this harness's ``fc``
  reads the feature first: the two column blocks are swapped on loading), ``fc.bias``; per layer i the Llama
  attention and MLP projections (no biases) and ``post_attention_layernorm``, and ``input_layernorm`` for
  i >= 1 only: the first layer normalises nothing, and there is no final norm.

The draft reads the target's last normed hidden state and its output goes straight to the target's own output
layer (EAGLE-1/2 publish no head): over the whole vocabulary here, as in the paper.
"""

from __future__ import annotations

import torch

from core.checkpoints import Checkpoint, load_converted, locate
from core.errors import BenchError
from methods.eagle._draft import EagleDraft

FILES = ("pytorch_model.bin", "model.safetensors")
WHAT = "EAGLE draft layer"
NOT_CONFIG = ("bias", "architectures", "torch_dtype", "transformers_version", "_name_or_path", "auto_map")


def layer_config(ck: Checkpoint, target_config):
    """The draft's Llama config from the checkpoint's ``config.json``, checked against the target."""
    from transformers import LlamaConfig

    if not ck.config:
        raise BenchError(f"{ck.folder} has no config.json, which the {WHAT} is built from.")
    if ck.config.get("model_type", "llama") != "llama":
        raise BenchError(f"{ck.folder / 'config.json'} says model_type: {ck.config['model_type']}; only EAGLE's Llama "
                         "layer layout is read here.")
    for name in ("hidden_size", "vocab_size"):
        if ck.config.get(name) != getattr(target_config, name):
            raise BenchError(f"{ck.folder / 'config.json'} says {name}: {ck.config.get(name)}, but the target's is "
                             f"{getattr(target_config, name)}: this {WHAT} was made for another model.")
    config = LlamaConfig.from_dict({k: v for k, v in ck.config.items() if k not in NOT_CONFIG})
    config.vocab_size = 1  # the body is fed vectors; the token table is the draft's own embed
    config.pad_token_id = config.bos_token_id = config.eos_token_id = None
    config._attn_implementation = target_config._attn_implementation
    return config


def eagle_layer(ck: Checkpoint, target) -> EagleDraft:
    """The published layer as an :class:`EagleDraft` (every tensor of the file taken, shapes checked)."""
    H, V = target.config.hidden_size, target.config.vocab_size
    bias = ck.field("bias", True, bool)
    draft = EagleDraft(target.config, torch.arange(V), config=layer_config(ck, target.config), bias=bias,
                       published=True)
    body = {name: ck.take(name, tuple(value.shape)).float() for name, value in draft.body.state_dict().items()
            if name != "embed_tokens.weight"}
    draft.body.load_state_dict({**body, "embed_tokens.weight": draft.body.embed_tokens.weight}, strict=True)
    w = ck.take("fc.weight", (H, 2 * H)).float()
    with torch.no_grad():
        draft.fc.weight.copy_(torch.cat([w[:, H:], w[:, :H]], dim=1))  # theirs: [embedding; feature]
        if bias:
            draft.fc.bias.copy_(ck.take("fc.bias", (H,)))
        draft.embed.weight.copy_(ck.take("embed_tokens.weight", (V, H)))
        draft.head.weight.copy_(target.get_output_embeddings().weight.detach().float().cpu())
    ck.finish()
    return draft.eval()


def load_published_eagle(weights: str, target, cache) -> tuple[EagleDraft, dict]:
    """The published EAGLE layer at ``weights`` (a folder or a hub id; converted and checked once, then cached), on
    the CPU in fp32, and what was read (file, SHA-256, config)."""
    ck = Checkpoint(locate(weights, FILES), FILES, WHAT)

    def save(draft: EagleDraft) -> dict:
        return {"config": draft.config.to_dict(), "bias": draft.fc.bias is not None, "state": draft.state_dict()}

    def load(blob: dict) -> EagleDraft:
        from transformers import LlamaConfig

        config = LlamaConfig.from_dict(blob["config"])
        config._attn_implementation = target.config._attn_implementation
        draft = EagleDraft(target.config, blob["state"]["vocab_map"], config=config, bias=blob["bias"], published=True)
        draft.load_state_dict(blob["state"])
        return draft.eval()

    return load_converted(ck, "eagle", target, cache, lambda: eagle_layer(ck, target), save, load)
