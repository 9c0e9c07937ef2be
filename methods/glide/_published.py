"""The authors' published GliDe draft (``method=glide method.weights``): a small Llama of its own whose blocks glimpse
the target's cache.

Layout, as the authors' ``glide/glideModel.py`` builds and saves it (``smallLlamaForCausalLM``,
NonvolatileMemory/GliDe_with_a_CaPE_ICML_24; read by Colossal-Inference's ``GlideLlamaForCausalLM`` too, whose
hub copy is ``cxdu/glide-vicuna7b``, for ``lmsys/vicuna-7b-v1.5``):

- ``config.json``: a Llama config of the draft (``hidden_size``, ``num_hidden_layers``, heads, ``intermediate_size``,
  ``vocab_size``, ...) with the target's attention sizes, ``large_hidden_size`` and ``large_num_attention_heads``
  (the training-only ``block_size``, ``large_head_dim`` and ``use_remap`` may be there too; an absent field
  takes their ``smallLlamaConfig``'s default, Vicuna-7B's sizes);
- ``pytorch_model.bin`` or ``model.safetensors``: ``model.embed_tokens`` (the draft's own, V x h),
  ``model.layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.*}`` (a Llama decoder
  layer at the draft's width h), ``model.layers.{i}.cross_attn.q_proj (H, h)`` and ``.o_proj (h, H)`` (H the target's
  attention width), ``model.norm``, ``lm_head (V, h)`` over the whole vocabulary. (Their training script's own
  save, the joint model's ``small_model.*`` / ``large_model.*`` state dict, is another layout and is refused.)

What their code computes, reproduced here (:class:`PublishedGlide`): per block
``x = x + SelfAttn(norm_1(x)); x = x + CrossAttn(x); x = x + MLP(norm_2(x))``, the cross-attention without a norm in
front, its queries rotated at their own positions to meet the target's post-rotary keys; block i of n reads the
target's cached keys and values of layer ``L - n + i`` (L the target's layers: the last n, a one-block draft the
last layer), all of the cache at inference (the block mask is training's only); then the final norm and the
draft's head. After each verification their loop rolls the draft's own cache back to the pending token and has it
read again, with the accepted tokens and the next pending one, against the target's extended cache
(:meth:`methods.glide.glide.Glide.accepted`). The authors' loader is ``from_pretrained`` (missing keys initialised at
random with a warning); here every tensor is taken with its shape and nothing may be left over.

One difference, kept on purpose: their cross-attention builds its own rotary with base 10000 (the Vicuna targets'),
here the target's own rotary rotates the queries, which is the same for those targets and meets the keys of any
other.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel

from core.checkpoints import Checkpoint, load_converted, locate
from core.errors import BenchError
from core.kv_cache import cache_kwargs
from core.model_parts import decoder_layers
from methods.glide._draft import AsDecoder, CrossAttention, causal_after

FILES = ("pytorch_model.bin", "model.safetensors")
WHAT = "GliDe draft"
# The config fields that shape the draft's own Llama (the rest of the authors' config is training-only).
# Their layers have no biases and heads hidden_size / num_attention_heads wide, whatever a config says (no
# attention_bias, mlp_bias or head_dim is read); an absent field takes their default, which is LlamaConfig's.
DRAFT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                "rope_scaling", "tie_word_embeddings")


def target_rotary(target) -> tuple[Callable, nn.Module]:
    """The target family's ``apply_rotary_pos_emb`` and its rotary module, which the glimpse's queries are rotated
    with; a target without them is one sentence."""
    attn = decoder_layers(target)[0].self_attn
    apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    rotary = getattr(target.get_decoder(), "rotary_emb", None)
    if apply is None or rotary is None:
        raise BenchError(f"method=glide needs a target with rotary attention in Llama-style decoder layers; this "
                         f"target's are {type(attn).__name__} ({target.config.model_type}).")
    return apply, rotary


def read_layers(n_target: int, n_draft: int) -> list[int]:
    """The target layer each of the draft's ``n_draft`` blocks reads, as the authors' code picks it: the last
    ``n_draft`` layers in order."""
    return [min(n_target - n_draft + i, n_target - 1) for i in range(n_draft)]


class PublishedGlide(AsDecoder, nn.Module):
    """The authors' GliDe draft: ``body`` (a Llama of the draft's ``config``: own embedding, self-attention, MLP,
    norms, rotary), one :class:`CrossAttention` per block into the target's attention width (rotated by the
    target's rotary, ``target_rotary``), ``head (V, h)``; ``vocab_map``: the whole vocabulary."""

    def __init__(self, config: LlamaConfig, target):
        super().__init__()
        self.config = config
        config._attn_implementation = target.config._attn_implementation
        self.body = LlamaModel(config).float()
        apply, rotary = target_rotary(target)
        heads, head_dim = target.config.num_attention_heads, decoder_layers(target)[0].self_attn.head_dim
        self.cross = nn.ModuleList(CrossAttention(config.hidden_size, heads, head_dim, apply)
                                   for _ in range(config.num_hidden_layers))
        self.target_rotary = copy.deepcopy(rotary).float()  # no weights: frequencies only
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("vocab_map", torch.arange(config.vocab_size), persistent=False)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.body.embed_tokens

    def forward(self, emb: torch.Tensor, positions: torch.Tensor, kvs, visible: torch.Tensor | None = None,
                cache=None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`methods.glide._draft.GlideDraft.forward`: ``emb (B, n, h)`` the draft's own embeddings of n
        tokens at ``positions`` (``(n,)`` or ``(B, n)``) right after the ``cache``'s; ``kvs``: per block, the target's
        cached keys and values ``(B, n_kv, m, d)`` of the layer it reads (:func:`read_layers`). Returns ``(B, n, h)``."""
        positions = positions.reshape(-1, emb.shape[1])
        own = self.body.rotary_emb(emb, positions)
        theirs = self.target_rotary(emb, positions)
        causal = attention_mask if attention_mask is not None else causal_after(cache, emb)
        h = emb
        for block, cross, (k, v) in zip(self.body.layers, self.cross, kvs, strict=True):
            h = h + block.self_attn(block.input_layernorm(h), position_embeddings=own, attention_mask=causal,
                                    **cache_kwargs(cache))[0]
            h = h + cross(h, theirs, k, v, visible)  # no norm in front: the authors' block
            h = h + block.mlp(block.post_attention_layernorm(h))
        return self.body.norm(h)


def draft_config(ck: Checkpoint, target) -> LlamaConfig:
    """The draft's Llama config from ``ck``'s ``config.json``, checked against ``target``: its vocabulary, and the
    attention sizes its cross-attention was made for."""
    path = ck.folder / "config.json"
    if not ck.config:
        raise BenchError(f"{ck.folder} has no config.json, which the {WHAT} is built from.")
    if ck.config.get("model_type", "llama") != "llama":
        raise BenchError(f"{path} says model_type: {ck.config['model_type']}; a {WHAT} is a Llama.")
    tc = target.config
    attn = decoder_layers(target)[0].self_attn
    # (field, this target's value, the authors' config default: Vicuna-7B's attention sizes)
    want = (("vocab_size", tc.vocab_size, 32000), ("large_hidden_size", tc.num_attention_heads * attn.head_dim, 4096),
            ("large_num_attention_heads", tc.num_attention_heads, 32))
    for name, value, default in want:
        if (read := ck.field(name, default)) != value:
            said = "says" if name in ck.config else "leaves out, so the authors' code reads"
            raise BenchError(f"{path} {said} {name}: {read}, but this target's is {value}: this {WHAT} was made for "
                             "another model.")
    layers, target_layers = ck.field("num_hidden_layers", 32), len(decoder_layers(target))
    if not 1 <= layers <= target_layers:
        raise BenchError(f"{path} says num_hidden_layers: {layers}; a {WHAT} reads one target layer per block, and "
                         f"this target has {target_layers}.")
    for name, default in (("hidden_size", 4096), ("intermediate_size", 11008), ("num_attention_heads", 32)):
        ck.field(name, default)  # an integer when given (their defaults, LlamaConfig's, when not)
    try:
        return LlamaConfig(**{k: ck.config[k] for k in DRAFT_FIELDS if k in ck.config})
    except (TypeError, ValueError) as err:
        raise BenchError(f"{path} does not describe a Llama ({str(err).splitlines()[0]}).") from None


def published_glide(ck: Checkpoint, target) -> PublishedGlide:
    """The published draft as a :class:`PublishedGlide` (every tensor of the file taken, shapes checked)."""
    draft = PublishedGlide(draft_config(ck, target), target)
    state = {name: ck.take(f"model.{name}", tuple(value.shape)).float()
             for name, value in draft.body.state_dict().items()}
    draft.body.load_state_dict(state, strict=True)
    for i, cross in enumerate(draft.cross):
        cross.load_state_dict({name: ck.take(f"model.layers.{i}.cross_attn.{name}", tuple(value.shape)).float()
                               for name, value in cross.state_dict().items()}, strict=True)
    head = draft.head.weight
    if draft.config.tie_word_embeddings and not ck.has("lm_head.weight"):
        head.data.copy_(draft.embed_tokens.weight.data)  # tied: saved once, as the embedding
    else:
        head.data.copy_(ck.take("lm_head.weight", tuple(head.shape)).float())
    ck.finish()
    return draft.eval()


def load_published_glide(weights: str, target, cache) -> tuple[PublishedGlide, dict]:
    """The published GliDe draft at ``weights`` (a folder or a hub id; converted and checked once, then cached), on
    the CPU in fp32, and what was read (file, SHA-256, config)."""
    ck = Checkpoint(locate(weights, FILES), FILES, WHAT)

    def load(blob: dict) -> PublishedGlide:
        draft = PublishedGlide(LlamaConfig(**blob["config"]), target)
        draft.load_state_dict(blob["state"])
        return draft.eval()

    def save(draft: PublishedGlide) -> dict:
        return {"state": draft.state_dict(), "config": {k: v for k, v in ck.config.items() if k in DRAFT_FIELDS}}

    return load_converted(ck, "glide", target, cache, lambda: published_glide(ck, target), save, load)
