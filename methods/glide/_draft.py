"""GliDe's draft (Du et al., ICML 2024, "GliDe with a CaPE: A Low-Hassle Method to Accelerate Speculative
Decoding"): a small decoder whose blocks, between their causal self-attention and their MLP, *glimpse* the
target's KV cache: a cross-attention whose keys and values are those the target computed for the committed
context at its last verification.

Each of ``recipe.layers`` blocks (the target's dimensions and layer classes; ``h`` its input):

    h = h + SelfAttn(norm_1(h))             causal over the draft's own sequence (its own KV cache while decoding)
    h = h + CrossAttn(norm_2(h), K_L, V_L)  queries from the draft, rotated by the target's rotary at their own
                                            positions so they meet the target's post-rotary keys; keys and values:
                                            the target's cached ones of layer L (GQA: kv heads repeated as the
                                            target repeats them); no key or value projection of its own
    h = h + MLP(norm_3(h))

fed the target's frozen input embeddings of the tokens, read by a final norm and the target's output rows over a
reduced vocabulary.

What a draft position sees of the target, the same in training and decoding: after a verification the target's
cache holds the committed tokens minus the pending one, at position p; the draft reads the pending token at p
and drafts p+1, p+2, ..., every query seeing the target's keys of positions < p. Training reproduces this with
GliDe's block-wise mask (as in the authors' LongSpec code): sequences are cut into blocks of ``recipe.block``
positions (a random phase per batch, so every alignment is seen) and a query in the block that starts at b sees
the target at positions < b only; a query that sees nothing gets a zero cross-attention output. Decoding uses
the same rule, the block aligned to start at p (:func:`decode_visible`), so a one-block draft never meets a view
it was not trained on as long as ``gamma <= recipe.block``. With more blocks it can: a later block's
self-attention reads earlier positions' states as computed at their own step, and decoding advances by the
accepted length, not by whole blocks, so those states mix alignments training never shows (not a matter of
losslessness, only of acceptance).

Where this differs from the paper, and why:

- labels: the target's own next-token distribution (the teacher store's top-k, over the reduced vocabulary),
  not the training text's next tokens: the store is what every trainer here reads, and the target's
  distribution is what verification accepts;
- the head: the target's output rows of the ``recipe.vocab`` most frequent stored tokens, as EAGLE's here: on a
  CPU the full head would cost a small draft more than its blocks (candidates outside it are never proposed;
  verification stays lossless);
- initialisation (``recipe.init: target``, default): the blocks start from the target's last layers and each
  cross-attention from the read layer's own query and output projections and input norm, projections made
  to meet exactly those keys (a starting point, not a trained draft: untrained, it agrees with the target 0.4%
  of the time).
  GliDe starts from a small pretrained draft model, the LongSpec reference layer from random weights
  (``init: random``); here there is no small pretrained model of the target's family, and 10^5 teacher tokens
  are few to learn attention from scratch;
- a final norm before the head (the target's, copied), as the target and EAGLE's draft here have; the
  LongSpec layer feeds its head without one.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field
from torch import nn
from torch.nn.functional import scaled_dot_product_attention
from transformers.modeling_outputs import BaseModelOutputWithPast

from core.artifacts import Artifact
from core.counting import CountedLM
from core.errors import BenchError
from core.kv_cache import CACHE_ARG, cache_kwargs
from core.model_parts import body_config, copy_last_layers, decoder_layers
from decoding.tree import additive_mask
from training.kit import (
    agreement,
    answer_rows,
    budget,
    fit_and_measure,
    module_artifact,
    part_epochs,
    part_key,
    store_data,
    store_vocab,
    sub_index,
    trained_part,
    training_start,
    untrained_vocab,
    vocab_coverage,
)
from training.kv_store import kv_layer
from training.loop import TrainRecipe
from training.store import tokenizer_key
from training.teacher import Teacher

BLOCK_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@trained_part("glide")
class GlideRecipe(TrainRecipe):
    """How GliDe's draft is trained (cached under cache_dir/glide/, keyed by the target, this recipe, the tokenizer
    and the run's training recipe)."""

    EPOCHS = {"smoke": 1, "quick": 2, "full": 2}

    lr: float = Field(2.0e-3, gt=0, description="AdamW learning rate (one-cycle schedule)")
    vocab: int = Field(8192, ge=1, description="the draft proposes from the most frequent stored tokens only "
                       "(verification stays lossless; the paper uses the whole vocabulary)")
    layers: int = Field(1, ge=1, description="decoder blocks of the draft (self-attention, cross-attention to the "
                        "target's cache, MLP)")
    layer: int = Field(-1, ge=-1, description="the target's decoder layer whose cached keys and values the draft "
                       "reads: -1 the last (as the authors' LongSpec code reads), or its index")
    block: int = Field(4, ge=1, description="training's block mask: a query sees the target's keys before its "
                       "block of this many positions only (method.gamma may not exceed it)")
    init: Literal["target", "random"] = Field("target", description="the blocks start from the target's last "
                                              "layers and the cross-attention from layer L's query and output "
                                              "projections, or from random weights")


# --------------------------------------------------------------------------------------------- what is seen


def visible_keys(positions: torch.Tensor, kv_len: int, block: int, phase: int) -> torch.Tensor:
    """``BoolTensor (n, kv_len)``: which target positions each query at ``positions (n,)`` sees: those before
    the start of its block (blocks of ``block`` positions, one starting at ``-phase``), below ``kv_len``."""
    starts = torch.div(positions + phase, block, rounding_mode="floor") * block - phase
    return torch.arange(kv_len, device=positions.device)[None] < starts[:, None]


def decode_visible(positions: torch.Tensor, p: int, block: int) -> torch.Tensor:
    """:func:`visible_keys` while decoding, the target's cache holding positions < ``p`` (the pending token's):
    a block starts at p, so every query at p .. p + block - 1 sees all of the cache, and the committed tokens
    the draft reads late (the prompt, a fully accepted draft's last token) see what training showed them."""
    return visible_keys(positions, p, block, (-p) % block)


def causal_after(cache, emb: torch.Tensor) -> torch.Tensor:
    """The additive causal mask ``(1, 1, n, past + n)`` of ``emb (B, n, h)``'s positions after the ``cache``'s."""
    n, past = emb.shape[1], cache.get_seq_length() if cache is not None else 0
    return additive_mask(torch.ones(n, n, dtype=torch.bool, device=emb.device).tril(), past, emb.dtype, emb.device)


# --------------------------------------------------------------------------------------------- the draft


class CrossAttention(nn.Module):
    """GliDe's glimpse of the target: ``q_proj`` (H -> heads * d: the draft's width to the target's attention width)
    of the draft's states, rotated to their positions by the target's rotary; keys and values the target's cached
    ones as they are; ``o_proj`` back to H."""

    def __init__(self, hidden: int, heads: int, head_dim: int, rotary, q_bias: bool = False, o_bias: bool = False):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=q_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        self.rotary = rotary  # the target family's apply_rotary_pos_emb

    @classmethod
    def like(cls, config, self_attn: nn.Module, rotary) -> CrossAttention:
        """Shaped as the family's own attention ``self_attn`` of ``config`` (with its biases, where it has them),
        freshly initialised."""
        return cls(self_attn.q_proj.in_features, config.num_attention_heads, self_attn.head_dim, rotary,
                   self_attn.q_proj.bias is not None, self_attn.o_proj.bias is not None)

    def forward(self, x: torch.Tensor, cos_sin, k: torch.Tensor, v: torch.Tensor,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """``x (B, n, H)`` at positions whose rotary is ``cos_sin``; ``k``, ``v`` ``(B, n_kv, m, d)``: the target's
        cached keys and values; ``visible``: ``BoolTensor (B or 1, n, m)``, which of them each query sees (``None``:
        all). Returns ``(B, n, H)``, zero for a query that sees none."""
        B, n, _ = x.shape
        q = self.q_proj(x).view(B, n, self.heads, self.head_dim).transpose(1, 2)
        q = self.rotary(q, q, *cos_sin)[0]
        if k.shape[-2] == 0:
            return torch.zeros_like(x)
        rep = self.heads // k.shape[1]  # GQA: query head h reads kv head h // rep, as the target's attention does
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        seen = None
        if visible is not None:
            seen = visible.any(-1)  # (B or 1, n)
            # A query that sees nothing would take a softmax over nothing (NaN): let it see all, then zero its output.
            visible = (visible | ~seen[..., None])[:, None]
        out = scaled_dot_product_attention(q, k, v, attn_mask=visible)
        out = self.o_proj(out.transpose(1, 2).reshape(B, n, -1))
        return out if seen is None else out * seen[..., None].to(out.dtype)


class GlideDecoder(nn.Module):
    """A GliDe draft called as a transformers decoder, which is how a batch's forwards run it
    (``core.compiled.CompiledLM``): ``inputs_embeds (B, n, h)`` the tokens' embeddings (swapped in for a one-row
    table), ``cross``: ``(kvs, visible)``, per block the target's cached keys and values ``(B, n_kv, m, d)`` and which
    of them each query sees ``(B, n, m)``; the draft's own cache handed as the installed release names it (a batch's
    ``RowCache``), ``attention_mask`` ``(B, 1, n, past + n)`` and ``position_ids (B, n)`` as there (None: causal after
    the cache) -> ``last_hidden_state (B, n, h)``, the states the head reads."""

    def __init__(self, draft: nn.Module):
        super().__init__()
        self.__dict__["draft"] = draft  # not a submodule: the draft owns this, not the other way round

    def forward(self, input_ids=None, inputs_embeds: torch.Tensor | None = None, attention_mask=None, position_ids=None,
                use_cache: bool | None = None, cross=None, **kwargs) -> BaseModelOutputWithPast:
        cache = kwargs.pop(CACHE_ARG, None)
        if input_ids is not None or inputs_embeds is None or cross is None or kwargs:
            raise ValueError("GliDe's draft reads inputs_embeds, the target's keys and values (cross) and a cache only")
        if position_ids is None:
            past, n = (cache.get_seq_length() if cache is not None else 0), inputs_embeds.shape[1]
            position_ids = torch.arange(past, past + n, device=inputs_embeds.device)[None]
        kvs, visible = cross
        return BaseModelOutputWithPast(last_hidden_state=self.draft(inputs_embeds, position_ids, kvs, visible, cache,
                                                                    attention_mask))


class AsDecoder:
    """What ``core.compiled.CompiledLM`` reads of a GliDe draft (:class:`GlideDraft`, the authors'
    ``PublishedGlide``) to run a batch's forwards: its decoder (:class:`GlideDecoder`), a one-row token table of
    zeros as wide as its states (what padding rows read: a real row's embeddings are swapped in), its head, and
    ``read_layers``, the target layer each block reads (set by the method)."""

    read_layers: list[int] | None = None

    def get_decoder(self) -> GlideDecoder:
        if "_decoder" not in self.__dict__:
            self.__dict__["_decoder"] = GlideDecoder(self)
        return self.__dict__["_decoder"]

    def get_input_embeddings(self) -> nn.Embedding:
        weight = self.head.weight
        table = self.__dict__.get("_padding")
        if table is None or table.weight.device != weight.device or table.weight.dtype != weight.dtype:
            table = nn.Embedding(1, weight.shape[1], device=weight.device, dtype=weight.dtype).requires_grad_(False)
            nn.init.zeros_(table.weight)
            self.__dict__["_padding"] = table
        return table

    def get_output_embeddings(self) -> nn.Linear:
        return self.head


class GlideDraft(AsDecoder, nn.Module):
    """``layers`` GliDe blocks of the target's classes (self-attention, norms and MLP from transformers' model cut
    to that depth, :func:`core.model_parts.body_config`; its rotary and final norm), a :class:`CrossAttention` and
    its norm per block, and the frozen ``head`` (the target's output rows of ``vocab_map``, ``LongTensor (V',)``)."""

    def __init__(self, target_config, vocab_map: torch.Tensor, layers: int = 1):
        super().__init__()
        from transformers import AutoModel

        self.config = body_config(target_config, layers)
        self.body = AutoModel.from_config(self.config).float()
        blocks = getattr(self.body, "layers", None)
        rotary = getattr(sys.modules[type(blocks[0].self_attn).__module__], "apply_rotary_pos_emb", None) if blocks else None
        if rotary is None or not hasattr(self.body, "rotary_emb") or not all(hasattr(blocks[0], p) for p in BLOCK_PARTS):
            raise BenchError(f"method=glide needs a target with rotary attention in Llama-style decoder layers; this "
                             f"target's are {type(self.body).__name__}'s ({target_config.model_type}).")
        self.body.get_input_embeddings().requires_grad_(False)  # fed embeddings, never ids: a 1-row table
        self.cross_norm = nn.ModuleList(copy.deepcopy(b.post_attention_layernorm) for b in blocks)
        self.cross = nn.ModuleList(CrossAttention.like(self.config, b.self_attn, rotary) for b in blocks)
        self.head = nn.Linear(target_config.hidden_size, vocab_map.numel(), bias=False).requires_grad_(False)
        self.register_buffer("vocab_map", vocab_map.long(), persistent=True)

    @classmethod
    def from_target(cls, target, vocab_map: torch.Tensor, init: str = "target", layers: int = 1,
                    layer: int = -1) -> GlideDraft:
        """A draft for ``target`` reading its decoder ``layer``; ``init``: see :class:`GlideRecipe`."""
        draft = cls(target.config, vocab_map, layers)
        if init == "target":
            copy_last_layers(draft.body, target)
            read = decoder_layers(target)[layer]
            for norm, cross in zip(draft.cross_norm, draft.cross):
                norm.load_state_dict(read.input_layernorm.state_dict())
                cross.q_proj.load_state_dict(read.self_attn.q_proj.state_dict())
                cross.o_proj.load_state_dict(read.self_attn.o_proj.state_dict())
        draft.head.weight.data.copy_(target.get_output_embeddings().weight.data[vocab_map.to(target.device)].cpu())
        return draft

    def forward(self, emb: torch.Tensor, positions: torch.Tensor, kvs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                visible: torch.Tensor | None = None, cache=None, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``emb (B, n, H)``: the target's input embeddings of n tokens at ``positions`` (``(n,)``, or ``(B, n)`` one
        row each; consecutive, right after the ``cache``'s); ``kvs``: per block, the target's cached keys and values
        ``(B, n_kv, m, d)`` it reads (here every block reads layer L) at positions 0 .. m-1; ``visible``
        ``(B or 1, n, m)``: which of them each query sees (``None``: all).
        ``cache``: the draft's self-attention KV cache of the earlier positions, extended in place (``None``: the
        whole sequence at once, as in training); ``attention_mask``: its additive mask ``(B or 1, 1, n, past + n)``
        (``None``: causal after the cache's length). Returns ``(B, n, H)``, the states the head reads."""
        cos_sin = self.body.rotary_emb(emb, positions.reshape(-1, emb.shape[1]))
        causal = attention_mask if attention_mask is not None else causal_after(cache, emb)
        h = emb
        for block, norm, cross, (k, v) in zip(self.body.layers, self.cross_norm, self.cross, kvs, strict=True):
            h = h + block.self_attn(block.input_layernorm(h), position_embeddings=cos_sin, attention_mask=causal,
                                    **cache_kwargs(cache))[0]
            h = h + cross(norm(h), cos_sin, k, v, visible)
            h = h + block.mlp(block.post_attention_layernorm(h))
        return self.body.norm(h)


class CountedGlide(CountedLM):
    """The ``glide`` role: ``draft(emb, positions, kvs, visible, cache, rows)`` returns the head's logits
    ``(B, rows, V')`` of the last ``rows`` positions (a :class:`GlideDraft` or the authors' published draft,
    :class:`methods.glide._published.PublishedGlide`). Counted as :mod:`core.flops` counts a model (the blocks'
    and the cross-attention's weights, self-attention over the draft's cache), plus the cross-attention's
    scores and weighted sum over the target's m keys (4 FLOPs per query, key and the target's attention width,
    per block), the head on ``rows`` positions only. In a batch its forwards run as a causal LM's on its batch cache
    (:meth:`CountedLM.forward_rows`), each row's embeddings swapped in and its view of the target's cache given as
    ``cross_seen``."""

    def __init__(self, draft: nn.Module):
        super().__init__(draft, "glide")  # its head's weights: CountedLM reads them from get_output_embeddings
        self.cross_flops_per_key = 4.0 * sum(c.heads * c.head_dim for c in draft.cross)  # summed over the blocks

    def __call__(self, emb, positions, kvs, visible, cache, rows: int = 1):
        n = emb.shape[1]
        cross = self.cross_flops_per_key * n * kvs[0][0].shape[-2]  # scores and sum over the target's m keys
        self._count(1, n, cache.get_seq_length() + n, head_rows=rows, extra_flops=cross)
        out = self.module(emb, positions, kvs, visible, cache)
        return self.module.head(out[:, n - rows :])


# --------------------------------------------------------------------------------------------- training


def soft_ce(logits: torch.Tensor, idx: torch.Tensor, prob: torch.Tensor, to_sub: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits (B, T, V')`` against the target's top-k ``idx``, ``prob (B, T, k)`` restricted to
    the reduced vocabulary and renormalised; positions with no label mass (padding: ``prob`` zero there, or a
    target whose top-k lies outside the vocabulary) are left out."""
    logq = torch.log_softmax(logits.float(), -1)
    sub = to_sub[idx]  # -1 outside the vocabulary
    w = prob * (sub >= 0)
    mass = w.sum(-1, keepdim=True)
    labelled = (mass.squeeze(-1) > 0).float()
    per_pos = -((w / mass.clamp_min(1e-9)) * logq.gather(-1, sub.clamp_min(0))).sum(-1)
    return (per_pos * labelled).sum() / labelled.sum().clamp_min(1.0)


def read_rows(store, kv, rows, fields, device) -> dict[str, torch.Tensor]:
    """Sequences ``rows`` of a store (``fields``) and of its K/V extra (``k``, ``v``), on ``device``."""
    batch = {**store.rows(rows, fields), **kv.rows(rows)}
    return {name: t.to(device) for name, t in batch.items()}


def glide_loss(draft: GlideDraft, batch: dict, embed, to_sub: torch.Tensor, block: int, phase: int) -> torch.Tensor:
    """GliDe's training loss over a store batch (``ids``, ``mask (B, T)``, ``idx``, ``prob (B, T, k)``, the target's
    ``k``, ``v (B, n_kv, T, d)``): the draft teacher-forced over the whole sequence, each query seeing the target
    before its block (blocks of ``block`` positions, phase ``phase``), against the target's next-token
    distribution at every text position."""
    ids = batch["ids"]
    T = ids.shape[1]
    with torch.no_grad():  # the target's embedding is frozen: no gradient for it (a vocabulary-sized one)
        emb = embed(ids)
    positions = torch.arange(T, device=ids.device)
    visible = visible_keys(positions, T, block, phase)[None]
    logits = draft.head(draft(emb, positions, [(batch["k"], batch["v"])] * len(draft.cross), visible))
    return soft_ce(logits, batch["idx"], batch["prob"] * batch["mask"][..., None], to_sub)


def glide_judge(draft: GlideDraft, store, kv, embed, offset: int = 0, device=None):
    """:func:`training.kit.agreement`'s judge for GliDe's draft at the store's text positions t > ``offset``: does
    the draft, reading x_t and seeing the target's keys before t - ``offset``, propose the target's greedy token?
    That is the view of draft token ``offset + 1`` after a verification (x_{t-offset} pending), so the acceptance
    of that token when the ones before it were right (exact for one block, whose self-attention does not read the
    cross-attention; deeper drafts see their earlier rows under this view too)."""

    def judge(rows: torch.Tensor) -> list[tuple]:
        b = read_rows(store, kv, rows, ("ids", "idx", "mask", "answer"), device)
        T = b["ids"].shape[1]
        positions = torch.arange(T, device=device)
        visible = (torch.arange(T, device=device)[None] < (positions - offset)[:, None])[None]
        kvs = [(b["k"], b["v"])] * len(draft.cross)
        proposed = draft.vocab_map[draft.head(draft(embed(b["ids"]), positions, kvs, visible)).argmax(-1)]
        hit = proposed == b["idx"][..., 0]
        counted = b["mask"] & (positions > offset)
        return [(hit, counted, counted & b["answer"])]

    return judge


def train_glide(target, tokenizer, recipe: GlideRecipe, teacher: Teacher) -> tuple[GlideDraft, dict]:
    """Train GliDe's draft from the teacher store (the target's labels and its layer-L keys and values over the
    stored ids); returns it (CPU, fp32) and a report: held-out agreement of the first draft token with the
    target before and after (all text, the target's own answers) and of each draft position after."""
    target, device = training_start(target, recipe.seed)
    layer = kv_layer(target.config, recipe.layer, "method.recipe.layer")
    train_kv = teacher.kv_store(target, tokenizer, "train", layer)
    held_kv = teacher.kv_store(target, tokenizer, "test", layer)
    train, held = train_kv.store, held_kv.store
    cols = store_data(train, ("ids", "idx", "mask"))
    vocab_map = store_vocab(tokenizer, cols, recipe.vocab, target.config.vocab_size)
    to_sub = sub_index(vocab_map, target.config.vocab_size).to(device)
    draft = GlideDraft.from_target(target, vocab_map, recipe.init, recipe.layers, layer).to(device)
    embed = target.get_input_embeddings()
    bs, block = recipe.batch_size, recipe.block

    def step(rows: torch.Tensor) -> torch.Tensor:
        batch = read_rows(train, train_kv, rows, ("ids", "idx", "prob", "mask"), device)
        phase = int(torch.randint(block, ()))  # every alignment of the blocks, one per batch
        return glide_loss(draft, batch, embed, to_sub, block, phase)

    report = fit_and_measure(
        [draft], step, examples=len(train), judge=lambda: glide_judge(draft, held, held_kv, embed, device=device),
        held=len(held), answer_rows=answer_rows(held), epochs=part_epochs("glide", recipe, teacher), batch_size=bs,
        lr=recipe.lr, desc="glide: training the draft")
    labels = store_data(held, ("idx", "mask"))
    report.update(
        # Draft token i + 1 when the ones before it were right (the view of position i of a block); i = 0 is the first.
        agreement_by_offset=[agreement(glide_judge(draft, held, held_kv, embed, i, device), range(len(held)), bs)
                             ["all"][0] for i in range(block)],
        layers=recipe.layers,
        layer=layer,
        block=block,
        recipe=teacher.recipe.name,
        train_tokens=int(cols["mask"].sum()),
        heldout_tokens=int(labels["mask"].sum()),
        vocab=int(vocab_map.numel()),
        vocab_coverage=vocab_coverage(to_sub, labels),
    )
    return draft.cpu(), report


# --------------------------------------------------------------------------------------------- caching


def glide_artifact(target, tokenizer, recipe: GlideRecipe, teacher: Teacher) -> Artifact:
    """GliDe's draft of (target, recipe, tokenizer, the run's training recipe) as a cached artifact: ``glide.pt``."""
    key = {"recipe": part_key(recipe), "teacher": budget(teacher, part_epochs("glide", recipe, teacher)),
           **tokenizer_key(tokenizer)}
    return module_artifact("glide", target, key, lambda: train_glide(target, tokenizer, recipe, teacher),
                          lambda vocab_map, layers: GlideDraft(target.config, vocab_map, layers),
                          trained_by="glide",
                          description="GliDe draft")


def untrained_glide(target_config, recipe: GlideRecipe) -> GlideDraft:
    """The draft :func:`train_glide` would train, untrained: a synthetic pair's (:func:`training.kit.untrained_if_synthetic`)."""
    return GlideDraft(target_config, untrained_vocab(recipe.vocab, target_config.vocab_size), recipe.layers).eval()
