"""Where a causal LM keeps its parts, for the methods and trainers that reach inside one (distilled drafts,
draft bodies copied from the target, layer skipping, key capture, GliDe's glimpse of the target's keys).

The families differ in names and in how positions enter:

| family | decoder (``model.base_model``) | layers | attention | final norm | positions |
|---|---|---|---|---|---|
| Llama, Qwen2, Mistral, SmolLM2 | ``model.model`` | ``layers`` | ``self_attn`` | ``norm`` | rotary, in every attention |
| Gemma | ``model.model`` | ``layers`` | ``self_attn`` | ``norm`` | rotary; its token embedding scales by sqrt(hidden) itself |
| GPT-2 | ``model.transformer`` | ``h`` | ``attn`` (Conv1D) | ``ln_f`` | a learned table ``wpe`` added to the token embedding |

Methods ask here instead of naming them. What needs no adapter: the input embedding and the output head
(transformers' ``get_input_embeddings`` / ``get_output_embeddings`` hold for every family; Gemma's embedding module
does its own scaling), positions in a plain forward after a cache rollback (every family counts them from the
cache's length, GPT-2 included) and in a token tree (``decoding.tree.score_tree`` passes ``position_ids``), and
rolling a cache back (``decoding.cache.truncate_cache``: transformers' ``Cache`` is the same for every family).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path

import torch
from torch import nn

from core import files
from core.errors import BenchError

ATTENTION = ("self_attn", "attn")  # Llama-style, GPT-2
MLP = ("mlp",)
# The families every method is walked on (tests/methods/test_methods.py, tests/test_families.py; README "Model families").
FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gpt2")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM, bottom to top."""
    base = getattr(model, "base_model", model)
    for name in ("layers", "h"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise BenchError(f"{type(model).__name__} keeps its decoder layers where this harness does not look "
                     f"(model.layers or transformer.h); supported families: {', '.join(FAMILIES)}.")


# Families whose keys carry learned absolute positions (added to the input once, so cached keys carry no
# rotation): a method that rotates queries to meet the target's rotary keys (GliDe) cannot serve them.
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_bigcode", "opt", "biogpt"})


def layer_list_name(model: nn.Module) -> str:
    """The attribute of the decoder holding its layers (``layers``, ``h``)."""
    base = getattr(model, "base_model", model)
    layers = decoder_layers(model)
    return next(name for name, child in base.named_children() if child is layers)


def copy_from(body: nn.Module, source: nn.Module, layers: list[int]) -> None:
    """Load ``source``'s decoder layers ``layers`` (in that order) into the decoder layers of ``body`` (a decoder
    of the same family with ``len(layers)`` layers), and every other weight of ``body`` that ``source``'s decoder
    has under the same name and shape: the token embedding, GPT-2's position table, the final norm. Both are
    given as models or decoders (``base_model`` is taken when there is one)."""
    mine, theirs = getattr(body, "base_model", body), getattr(source, "base_model", source)
    own, their_layers = decoder_layers(mine), decoder_layers(theirs)
    if len(own) != len(layers):
        raise ValueError(f"{len(layers)} layers to copy into a decoder of {len(own)}")
    for layer, i in zip(own, layers):
        layer.load_state_dict(their_layers[i].state_dict())
    prefix = layer_list_name(mine) + "."
    state = theirs.state_dict()
    with torch.no_grad():
        for key, value in mine.state_dict().items():
            if not key.startswith(prefix) and key in state and state[key].shape == value.shape:
                value.copy_(state[key])


def sublayer_name(layer: nn.Module, kind: str) -> str:
    """The attribute of ``layer`` holding its attention (``kind="attn"``) or its MLP (``kind="mlp"``)."""
    for name in ATTENTION if kind == "attn" else MLP:
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    raise BenchError(f"{type(layer).__name__} has no {kind} sub-layer where this harness looks "
                     f"({' or '.join(ATTENTION if kind == 'attn' else MLP)}); supported families: {', '.join(FAMILIES)}.")


def slots(model: nn.Module, attn: list[int], mlp: list[int]) -> list[tuple[nn.Module, str, str]]:
    """``(layer, attribute, kind)`` of the attention of layers ``attn`` and of the MLP of layers ``mlp``."""
    layers = decoder_layers(model)
    return [(layers[i], sublayer_name(layers[i], kind), kind) for kind, ids in (("attn", attn), ("mlp", mlp))
            for i in ids]


def sublayers(model: nn.Module, attn: list[int], mlp: list[int]) -> list[nn.Module]:
    """The attention modules of layers ``attn`` and the MLPs of layers ``mlp``."""
    return [getattr(layer, name) for layer, name, _ in slots(model, attn, mlp)]


class Skipped(nn.Module):
    """Stands in for a skipped sub-layer: adds nothing to the residual stream, computes nothing, and (in place
    of an attention) writes nothing into the KV cache. ``forward(hidden (..., d)) -> zeros (..., d)`` (and
    ``None`` attention weights in place of an attention, whose callers unpack two values)."""

    def __init__(self, attention: bool):
        super().__init__()
        self.attention = attention

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        # Zeros rather than a bare 0: Gemma normalises a sub-layer's output before adding it (norm(0) = 0).
        zeros = torch.zeros_like(hidden_states)
        return (zeros, None) if self.attention else zeros


# Stateless and without parameters, so one of each stands in everywhere (not a new module per draft forward).
SKIPPED = {"attn": Skipped(True), "mlp": Skipped(False)}


@contextlib.contextmanager
def skipping(model: nn.Module, attn: list[int], mlp: list[int]):
    """Within the block, ``model`` runs without the attention of layers ``attn`` and the MLP of layers ``mlp``
    (each layer's residual connection carries its input past them): SWIFT's draft model, the same weights."""
    swapped = []
    try:
        for layer, name, kind in slots(model, attn, mlp):
            swapped.append((layer, name, getattr(layer, name)))
            setattr(layer, name, SKIPPED[kind])
        yield
    finally:
        for layer, name, module in swapped:
            setattr(layer, name, module)


def check_layout(model: nn.Module) -> None:
    """Raise unless every part this module reads is where it looks in ``model``: the decoder layers, and the
    attention and MLP of each (one sentence naming the supported families)."""
    for layer in decoder_layers(model):
        sublayer_name(layer, "attn")
        sublayer_name(layer, "mlp")


def check_folder_family(path) -> None:
    """A local model folder (checked by ``core.files.check_model_folder``) of a family this harness has not
    walked is built without weights (on the ``meta`` device, from its config) and its layout checked: refused in
    one sentence naming the supported families when the adapter cannot find its parts; taken, with a warning
    that it is untested, when it can (a Qwen3 or Gemma-2 keeps Llama's layout)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
        if config.model_type in FAMILIES:
            return
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # a foreign config fails in many ways (strict field checks, shapes): one sentence
        detail = " ".join(str(err).split())[:300] or type(err).__name__
        raise BenchError(f"transformers cannot build a model from '{path}/config.json' ({detail}).") from None
    try:
        check_layout(skeleton)
    except BenchError as err:
        raise BenchError(f"'{path}' holds a model of family '{config.model_type}', which this harness cannot "
                         f"read: {err}") from None
    _warn_untested(str(path), config.model_type)


@functools.cache
def _warn_untested(path: str, family: str) -> None:
    """Once per process and folder: the command line and the Hydra task it starts both validate a run."""
    logging.getLogger(__name__).warning("'%s' holds a model of family '%s': its layout is one this harness reads, but "
                                        "the family is untested here (tested: %s)", path, family, ", ".join(FAMILIES))


def target_family(pair) -> str | None:
    """The family (transformers' ``model_type``) of the target of ``pair`` (the ``pair.*`` settings) as known before
    any model loads: a random model's ``family``, a local folder's ``config.json``; ``None`` where only loading
    would tell (a hub id, a GGUF file)."""
    spec = pair.target
    if spec.source == "random":
        return spec.family
    if spec.source == "hub" and files.looks_local(spec.id):
        try:
            config = json.loads((Path(spec.id).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return None  # the folder's own check names the problem when it loads
        return config.get("model_type") if isinstance(config, dict) else None
    return None


def body_config(target_config, layers: int = 1):
    """The target's config cut to ``layers`` decoder layers (of its last layer's kind), with a one-row token
    embedding: such a body (Hydra++'s prefix layer, EAGLE's and KOALA's drafts) is fed vectors, never token
    ids, so a vocabulary-sized table would be dead weight."""
    config = target_config.__class__.from_dict(target_config.to_dict())
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:  # per-layer lists follow the layer count
        config.layer_types = [config.layer_types[-1]] * layers
    config.vocab_size = 1
    config.pad_token_id = config.bos_token_id = config.eos_token_id = None  # ids outside a 1-row table
    config._attn_implementation = target_config._attn_implementation
    return config


def copy_last_layers(body: nn.Module, target) -> None:
    """Load the target's last decoder layers into ``body``'s (a model built from :func:`body_config`: its one
    layer gets the target's last, K layers the last K in order), and whatever else has the same name and shape
    (the final norm, GPT-2's position table): :func:`core.model_parts.copy_from`."""
    n, k = len(decoder_layers(target)), len(decoder_layers(body))
    copy_from(body, target, list(range(n - k, n)))
