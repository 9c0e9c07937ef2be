"""The authors' published EAGLE-3 draft (``method=eagle3 method.weights``), mapped onto
:class:`methods.eagle._draft3.Eagle3Draft`.

Layout, as the authors' ``ea_model.py`` / ``cnets.py`` build and read it (Spec-Bench's ``model/eagle3``), e.g.
``yuhuili/EAGLE3-Vicuna1.3-13B``, ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``:

- ``config.json``: a one-layer Llama config of the draft (its width H is ``hidden_size``) with
  ``draft_vocab_size`` and, for a draft narrower than its target, ``target_hidden_size`` H_t (which must be this
  target's; H_t = H when absent);
- ``pytorch_model.bin`` (or ``model.safetensors``): ``fc.weight (H, 3H_t)``; ``midlayer.*`` (``hidden_norm``,
  ``input_layernorm``, ``self_attn.{q,k,v}_proj (., 2H)``, ``o_proj``, ``mlp.*``, ``post_attention_layernorm``);
  ``norm.weight``; ``lm_head.weight (V', H)``; ``d2t (V',)`` (draft row i is target id i + d2t[i]) and ``t2d
  (V,)`` (bool), both absent when the draft vocabulary is the target's (the authors' loader deletes them then);
  ``embed_tokens.weight (V, H)``.

Every published draft's layer is built as the authors' ``cnets.Model`` builds it, from its own config
(:func:`layer_fields`: heads ``hidden_size / num_attention_heads`` wide, MLP width, norm epsilon, rotary base and
linear scaling, their ``EConfig``'s defaults where a field is absent), not from the target's: the two can differ
(a Llama-3 target's llama3 rotary scaling is not one their config can say). A draft as wide as its target reads the
target's token embedding; its ``embed_tokens``, optional, must be that embedding (what the authors read: the base
model's, or with ``target_hidden_size`` in the config the file's copy). A draft narrower than its target: ``fc``
maps 3H_t -> H, and ``embed_tokens.weight`` is required: the draft's own token embedding, read instead of the
target's.

The names are :class:`Eagle3Draft`'s own, so the mapping is one to one; the authors' loader is ``strict=False``,
here every tensor is taken with its shape and nothing may be left over.
"""

from __future__ import annotations

import json

import torch
from transformers.activations import ACT2FN

from core.checkpoints import Checkpoint, load_converted, locate
from core.errors import BenchError
from methods.eagle._draft3 import Eagle3Draft

FILES = ("pytorch_model.bin", "model.safetensors")
WHAT = "EAGLE-3 draft"
READER = 2  # 2: the layer built from the file's own config (1 built it from the target's)


def draft_vocab(ck: Checkpoint, vocab: int) -> torch.Tensor:
    """``LongTensor (V',)``: the target id of each draft row, from the file's ``d2t`` (and its ``t2d``, which must
    agree), or the whole vocabulary when the config's ``draft_vocab_size`` is the target's."""
    size = ck.field("draft_vocab_size", vocab)
    if size == vocab and not ck.has("d2t"):
        return torch.arange(vocab)
    vocab_map = torch.arange(size) + ck.take("d2t", (size,)).long()
    t2d = ck.take("t2d", (vocab,)).bool()
    inside = vocab_map.min() >= 0 and vocab_map.max() < vocab
    if not inside or not torch.equal(t2d.nonzero().flatten(), vocab_map.sort().values):
        raise BenchError(f"{ck.file}: 'd2t' and 't2d' do not describe the same draft vocabulary within this target's "
                         f"{vocab} ids.")
    return vocab_map


def rotary(ck: Checkpoint) -> dict:
    """A published draft's rotary settings (transformers' ``rope_parameters``) as the authors' attention
    (``cnets.py``'s ``_init_rope``) builds them: no ``rope_scaling``: base ``rope_theta`` (10000 when absent);
    ``{"type": "linear", "factor": f}``: positions divided by f at base 10000, whatever ``rope_theta`` says (their
    linear rotary is built without it)."""
    scaling = ck.config.get("rope_scaling")
    if scaling is None:
        return {"rope_type": "default", "rope_theta": float(ck.field("rope_theta", 10000.0, (int, float)))}
    factor = scaling.get("factor") if isinstance(scaling, dict) and scaling.get("type") == "linear" else None
    if isinstance(factor, (int, float)) and factor > 0:
        return {"rope_type": "linear", "factor": float(factor), "rope_theta": 10000.0}
    # Their "dynamic" rescales by the length their cache has reached, which transformers' dynamic rotary does not.
    raise BenchError(f"{ck.folder / 'config.json'} says rope_scaling: {json.dumps(scaling)}; an {WHAT} is read here "
                     'with no rope_scaling or {"type": "linear", "factor": f} only (the authors\' dynamic scaling is '
                     "not transformers').")


def layer_fields(ck: Checkpoint, hidden: int) -> dict:
    """The :func:`methods.eagle._draft3.draft_config` fields of a published draft ``hidden`` wide: its
    ``config.json``'s, with the authors' ``EConfig`` defaults where a field is absent, and their heads
    ``hidden_size / num_attention_heads`` wide (their ``cnets.py`` ignores ``head_dim``: one that differs is
    refused)."""
    path = ck.folder / "config.json"
    heads = ck.field("num_attention_heads", 32)
    # num_key_value_heads null or absent: one per query head (EConfig).
    kv_heads = heads if ck.config.get("num_key_value_heads") is None else ck.field("num_key_value_heads")
    if min(hidden, heads, kv_heads) <= 0 or hidden % heads or heads % kv_heads:
        raise BenchError(f"{path} says hidden_size: {hidden}, num_attention_heads: {heads}, num_key_value_heads: "
                         f"{kv_heads}: the heads do not split the draft's width evenly.")
    head_dim = hidden // heads
    if ck.config.get("head_dim") not in (None, head_dim):
        raise BenchError(f"{path} says head_dim: {ck.config['head_dim']}, but the authors' draft layer has heads of "
                         f"hidden_size / num_attention_heads = {head_dim}.")
    act = ck.field("hidden_act", "silu", str)
    if act not in ACT2FN:
        raise BenchError(f"{path} says hidden_act: {act!r}, which is not an activation transformers knows.")
    return {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "intermediate_size": ck.field("intermediate_size", 11008), "hidden_act": act,
            "rms_norm_eps": float(ck.field("rms_norm_eps", 1e-6, (int, float))),
            "max_position_embeddings": ck.field("max_position_embeddings", 2048), "rope_parameters": rotary(ck)}


def eagle3_draft(ck: Checkpoint, target) -> Eagle3Draft:
    """The published draft as an :class:`Eagle3Draft` (every tensor of the file taken, shapes checked)."""
    config = target.config
    H, V = config.hidden_size, config.vocab_size
    if not ck.config:
        raise BenchError(f"{ck.folder} has no config.json, which the {WHAT} is built from.")
    # The width its fc reads thrice: target_hidden_size, or the draft's own where the config has none (cnets.Model).
    made_for = "target_hidden_size" if "target_hidden_size" in ck.config else "hidden_size"
    for name, want in ((made_for, H), ("vocab_size", V)):
        if ck.config.get(name, want) != want:
            raise BenchError(f"{ck.folder / 'config.json'} says {name}: {ck.config[name]}, but this target's is "
                             f"{want}: this {WHAT} was made for another model.")
    hidden = ck.field("hidden_size", H)
    # The layer as the authors build it from the draft's own config, whatever its width (their rotary is the
    # config's, which need not be the target's: a Llama-3 target's llama3 scaling is not one their config can say).
    draft = Eagle3Draft(config, draft_vocab(ck, V), layer_fields(ck, hidden))
    if hidden != H and not ck.has("embed_tokens.weight"):
        raise BenchError(f"{ck.file} has no 'embed_tokens.weight': a draft {hidden} wide (hidden_size) for a target "
                         f"{H} wide (target_hidden_size) reads a token embedding of its own, which its file holds.")
    state = {name: ck.take(name, tuple(value.shape)).float() for name, value in draft.state_dict().items()
             if name not in ("d2t", "t2d")}  # a narrower draft's embed_tokens.weight (V, H) among them
    draft.load_state_dict({**state, "d2t": draft.d2t, "t2d": draft.t2d}, strict=True)
    if hidden == H and ck.has("embed_tokens.weight"):
        emb = ck.take("embed_tokens.weight", (V, H)).float()
        if not torch.allclose(emb, target.get_input_embeddings().weight.detach().float().cpu(), atol=1e-2):
            raise BenchError(f"{ck.file}: 'embed_tokens.weight' is not this target's token embedding: this {WHAT} was "
                             "trained for another target.")
    ck.finish()
    return draft.eval()


def load_published_eagle3(weights: str, target, cache) -> tuple[Eagle3Draft, dict]:
    """The published EAGLE-3 draft at ``weights`` (a folder or a hub id; converted and checked once, then cached),
    on the CPU in fp32, and what was read (file, SHA-256, config)."""
    ck = Checkpoint(locate(weights, FILES), FILES, WHAT)

    def load(blob: dict) -> Eagle3Draft:
        d2t = blob["state"]["d2t"]
        draft = Eagle3Draft(target.config, torch.arange(d2t.numel()) + d2t, blob["layer"])
        draft.load_state_dict(blob["state"])
        return draft.eval()

    return load_converted(ck, "eagle3", target, cache, lambda: eagle3_draft(ck, target),
                          lambda draft: {"state": draft.state_dict(), "layer": draft.layer}, load, reader=READER)
