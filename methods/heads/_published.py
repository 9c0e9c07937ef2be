"""The authors' published Medusa and Hydra heads (``method.weights``), mapped onto :mod:`methods.heads._heads`.

Layouts, as the authors' code builds and reads them (Medusa's and Hydra's ``from_pretrained``, and Spec-Bench's
``model/medusa``, ``model/hydra``):

- **Medusa** (``FasterDecoding/medusa-vicuna-7b-v1.3``): ``medusa_lm_head.pt`` (or ``.safetensors``), head i an
  ``nn.Sequential`` of ``medusa_num_layers`` blocks ``x + SiLU(W x + b)`` and an output layer without bias:
  ``{i}.{j}.linear.weight (H, H)``, ``{i}.{j}.linear.bias (H,)``, ``{i}.{L}.weight (V, H)``. The heads read the
  target's last normed hidden state. The published configs say ``medusa_num_heads: 2`` while the files hold 5
  heads (the authors' loader hard-codes 5, Spec-Bench asks for 4 and drops the fifth through ``strict=False``):
  the number of heads is read from the file's keys, and all of them are loaded.
- **Hydra** (``ankner/hydra-vicuna-7b-v1.3``): ``hydra_lm_head.pt``; ``hydra_head_arch`` ``mlp`` (Hydra) or
  ``prefix-mlp`` (Hydra++); ``grounded_heads`` must be true (the heads read the path's token embeddings).
  Head i: ``hydra_mlp.{i}`` blocks, the first ``R x' + SiLU(W x')`` over ``x' = [h; e(x_{t+1}); ...;
  e(x_{t+i+1})]`` (a learned residual projection ``res_connection``), then ``hydra_num_layers - 1`` blocks
  ``x + SiLU(W x)``; output ``hydra_lm_head.{i}`` (V, H) with a bias. ``prefix-mlp`` puts a dropout before each
  block and output layer (so blocks sit at odd indices, the output layer at ``.1``) and adds
  ``prefix_embeding_layer``, a one-layer Llama decoder (``LlamaModel``) over the target's hidden states whose
  output the heads read instead. Its token embedding is never read (the layer is fed vectors): taken and
  shape-checked, then dropped. A rotary ``inv_freq`` buffer, saved by the authors' Llama code, must equal the
  target's.

The authors repeat one block object ``num_layers`` times (``[ResBlock(h)] * n``), so a file holds the same tensors
under each index; here each index is its own block with those values, which computes the same.
"""

from __future__ import annotations

import logging

import torch

from core.checkpoints import Checkpoint, load_converted, locate
from core.errors import BenchError
from methods.heads._heads import Heads, PrefixLayer

log = logging.getLogger(__name__)

FILES = {"medusa": ("medusa_lm_head.safetensors", "medusa_lm_head.pt"), "hydra": ("hydra_lm_head.pt",)}
WHAT = {"medusa": "Medusa heads", "hydra": "Hydra heads"}


def read_checkpoint(kind: str, weights: str) -> Checkpoint:
    """The published checkpoint of ``kind`` heads at ``weights`` (a folder or a hub id)."""
    if kind not in FILES:
        raise BenchError(f"{kind} has no published heads this harness reads (only medusa, hydra and hydra_pp do).")
    return Checkpoint(locate(weights, FILES[kind]), FILES[kind], WHAT[kind])


def _load(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` into ``module``'s parameters of those names (every one of them: strict)."""
    module.load_state_dict({k: v.to(torch.float32) for k, v in values.items()}, strict=True)


def medusa_heads(ck: Checkpoint, target_config) -> Heads:
    """Medusa's published heads as :class:`Heads` (full vocabulary, ``medusa_num_layers`` blocks each)."""
    H, V = target_config.hidden_size, target_config.vocab_size
    layers = ck.field("medusa_num_layers", 1)
    ids = sorted({int(k.split(".", 1)[0]) for k in ck.keys() if k.split(".", 1)[0].isdigit()})
    if not ids or ids != list(range(len(ids))):
        raise BenchError(f"{ck.file} holds no heads numbered 0, 1, ...: not Medusa heads.")
    if ck.config.get("medusa_num_heads") not in (None, len(ids)):
        log.info("%s says medusa_num_heads=%s; the file holds %d heads, all loaded", ck.folder / "config.json",
                 ck.config["medusa_num_heads"], len(ids))
    heads = Heads("medusa", H, len(ids), torch.arange(V), layers, published=True)
    for i in ids:
        for j, block in enumerate([heads.blocks[i], *heads.deeper[i]]):
            _load(block, {"linear.weight": ck.take(f"{i}.{j}.linear.weight", (H, H)),
                          "linear.bias": ck.take(f"{i}.{j}.linear.bias", (H,))})
        _load(heads.proj[i], {"weight": ck.take(f"{i}.{layers}.weight", (V, H))})
    return heads


def hydra_heads(ck: Checkpoint, target, method: str) -> tuple[Heads, PrefixLayer | None]:
    """Hydra's published heads (and Hydra++'s prefix layer) as :class:`Heads` and :class:`PrefixLayer`."""
    config = target.config
    H, V = config.hidden_size, config.vocab_size
    arch = ck.field("hydra_head_arch", "mlp", str)
    want = {"hydra": "mlp", "hydra_pp": "prefix-mlp"}[method]
    if arch != want:
        other = {"mlp": "hydra", "prefix-mlp": "hydra_pp"}.get(arch)
        hint = f"; run them with method={other}" if other else ""
        raise BenchError(f"{ck.folder / 'config.json'} says hydra_head_arch: {arch}, but method={method} reads "
                         f"'{want}' heads{hint}.")
    if not ck.field("grounded_heads", False, bool):
        raise BenchError(f"{ck.folder / 'config.json'} says grounded_heads: false: those heads do not read the path's "
                         "tokens, which Hydra's decoding feeds them; only grounded heads are read here.")
    if ck.field("hidden_state_offset", 0) != 0:
        raise BenchError(f"{ck.folder / 'config.json'} says hidden_state_offset: {ck.config['hidden_state_offset']}: "
                         "heads reading an earlier layer than the last are not read here.")
    layers = ck.field("hydra_num_layers", 1)
    n = len({k.split(".")[1] for k in ck.keys("hydra_lm_head.")})
    if n == 0:
        raise BenchError(f"{ck.file} has no 'hydra_lm_head.*' tensors: not Hydra heads.")
    heads = Heads("hydra", H, n, torch.arange(V), layers, published=True)
    prefix = arch == "prefix-mlp"
    step, first = (2, 1) if prefix else (1, 0)  # prefix-mlp: a dropout before every block and output layer
    out = "hydra_lm_head.{i}.1" if prefix else "hydra_lm_head.{i}"
    for i in range(n):
        width = (i + 2) * H
        _load(heads.blocks[i], {
            "linear.weight": ck.take(f"hydra_mlp.{i}.{first}.linear.weight", (H, width)),
            "linear.bias": ck.take(f"hydra_mlp.{i}.{first}.linear.bias", (H,)),
            "res_connection.weight": ck.take(f"hydra_mlp.{i}.{first}.res_connection.weight", (H, width)),
            "res_connection.bias": ck.take(f"hydra_mlp.{i}.{first}.res_connection.bias", (H,))})
        for j, block in enumerate(heads.deeper[i], start=1):
            at = first + j * step
            _load(block, {"linear.weight": ck.take(f"hydra_mlp.{i}.{at}.linear.weight", (H, H)),
                          "linear.bias": ck.take(f"hydra_mlp.{i}.{at}.linear.bias", (H,))})
        _load(heads.proj[i], {"weight": ck.take(out.format(i=i) + ".weight", (V, H)),
                              "bias": ck.take(out.format(i=i) + ".bias", (V,))})
    if ck.has("input_embed_fn.weight"):  # the target's embedding, saved with the heads by the authors' module
        same = ck.take("input_embed_fn.weight", (V, H)).float()
        if not torch.allclose(same, target.get_input_embeddings().weight.detach().float().cpu(), atol=1e-2):
            raise BenchError(f"{ck.file}: 'input_embed_fn.weight' is not this target's token embedding: these heads "
                             "were trained on another target.")
    return heads, (prefix_layer(ck, target) if prefix else None)


def prefix_layer(ck: Checkpoint, target) -> PrefixLayer:
    """Hydra++'s published ``prefix_embeding_layer`` (one Llama decoder layer and its final norm)."""
    config = target.config
    H, V = config.hidden_size, config.vocab_size
    layer = PrefixLayer(config, residual=False)
    own = layer.body.state_dict()
    values = {}
    for name, value in own.items():
        if name == "embed_tokens.weight":
            continue  # the body is fed vectors; its table is a 1-row stub
        values[name] = ck.take(f"prefix_embeding_layer.{name}", tuple(value.shape))
    ck.take("prefix_embeding_layer.embed_tokens.weight", (V, H))  # never read by the layer: checked, dropped
    for key in ck.keys("prefix_embeding_layer."):
        if key.endswith("rotary_emb.inv_freq"):
            saved = ck.take(key, tuple(layer.body.rotary_emb.inv_freq.shape)).float()
            if not torch.allclose(saved, layer.body.rotary_emb.inv_freq.float(), rtol=1e-3):
                raise BenchError(f"{ck.file}: '{key}' differs from this target's rotary frequencies: the prefix "
                                 "layer was trained for another target.")
    _load(layer.body, {**values, "embed_tokens.weight": own["embed_tokens.weight"]})
    return layer


def published_heads(kind: str, method: str, weights: str, target, target_id: str | None
                    ) -> tuple[Heads, PrefixLayer | None, Checkpoint]:
    """Read and check the published heads of ``method`` (medusa, hydra, hydra_pp) at ``weights`` for ``target``
    (whose hub id or folder is ``target_id``; ``None``: a model with no name): every tensor of the file used,
    none missing. Returns the heads, the prefix layer (Hydra++) and the checkpoint."""
    ck = read_checkpoint(kind, weights)
    return (*heads_from(ck, kind, method, target, target_id), ck)


def heads_from(ck: Checkpoint, kind: str, method: str, target, target_id: str | None
               ) -> tuple[Heads, PrefixLayer | None]:
    """:func:`published_heads` from a checkpoint already found."""
    ck.check_base(target_id)
    if kind == "medusa":
        heads, prefix = medusa_heads(ck, target.config), None
    else:
        heads, prefix = hydra_heads(ck, target, method)
    ck.finish()
    return heads.eval(), (prefix.eval() if prefix is not None else None)


def load_published_heads(kind: str, method: str, weights: str, target, target_id: str | None, cache
                         ) -> tuple[Heads, PrefixLayer | None, dict]:
    """The published heads of ``method`` at ``weights`` (converted and checked once, then cached): the heads, the
    prefix layer (Hydra++, else ``None``), both on the CPU in fp32, and what was read (file, SHA-256, config)."""

    def save(made) -> dict:
        heads, prefix = made
        return {"kind": heads.kind, "num_heads": heads.num_heads, "layers": heads.layers, "state": heads.state_dict(),
                "prefix": prefix.state_dict() if prefix is not None else None}

    def load(blob: dict) -> tuple[Heads, PrefixLayer | None]:
        heads = Heads(blob["kind"], target.config.hidden_size, blob["num_heads"], blob["state"]["vocab_map"],
                      blob["layers"], published=True)
        heads.load_state_dict(blob["state"])
        prefix = None
        if blob["prefix"] is not None:
            prefix = PrefixLayer(target.config, residual=False)
            prefix.load_state_dict(blob["prefix"])
            prefix.eval()
        return heads.eval(), prefix

    ck = read_checkpoint(kind, weights)
    convert = lambda: heads_from(ck, kind, method, target, target_id)  # noqa: E731 - read once, when not cached
    (heads, prefix), report = load_converted(ck, method, target, cache, convert, save, load)
    return heads, prefix, report
