"""Where a causal LM keeps its parts, for the methods that reach inside one (layer skipping, for now).

The families differ in names only: a Llama-style model (Llama, Qwen2, Mistral, Gemma, SmolLM2) keeps its
decoder layers in ``model.model.layers`` with sub-layers ``self_attn`` and ``mlp``; GPT-2 in
``model.transformer.h`` with ``attn`` and ``mlp``. Methods ask here instead of naming them.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from bench.errors import BenchError

ATTENTION = ("self_attn", "attn")  # Llama-style, GPT-2
MLP = ("mlp",)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM, bottom to top."""
    base = getattr(model, "base_model", model)
    for name in ("layers", "h"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise BenchError(f"{type(model).__name__} keeps its decoder layers where this harness does not look "
                     "(model.layers or transformer.h); supported: Llama-style models and GPT-2.")


def sublayer_name(layer: nn.Module, kind: str) -> str:
    """The attribute of ``layer`` holding its attention (``kind="attn"``) or its MLP (``kind="mlp"``)."""
    for name in ATTENTION if kind == "attn" else MLP:
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    raise BenchError(f"{type(layer).__name__} has no {kind} sub-layer where this harness looks.")


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
