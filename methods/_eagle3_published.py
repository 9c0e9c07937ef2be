"""The authors' published EAGLE-3 draft (``method=eagle3 method.weights``), mapped onto
:class:`methods._eagle3_draft.Eagle3Draft`.

Layout, as the authors' ``ea_model.py`` / ``cnets.py`` build and read it (Spec-Bench's ``model/eagle3``), e.g.
``yuhuili/EAGLE3-Vicuna1.3-13B``, ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``:

- ``config.json``: a one-layer Llama config of the draft with ``draft_vocab_size`` (and, for a draft narrower than
  its target, ``target_hidden_size``: not read here, the draft here is as wide as the target);
- ``pytorch_model.bin`` (or ``model.safetensors``): ``fc.weight (H, 3H)``; ``midlayer.*`` (``hidden_norm``,
  ``input_layernorm``, ``self_attn.{q,k,v}_proj (., 2H)``, ``o_proj``, ``mlp.*``, ``post_attention_layernorm``);
  ``norm.weight``; ``lm_head.weight (V', H)``; ``d2t (V',)`` (draft row i is target id i + d2t[i]) and ``t2d
  (V,)`` (bool), both absent when the draft vocabulary is the target's (the authors' loader deletes them then);
  optionally ``embed_tokens.weight``, which must then be the target's embedding (the authors read the base
  model's).

The names are :class:`Eagle3Draft`'s own, so the mapping is one to one; the authors' loader is ``strict=False``,
here every tensor is taken with its shape and nothing may be left over.
"""

from __future__ import annotations

import torch

from core.checkpoints import Checkpoint, load_converted, locate
from core.errors import BenchError
from methods._eagle3_draft import Eagle3Draft

FILES = ("pytorch_model.bin", "model.safetensors")
WHAT = "EAGLE-3 draft"


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


def eagle3_draft(ck: Checkpoint, target) -> Eagle3Draft:
    """The published draft as an :class:`Eagle3Draft` (every tensor of the file taken, shapes checked)."""
    config = target.config
    H, V = config.hidden_size, config.vocab_size
    if not ck.config:
        raise BenchError(f"{ck.folder} has no config.json, which the {WHAT} is built from.")
    for name, want in (("hidden_size", H), ("vocab_size", V), ("target_hidden_size", H)):
        if ck.config.get(name, want) != want:
            raise BenchError(f"{ck.folder / 'config.json'} says {name}: {ck.config[name]}, but this target's is "
                             f"{want}: this {WHAT} was made for another model.")
    draft = Eagle3Draft(config, draft_vocab(ck, V))
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if name in ck.config and ck.config[name] != getattr(draft.config, name):
            raise BenchError(f"{ck.folder / 'config.json'} says {name}: {ck.config[name]}, but a draft for this target "
                             f"has {getattr(draft.config, name)}.")
    state = {name: ck.take(name, tuple(value.shape)).float() for name, value in draft.state_dict().items()
             if name not in ("d2t", "t2d")}
    draft.load_state_dict({**state, "d2t": draft.d2t, "t2d": draft.t2d}, strict=True)
    if ck.has("embed_tokens.weight"):
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
        draft = Eagle3Draft(target.config, torch.arange(d2t.numel()) + d2t)
        draft.load_state_dict(blob["state"])
        return draft.eval()

    return load_converted(ck, "eagle3", target, cache, lambda: eagle3_draft(ck, target),
                          lambda draft: {"state": draft.state_dict()}, load)
