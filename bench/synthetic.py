"""Synthetic pairs (``pair=synthetic``): real model shapes with random weights, and an acceptance rate that is set.

No hub weights reach this workplace's machines, and on a CPU only a 135M model is at hand, so a method's cost at a
real size cannot be measured with real weights here. A synthetic pair builds the target (and a draft) of a
published model's shape with transformers' own initialisation, directly on the run's device in the run's dtype,
and gives its target a :class:`decoding.set_acceptance.SetAcceptance`: every method's forwards, host work and
memory are those of that size, and the target keeps each drafted token with probability ``pair.acceptance``.
It answers "what does this method's machinery cost at 8B, and what speedup does it reach at acceptance a?", not
"what acceptance does this method reach" (that needs real weights).

Each shape's numbers are its model's ``config.json`` (sizes, heads, vocabulary, rope base, tied head); rope scaling
(Llama 3's long-context rule) is left out: it changes no cost at these lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Shape:
    """A model's architecture as transformers' config for ``family`` takes it, and the draft it is usually paired
    with (another shape's name; None: it has none)."""

    family: str
    config: dict = field(default_factory=dict)
    draft: str | None = None
    source: str = ""  # the model whose config.json these numbers are


def _llama(hidden, intermediate, layers, heads, kv, vocab, theta, tied, positions=8192) -> dict:
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, rope_theta=theta,
                tie_word_embeddings=tied, max_position_embeddings=positions)


SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape("llama", _llama(576, 1536, 30, 9, 3, 49152, 100000.0, True), "smollm2-135m-4l",
                          "HuggingFaceTB/SmolLM2-135M-Instruct"),
    # The default pair's distilled draft: four of the target's layers with its width (training/distill.py).
    "smollm2-135m-4l": Shape("llama", _llama(576, 1536, 4, 9, 3, 49152, 100000.0, True), None,
                             "four layers of SmolLM2-135M"),
    "llama-2-7b": Shape("llama", _llama(4096, 11008, 32, 32, 32, 32000, 10000.0, False, 4096), "llama-68m",
                        "meta-llama/Llama-2-7b-hf"),
    # The draft Spec-Bench's and SpecInfer's Llama-2 / Vicuna runs use.
    "llama-68m": Shape("llama", _llama(768, 3072, 2, 12, 12, 32000, 10000.0, False, 2048), None, "JackFram/llama-68m"),
    "llama-3.1-8b": Shape("llama", _llama(4096, 14336, 32, 32, 8, 128256, 500000.0, False), "llama-3.2-1b",
                          "meta-llama/Llama-3.1-8B-Instruct"),
    "llama-3.2-1b": Shape("llama", _llama(2048, 8192, 16, 32, 8, 128256, 500000.0, True), None,
                          "meta-llama/Llama-3.2-1B-Instruct"),
    "llama-3.3-70b": Shape("llama", _llama(8192, 28672, 80, 64, 8, 128256, 500000.0, False), "llama-3.2-1b",
                           "meta-llama/Llama-3.3-70B-Instruct"),
    "qwen2.5-7b": Shape("qwen2", _llama(3584, 18944, 28, 28, 4, 152064, 1000000.0, False), "qwen2.5-0.5b",
                        "Qwen/Qwen2.5-7B-Instruct"),
    # Its embedding has 151,936 rows to the 7B's 152,064 (both pad the same tokenizer); here the target's, so the
    # two score the same ids.
    "qwen2.5-0.5b": Shape("qwen2", _llama(896, 4864, 24, 14, 2, 152064, 1000000.0, True), None,
                          "Qwen/Qwen2.5-0.5B-Instruct"),
    # For tests and the CPU dry run of the device check: seconds, any machine.
    "tiny": Shape("llama", _llama(64, 128, 3, 4, 2, 512, 10000.0, False, 4096), "tiny-draft", "none (tests)"),
    "tiny-draft": Shape("llama", _llama(32, 64, 1, 2, 1, 512, 10000.0, False, 4096), None, "none (tests)"),
}


def parameters_of(name: str) -> int:
    """How many parameters a model of shape ``name`` has (built on the meta device: no memory, no time)."""
    with torch.device("meta"):
        return sum(p.numel() for p in _build(SHAPES[name]).parameters())


def _build(shape: Shape, dtype: torch.dtype | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(shape.family, **shape.config), dtype=dtype)


def synthetic_model(name: str, seed: int, device: torch.device, dtype: torch.dtype, specials: dict[str, int]):
    """A model of shape ``name`` with transformers' own random initialisation, seeded, made on ``device`` in
    ``dtype`` (no float32 copy on the host: an 8B shape in bf16 takes 16 GB, not 32). ``specials``: the
    tokenizer's special ids."""
    shape = SHAPES[name]
    torch.manual_seed(seed)
    with torch.device(device):
        model = _build(Shape(shape.family, {**shape.config, **specials}), dtype)
    return model.eval()
