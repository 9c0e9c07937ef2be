"""EAGLE-3's draft (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"): one decoder layer over a fusion of the target's low, middle and high features, with a
head of its own over a reduced vocabulary, trained by unrolling its own drafting (training-time test).

At position t the draft reads g_t = fc([l_t; m_t; h_t]) (``fc``: 3H -> H, no bias), the target's hidden
states at t entering three of its decoder layers (:func:`feature_layers`), and the embedding e_{t+1} of the
token after t (the target's own embedding; not a part of the draft). Its one layer (``midlayer``, the authors'
``LlamaDecoderLayeremb``) attends over the concatenation [input_layernorm(e_{t+1}); hidden_norm(g_t)] (so its
q/k/v read 2H), adds the attention's output to g_t, then runs the usual post-attention norm and MLP:

    x_t = [RMS_in(e_{t+1}); RMS_hid(g_t)]                       (2H)
    a_t = o_proj(Attn(q_proj x_t, k_proj x_{<=t}, v_proj x_{<=t}))  (rotary on q and k, GQA as the target's)
    u_t = g_t + a_t;   o_t = u_t + MLP(RMS_post(u_t))             (H: the draft's output, its next input feature)
    p(x_{t+2}) = softmax(lm_head(norm(o_t)))                     (over the draft vocabulary)

Drafting deeper feeds o_t back in place of g (no ``fc``: the width says which one it is), as the authors'
``topK_genrate`` does. ``d2t`` (draft row -> offset to the target id) and ``t2d`` (a bool mask over the target's
vocabulary) are the authors' buffers; submodules and buffers carry the authors' state-dict names, so a published
EAGLE-3 checkpoint maps onto this module one to one (its ``embed_tokens`` aside: the target's is read).

A published draft may be narrower than its target (the authors' ``target_hidden_size``): the draft is H_d wide,
the target H_t, ``fc`` maps 3H_t -> H_d, and e_{t+1} is the draft's own token embedding ``embed_tokens (V, H_d)``
from its file, in place of the target's (H_t wide); everything above reads H as H_d.

Training (the paper's Sec. 3, the authors' ``traineagle3``): the target runs teacher-forced over the teacher
store's token ids to give the three layers' features (the store keeps only the last hidden states, whose
head rows give the target's distribution); then the draft is unrolled ``ttt_steps`` times over the whole row:
step 0 reads (g_t, e_{t+1}); step j reads its own step j-1 output at t and e_{t+1+j}, at rotary position t + j,
and attends to step 0's keys at positions <= t plus its own keys of steps 1..j at t alone (the tree attention a
node of depth j meets while drafting). Loss: sum_j 0.8^j CE(p_target(x_{t+2+j}), q_j) over the draft
vocabulary (the target's distribution renormalised over it; positions whose target top-1 lies outside it are
dropped), no feature regression, as the authors'.

Where this differs from the authors, and why (docs/methods/eagle3.md says it too): their feature layers for a
target of fewer than 7 decoder layers (other than 3) do not give three distinct ones, so such a target gets
0, n // 2 and n - 1; ``lm_head`` starts from the target's output rows of the draft vocabulary
(``recipe.init=target``; theirs is random and learns from ~10^7 tokens, here ~10^5); the draft layer is Llama's
whatever the target's family (as the authors' is), with the target's widths and rotary settings.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn
from torch.nn import functional as F
from tqdm.auto import tqdm
from transformers import LlamaConfig
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from core.artifacts import Artifact, model_fingerprint
from core.counting import CountedLM
from core.kv_cache import CACHE_ARG, lm_forward
from core.layer_taps import LayerTaps
from training.kit import (
    answer_rows,
    budget,
    feature_stores,
    fit_and_measure,
    part_artifact,
    part_epochs,
    part_key,
    store_data,
    store_vocab,
    trained_part,
    training_start,
    untrained_vocab,
)
from training.loop import TrainRecipe
from training.store import tokenizer_key
from training.teacher import Teacher


@trained_part("eagle3")
class Eagle3Recipe(TrainRecipe):
    """How EAGLE-3's draft is trained (cached under cache_dir/eagle3/, keyed by the target, this recipe, the
    tokenizer and the run's training recipe)."""

    EPOCHS = {"smoke": 1, "quick": 3, "full": 4}  # the authors: 40 over ShareGPT and UltraChat

    lr: float = Field(1.0e-3, gt=0, description="AdamW learning rate (one-cycle schedule; the head trains too)")
    vocab: int = Field(8192, ge=1, description="the draft's vocabulary: the most frequent stored tokens (the "
                       "authors: 32k of Llama 3's 128k)")
    ttt_steps: int = Field(4, ge=1, description="training-time test: drafting steps unrolled per position (the "
                           "authors: 7; 4 covers the CPU tree's depth)")
    step_decay: float = Field(0.8, gt=0, le=1, description="step j's loss weighs step_decay^j (the authors: 0.8)")
    init: Literal["target", "random"] = Field("target", description="lm_head starts from the target's output "
                                              "rows of the draft vocabulary, or random (the authors)")


# --------------------------------------------------------------------------------------------- the target's features


def feature_layers(n: int) -> tuple[int, int, int]:
    """The decoder layers whose *input* hidden states EAGLE-3 fuses, for a target of ``n`` layers: the authors'
    2, n // 2 and n - 3 (``modeling_llama_kv``: collected before those layers; 2, 16, 29 for 32 layers), low to
    high, i.e. transformers' ``hidden_states[i]`` for those i. Where those are not three distinct layers (n < 7,
    but for 3: 0, 1, 2), 0, n // 2 and n - 1: the bottom, middle and top."""
    picked = (2, n // 2, n - 3)
    if len(set(picked)) == 3 and min(picked) >= 0:
        return tuple(sorted(picked))
    return 0, n // 2, max(n - 1, 0)


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layers: tuple[int, ...], batch_size: int, desc: str) -> torch.Tensor:
    """The fused features ``(N, T, 3H)`` float16 on the CPU of the frozen ``target`` teacher-forced over ``ids (N,
    T)``, in batches; its decoder alone runs (not its output head). ``no_grad``, not ``inference_mode``: the
    draft's ``fc`` saves them for its backward."""
    device = next(target.parameters()).device
    body = getattr(target, "base_model", target)
    out = []
    with LayerTaps(target, layers) as taps:
        for start in tqdm(range(0, len(ids), batch_size), desc=desc, unit="batch"):
            lm_forward(body, ids[start : start + batch_size].to(device))
            out.append(taps.fused().half().cpu())
    return torch.cat(out)


# --------------------------------------------------------------------------------------------- the draft


def draft_config(target_config, draft_vocab: int, layer: dict | None = None) -> LlamaConfig:
    """The draft layer's config (the authors' ``config.json``: a one-layer Llama with ``draft_vocab_size``): the
    target's widths, heads and rotary settings, whatever its family (GPT-2, without rotary: Llama's default).
    ``layer``: LlamaConfig fields that replace those (a published draft's own, from its config: width, heads,
    ``head_dim``, MLP, norm epsilon and rotary settings, :func:`methods.eagle._published3.layer_fields`)."""
    c = target_config
    hidden, heads = c.hidden_size, c.num_attention_heads
    rope = getattr(c, "rope_parameters", None)
    if not (isinstance(rope, dict) and "rope_type" in rope):  # none, or one per kind of layer
        rope = {"rope_type": "default", "rope_theta": 10000.0}
    fields = dict(
        hidden_size=hidden,
        intermediate_size=getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or hidden // heads,
        rms_norm_eps=getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_epsilon", None) or 1e-6,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=dict(rope),
        hidden_act="silu",
        vocab_size=c.vocab_size,
        draft_vocab_size=draft_vocab,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**fields, **(layer or {})})


class Eagle3Attention(nn.Module):
    """The authors' attention: q/k/v read the 2H concatenation, o_proj writes H; rotary and grouped keys and
    values as ``config`` (:func:`draft_config`: the target's, or a published draft's own) sets them."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        wide = 2 * config.hidden_size
        self.q_proj = nn.Linear(wide, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(wide, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(wide, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)  # non-persistent buffers: not in the state dict

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """``x (B, n, 2H)`` at ``positions (B or 1, n)`` -> q ``(B, heads, n, d)``, k and v ``(B, kv_heads, n, d)``,
        q and k rotated."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def grouped(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, kv_heads, L, d)`` keys or values repeated for every query head: ``(B, heads, L, d)``."""
        return repeat_kv(t, self.heads // self.kv_heads)


class Eagle3Layer(nn.Module):
    """The authors' ``midlayer`` (``LlamaDecoderLayeremb``): attention over [input_layernorm(emb);
    hidden_norm(feature)], the residual on the feature, then the post-attention norm and the MLP."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)

    def inputs(self, emb: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """``(B, n, 2H)``: what q, k and v read (embedding first, as the authors')."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(feats)], dim=-1)

    def finish(self, feats: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output ``(B, n, H)`` from its input features and the attention's heads ``(B, heads, n, d)``."""
        b, _, n, _ = attn.shape
        out = feats + self.self_attn.o_proj(attn.transpose(1, 2).reshape(b, n, -1))
        return out + self.mlp(self.post_attention_layernorm(out))


class Eagle3Draft(nn.Module):
    """``fc`` (3H_t -> H), ``midlayer``, ``norm``, ``lm_head`` (H -> V') and the buffers ``d2t`` (``LongTensor (V',)``:
    draft row i is target id i + d2t[i]) and ``t2d`` (``BoolTensor (vocab,)``: the target ids it can propose).

    H is the draft's width, H_t the target's: the same unless ``layer`` (:func:`draft_config`'s, kept to rebuild
    the draft) gives another ``hidden_size``; then the draft also has ``embed_tokens`` (vocab -> H), its own token
    embedding (else ``None``: the target's is read)."""

    def __init__(self, target_config, vocab_map: torch.Tensor, layer: dict | None = None):
        super().__init__()
        vocab_map = vocab_map.long().cpu()
        self.layer = layer
        self.config = draft_config(target_config, vocab_map.numel(), layer)
        hidden = self.hidden = self.config.hidden_size
        self.target_hidden = target_config.hidden_size
        self.fc = nn.Linear(3 * self.target_hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(self.config)
        self.norm = LlamaRMSNorm(hidden, eps=self.config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, vocab_map.numel(), bias=False)
        # The target's embedding is H_t wide: a draft of another width was trained on an embedding of its own.
        self.embed_tokens = None
        if hidden != self.target_hidden:
            self.embed_tokens = nn.Embedding(target_config.vocab_size, hidden).requires_grad_(False)
        t2d = torch.zeros(target_config.vocab_size, dtype=torch.bool)
        t2d[vocab_map] = True
        self.register_buffer("d2t", vocab_map - torch.arange(vocab_map.numel()))
        self.register_buffer("t2d", t2d)

    @classmethod
    def from_target(cls, target, vocab_map: torch.Tensor, init: str = "target") -> Eagle3Draft:
        draft = cls(target.config, vocab_map)
        if init == "target":  # the target's head rows read a final hidden state, as lm_head reads norm(o_t)
            rows = target.get_output_embeddings().weight.data[vocab_map.to(target.device)]
            draft.lm_head.weight.data.copy_(rows.float().cpu())
        return draft

    @property
    def vocab_map(self) -> torch.Tensor:
        """``LongTensor (V',)``: the target id of each draft row (sorted)."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` outputs -> ``(..., V')`` logits over the draft vocabulary."""
        return self.lm_head(self.norm(out))

    def feature(self, feats: torch.Tensor) -> torch.Tensor:
        """The layer's input feature: ``fc`` over the target's fused ``(..., 3H_t)``, the draft's own ``(..., H)`` as
        is (told apart by their width, as the authors' ``forward`` does)."""
        if feats.shape[-1] == self.hidden:
            return feats
        if feats.shape[-1] != 3 * self.target_hidden:
            raise ValueError(f"features of width {feats.shape[-1]}: the draft reads 3 x {self.target_hidden} or "
                             f"{self.hidden}")
        return self.fc(feats)

    def fused(self, feats: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """What the layer reads per position, ``(..., 2H)``: ``emb (..., H)`` and the input feature (:meth:`feature` of
        ``feats``) side by side, the embedding first (the decoder's input; in a batch it is swapped in for its token
        embeddings)."""
        return torch.cat([emb, self.feature(feats)], dim=-1)

    # What core.compiled.CompiledLM reads of a causal LM, so that a batch runs the draft's forwards on a batch cache
    # (as EAGLE's draft layer, methods.eagle._draft.EagleDraft): the decoder (the layer), the head (norm, lm_head),
    # and token embeddings, which every real row of its forwards replaces by :meth:`fused`'s input. Neither the
    # decoder nor the embedding table is a submodule: the state dict stays the authors'.

    def get_decoder(self) -> Eagle3Decoder:
        if "_decoder" not in self.__dict__:
            self.__dict__["_decoder"] = Eagle3Decoder(self)
        return self.__dict__["_decoder"]

    def get_input_embeddings(self) -> nn.Embedding:
        """A one-row table of zeros, ``2H`` wide: what the padding rows of a batch forward read (a real row's input is
        swapped in)."""
        weight = self.fc.weight
        table = self.__dict__.get("_padding")
        if table is None or table.weight.device != weight.device or table.weight.dtype != weight.dtype:
            table = nn.Embedding(1, 2 * self.hidden, device=weight.device, dtype=weight.dtype).requires_grad_(False)
            nn.init.zeros_(table.weight)
            self.__dict__["_padding"] = table
        return table

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def logits_of(self, out: torch.Tensor) -> torch.Tensor:
        """The head on the decoder's outputs (core.compiled.logits_head): :meth:`logits`."""
        return self.logits(out)

    def forward(self, feats: torch.Tensor, emb: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
        """``feats (B, n, 3H_t or H)`` at n positions and ``emb (B, n, H)`` the embeddings of the tokens after them ->
        ``(B, n, H)`` the layer's outputs. ``cache``: a ``Cache`` of the earlier positions, extended in place
        (``None``: the whole sequence at once); ``kwargs``: a tree's ``attention_mask`` and ``position_ids``."""
        return lm_forward(self.get_decoder(), None, cache, inputs_embeds=self.fused(feats, emb), **kwargs).last_hidden_state


class Eagle3Decoder(nn.Module):
    """The draft's layer called as a transformers decoder: ``inputs_embeds (B, n, 2H)`` (:meth:`Eagle3Draft.fused`'s:
    the token embedding, then the input feature) -> ``last_hidden_state (B, n, H)``, the layer's outputs, on the cache
    handed as the installed release names it (a ``DynamicCache``, or a batch's ``RowCache``: written through its one
    layer's ``update``). ``attention_mask``: additive or boolean ``(B or 1, 1, n, past + n)`` (None: causal);
    ``position_ids (B or 1, n)`` (None: past .. past + n - 1)."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.__dict__["draft"] = draft  # not a submodule: the draft owns this, not the other way round

    def forward(self, input_ids=None, inputs_embeds: torch.Tensor | None = None, attention_mask=None, position_ids=None,
                use_cache: bool | None = None, **kwargs) -> BaseModelOutputWithPast:
        draft = self.draft
        cache = kwargs.pop(CACHE_ARG, None)
        if input_ids is not None or inputs_embeds is None or kwargs:
            raise ValueError("EAGLE-3's draft layer reads inputs_embeds (its fused inputs) and a cache only")
        emb, g = inputs_embeds.split(draft.hidden, dim=-1)
        layer, n = draft.midlayer, g.shape[1]
        if position_ids is None or (attention_mask is None and n > 1):
            past = cache.get_seq_length() if cache is not None else 0
            if position_ids is None:
                position_ids = torch.arange(past, past + n, device=g.device)[None]
            if attention_mask is None:  # causal over the cache and the new positions
                keys = torch.arange(past + n, device=g.device)
                attention_mask = keys[None] <= past + torch.arange(n, device=g.device)[:, None]
        q, k, v = layer.self_attn.project(layer.inputs(emb, g), position_ids)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        attn = F.scaled_dot_product_attention(q, layer.self_attn.grouped(k), layer.self_attn.grouped(v),
                                              attn_mask=attention_mask)
        return BaseModelOutputWithPast(last_hidden_state=layer.finish(g, attn))


class CountedEagle3(CountedLM):
    """The ``eagle3`` role: ``draft(feats (1, n, 3H_t or H), emb (1, n, H), cache, rows, **kw)`` returns the outputs
    ``(1, n, H)`` and the logits ``(1, rows, V')`` of the last ``rows`` positions, counted as such: the layer, norm and
    head by :mod:`core.flops`' formula, ``fc`` (3H_t x H) only on the calls that read the target's features. In a batch
    its forwards run as a causal LM's on its batch cache (:meth:`CountedLM.forward_rows`), each row's input
    :meth:`fused`'s in place of token embeddings."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__(draft, "eagle3")  # its head's weights: CountedLM reads them from get_output_embeddings
        self.formula = self.formula.without([draft.fc], 0)  # fc runs on the target's features only: added per call
        self.fc_weights = draft.fc.weight.numel()

    def fused(self, feats: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """:meth:`Eagle3Draft.fused`, ``fc``'s FLOPs counted where it runs (the forward reading the result is counted
        as the layer's)."""
        if feats.shape[-1] != self.module.hidden:
            self._count_outside(2.0 * self.fc_weights * feats.shape[-2])
        return self.module.fused(feats, emb)

    def __call__(self, feats, emb, cache, rows: int, **kwargs):
        n = feats.shape[1]
        self._count(1, n, cache.get_seq_length() + n, head_rows=rows)
        out = lm_forward(self.module.get_decoder(), None, cache, inputs_embeds=self.fused(feats, emb), **kwargs)
        out = out.last_hidden_state
        return out, self.module.logits(out[:, n - rows :])


# --------------------------------------------------------------------------------------------- training-time test


def shifted(ids: torch.Tensor, k: int) -> torch.Tensor:
    """``ids (B, T)`` moved ``k`` positions left, zeros after the end (positions no loss counts)."""
    return torch.cat([ids[:, k:], ids.new_zeros(ids.shape[0], min(k, ids.shape[1]))], dim=1)


def unroll(draft: Eagle3Draft, fused: torch.Tensor, ids: torch.Tensor, embed, steps: int) -> list[torch.Tensor]:
    """The draft's outputs ``[(B, T, H)] * steps`` unrolled over whole rows (the training-time test): step j at
    position t reads ``ids[t + 1 + j]``'s embedding and, for j = 0, the target's ``fused (B, T, 3H)`` at t, else its
    own step j - 1 output at t; rotary position t + j; it attends to step 0's keys at positions <= t and to its
    own keys of steps 1..j at t (the authors' diagonal cache)."""
    layer = draft.midlayer
    attn_mod = layer.self_attn
    b, t_len, _ = fused.shape
    pos = torch.arange(t_len, device=fused.device)
    causal = torch.zeros(t_len, t_len, device=fused.device)
    causal.masked_fill_(pos[None] > pos[:, None], torch.finfo(causal.dtype).min)
    scale = attn_mod.head_dim ** -0.5
    g = draft.feature(fused)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs = []
    for j in range(steps):
        with torch.no_grad():  # the target's embedding is frozen: no vocabulary-sized gradient
            emb = embed(shifted(ids, 1 + j))
        q, k, v = attn_mod.project(layer.inputs(emb, g), (pos + j)[None])
        keys.append(attn_mod.grouped(k))
        values.append(attn_mod.grouped(v))
        scores = [q @ keys[0].transpose(2, 3) * scale + causal]  # (B, heads, T, T)
        scores += [((q * key).sum(-1) * scale)[..., None] for key in keys[1:]]  # (B, heads, T, 1) each
        probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        attn = probs[..., :t_len] @ values[0]
        for i, value in enumerate(values[1:]):
            attn = attn + probs[..., t_len + i, None] * value
        g = layer.finish(g, attn)
        outs.append(g)
    return outs


def eagle3_loss(draft: Eagle3Draft, batch: dict, embed, head_rows: torch.Tensor, recipe: Eagle3Recipe) -> torch.Tensor:
    """The training-time-test loss over a batch (``ids``, ``idx`` top-1, ``mask`` ``(B, T)``; ``hidden (B, T, H)``
    the target's last hidden states; ``fused (B, T, 3H)``): sum_j decay^j * CE(p_target, q_j) at every position t
    whose label at t + 1 + j is text and in the draft vocabulary, over the positions step 0 trains on (the authors
    average over every position, at each step alike)."""
    ids, mask = batch["ids"], batch["mask"]
    with torch.no_grad():  # the target's distribution over the draft vocabulary (its logits there, renormalised)
        p = torch.softmax(batch["hidden"].float() @ head_rows.T, -1)
        labelled = mask & draft.t2d[batch["idx"][..., 0]]  # position s's next token is text the draft can propose
    outs = unroll(draft, batch["fused"].float(), ids, embed, recipe.ttt_steps)
    positions = (mask[:, :-1] & mask[:, 1:]).sum().clamp_min(1)
    loss = torch.zeros((), device=ids.device)
    for j, out in enumerate(outs):
        n = ids.shape[1] - 1 - j  # positions t whose label, at t + 1 + j, is inside the row
        if n <= 0:
            break
        logq = torch.log_softmax(draft.logits(out[:, :n]).float(), -1)
        ce = -(p[:, 1 + j :] * logq).sum(-1)
        keep = (labelled[:, 1 + j :] & mask[:, :n]).float()
        loss = loss + recipe.step_decay**j * (ce * keep).sum() / positions
    return loss


def eagle3_judge(draft: Eagle3Draft, store, fused: torch.Tensor, embed, steps: int, device=None):
    """:func:`training.kit.agreement`'s judge, one output per unrolled step j: is the draft's greedy token after j
    steps of its own (true tokens in) the target's greedy token at t + 1 + j (the acceptance of a depth-(j + 1)
    draft token along the target's path)?"""

    def judge(rows: torch.Tensor) -> list[tuple]:
        b = {n: t.to(device) for n, t in store.rows(rows, ("ids", "idx", "mask", "answer")).items()}
        outs = unroll(draft, fused[rows].to(device).float(), b["ids"], embed, steps)
        out = []
        for j, o in enumerate(outs):
            n = b["ids"].shape[1] - 1 - j
            hit = draft.vocab_map[draft.logits(o[:, :n]).argmax(-1)] == b["idx"][:, 1 + j :, 0]
            counted = b["mask"][:, :n] & b["mask"][:, 1 + j :]
            out.append((hit, counted, counted & b["answer"][:, 1 + j :]))
        return out

    return judge


def train_eagle3(target, tokenizer, recipe: Eagle3Recipe, teacher: Teacher) -> tuple[Eagle3Draft, dict]:
    """Train EAGLE-3's draft from the teacher store (the target teacher-forced again over its ids for the three
    layers' features); returns it (on the CPU, fp32) and a report (held-out agreement per unrolled step, before
    and after)."""
    target, device = training_start(target, recipe.seed)
    train, held = feature_stores(target, tokenizer, teacher, "EAGLE-3 reads")
    cols = store_data(train, ("ids", "idx", "mask"))
    vocab_map = store_vocab(tokenizer, cols, recipe.vocab, target.config.vocab_size)
    layers = feature_layers(target.config.num_hidden_layers)
    batch = teacher.recipe.store.batch_size
    fused = target_features(target, cols["ids"], layers, batch, "eagle3: the target's features (train)")
    held_fused = target_features(target, store_data(held, ("ids",))["ids"], layers, batch,
                                 "eagle3: the target's features (held out)")
    draft = Eagle3Draft.from_target(target, vocab_map, recipe.init).to(device)
    embed = target.get_input_embeddings()
    head_rows = target.get_output_embeddings().weight.detach()[vocab_map.to(device)]

    def step(rows: torch.Tensor) -> torch.Tensor:
        b = {n: t.to(device) for n, t in train.rows(rows, ("ids", "idx", "mask", "hidden")).items()}
        b["fused"] = fused[rows].to(device)
        return eagle3_loss(draft, b, embed, head_rows, recipe)

    report = fit_and_measure(
        [draft], step, examples=len(train), held=len(held),
        judge=lambda: eagle3_judge(draft, held, held_fused, embed, recipe.ttt_steps, device),
        answer_rows=answer_rows(held),
        epochs=part_epochs("eagle3", recipe, teacher), batch_size=recipe.batch_size, lr=recipe.lr,
        desc=f"eagle3: training the draft ({recipe.ttt_steps} steps unrolled)")
    report.update(feature_layers=list(layers), recipe=teacher.recipe.name, train_tokens=int(cols["mask"].sum()),
                  vocab=int(vocab_map.numel()), ttt_steps=recipe.ttt_steps)
    return draft.cpu(), report


# --------------------------------------------------------------------------------------------- caching


def eagle3_artifact(target, tokenizer, recipe: Eagle3Recipe, teacher: Teacher) -> Artifact:
    """EAGLE-3's draft of (target, recipe, tokenizer, the run's training recipe) as a cached artifact: ``eagle3.pt``
    holding the target's hidden size and the draft's state dict (the authors' names)."""
    ident = model_fingerprint(target)
    key = {"target": ident, "recipe": part_key(recipe),
           "teacher": budget(teacher, part_epochs("eagle3", recipe, teacher)), **tokenizer_key(tokenizer)}

    def save(draft: Eagle3Draft) -> dict:
        return {"hidden": target.config.hidden_size, "state": draft.state_dict()}

    def load(blob: dict) -> Eagle3Draft:
        if blob["hidden"] != target.config.hidden_size:
            raise ValueError(f"its hidden size is {blob['hidden']}, the target's {target.config.hidden_size}")
        d2t = blob["state"]["d2t"]
        draft = Eagle3Draft(target.config, d2t + torch.arange(d2t.numel()))
        draft.load_state_dict(blob["state"])
        return draft.eval()

    return part_artifact("eagle3", f"eagle3-{ident['name']}", key,
                         lambda: train_eagle3(target, tokenizer, recipe, teacher), save, load, "eagle3.pt",
                         trained_by="eagle3", description="EAGLE-3 draft")


def untrained_eagle3(target_config, recipe: Eagle3Recipe) -> Eagle3Draft:
    """The draft :func:`train_eagle3` would train, untrained: a synthetic pair's (:func:`training.kit.untrained_if_synthetic`)."""
    return Eagle3Draft(target_config, untrained_vocab(recipe.vocab, target_config.vocab_size)).eval()
