"""The inputs of a causal LM's decoder layers in its last forward, for methods whose drafters read the target's middle
layers: EAGLE-3 fuses three (low, middle, high), NEST queries its datastore with the last one's.

Eager, forward pre-hooks on those layers hold them. A compiled model (``compile=true``, :mod:`core.compiled`) runs its
layers inside graphs, where a hook added after compiling never runs; its graphs return every layer's input already,
and the taps read those instead. Either way the method reads the same tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from core.errors import BenchError
from core.model_parts import decoder_layers


def layer_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder layer's forward pre-hook (``with_kwargs=True``) sees entering it."""
    return args[0] if args else kwargs["hidden_states"]


class LayerTaps:
    """Within the block, after each forward of ``lm``: :meth:`input` is decoder layer i's input ``(B, n, hidden)`` (one
    of ``layers``), :meth:`fused` those of ``layers`` side by side ``(B, n, len(layers) * hidden)``.

    ``lm``: a ``core.counting.CountedLM`` (compiled or not) or a bare transformers causal LM (a trainer's teacher)."""

    def __init__(self, lm, layers: tuple[int, ...]):
        self.layers = tuple(layers)
        self.compiled = getattr(lm, "compiled", None)
        self.model: nn.Module = getattr(lm, "module", lm)
        self.seen: dict[int, torch.Tensor] = {}
        self.handles: list = []

    def __enter__(self) -> LayerTaps:
        if self.compiled is not None:
            self.compiled.tapped += 1
            return self
        blocks = decoder_layers(self.model)
        for i in dict.fromkeys(self.layers):  # a layer listed twice (a 1- or 2-layer target) is hooked once
            self.handles.append(blocks[i].register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        if self.compiled is not None:
            self.compiled.tapped -= 1
        for handle in self.handles:
            handle.remove()
        self.handles, self.seen = [], {}

    def _hook(self, i: int):
        def keep(module, args, kwargs):
            self.seen[i] = layer_input(args, kwargs)

        return keep

    def input(self, i: int) -> torch.Tensor:
        """``(B, n, hidden)``: layer ``i``'s input in the model's last forward."""
        if self.compiled is None:
            return self.seen[i]
        if not self.compiled.layer_inputs:
            raise BenchError(f"the compiled {self.compiled.role}'s last forward ran outside its compiled forwards (on "
                             "another cache), which record no layer inputs; a method reading them cannot run so.")
        return self.compiled.layer_inputs[i]

    def fused(self) -> torch.Tensor:
        """``(B, n, len(layers) * hidden)``: the inputs of ``layers`` in the model's last forward, in their order."""
        return torch.cat([self.input(i) for i in self.layers], dim=-1)
