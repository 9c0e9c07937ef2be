"""Amphista's drafting heads (Li et al. 2025, "Amphista: Bi-directional Multi-head Decoding for Accelerating LLM
Inference"): Medusa's non-autoregressive heads, fed through two new blocks.

- **Staged Adaptation Layers** (``stages``, the paper: two): stage s is one causal decoder layer of the
  target's own class over the sequence, reading ``fc_s([f^{s-1}_t; e(x_{t+1})])`` -- the previous stage's
  feature (the target's last hidden state for s = 1) fused with the input embedding of the token the target
  chose after t (what the paper calls the sampled token) -- and ``f^s_t = f^{s-1}_t + gamma_s * L_s(...)``.
  They carry the target's autoregressive features over to the heads' non-autoregressive prediction;
  while decoding, each keeps a KV cache of its own over the committed positions (like Hydra++'s prefix layer).
  Head k reads stage ``ceil((k + 1) * S / K)``: the later heads, which guess further ahead, the more adapted
  features (the paper's two stages serve the first and the second half of the heads).
- **Auto-embedding Block**: one bidirectional Transformer encoder layer over the K heads' positions (each
  head's stage feature plus a learned position embedding of the head), so that every head sees what the
  others are about to propose before its own residual block and projection (Medusa's head).

Every new part starts as the identity (``fc_s = [I | 0]``, ``gamma_s = 0``, the encoder's output projections
and position embeddings at zero) and the heads as Medusa's (projections from the target's output rows), so
untrained Amphista heads propose what untrained Medusa heads do; the decoder layers start as a copy of the
target's last one. Trained like Medusa's heads (:func:`methods.heads._heads.train_heads`, from the teacher store).

Only the abstract and secondary summaries of the paper could be read offline, and no code of the authors is
public: the fusion by concatenation, the residual gates, the stage each head reads and the encoder layer's
size (the target's attention heads and MLP width) are this harness's choices (README, Amphista).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from core.counting import CountedLM, CountedModule
from core.flops import FlopFormula
from core.kv_cache import lm_forward
from core.model_parts import body_config, copy_last_layers
from methods.heads._heads import BodyAsDecoder, Heads


class AdaptStage(BodyAsDecoder, nn.Module):
    """One staged adaptation layer: ``f + gamma * L(fc([f; e]))``, ``L`` (``body``) a one-layer decoder of the
    target's class (its final norm included) over the sequence, ``fc`` (2H -> H) starting as ``[I | 0]``, ``gamma
    (H,)`` at zero. A batch runs ``L`` as a causal LM (:class:`BodyAsDecoder`), ``fc``'s output swapped in."""

    def __init__(self, target_config):
        super().__init__()
        from transformers import AutoModel

        hidden = target_config.hidden_size
        self.config = body_config(target_config)
        self.fc = nn.Linear(2 * hidden, hidden)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            self.fc.bias.zero_()
        self.body = AutoModel.from_config(self.config).float()
        self.gamma = nn.Parameter(torch.zeros(hidden))

    def forward(self, feats: torch.Tensor, emb: torch.Tensor, cache=None) -> torch.Tensor:
        """``feats (B, n, H)``, ``emb (B, n, H)`` (the embeddings of the tokens after those positions) ->
        ``(B, n, H)``, causal, at positions ``len(cache) ..``; ``cache`` is extended in place (``None``: the
        whole sequence at once, as in training)."""
        out = lm_forward(self.body, None, cache, inputs_embeds=self.fused(feats, emb))
        return self.combine(feats, out.last_hidden_state)

    def fused(self, feats: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """``fc([f; e])``: what ``L`` reads, ``(..., H)``."""
        return self.fc(torch.cat([feats, emb], dim=-1))

    def combine(self, feats: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The stage's output from its input ``feats`` and ``L``'s output ``out`` (both ``(..., H)``)."""
        return feats + self.gamma * out


class AutoEmbedding(nn.Module):
    """Bidirectional self-attention among the K heads: ``(..., K, H) -> (..., K, H)``, one pre-norm
    ``nn.TransformerEncoderLayer`` over ``x + position``; its output projections start at zero, so it starts as
    the identity."""

    def __init__(self, target_config, num_heads: int):
        super().__init__()
        hidden = target_config.hidden_size
        self.position = nn.Parameter(torch.zeros(num_heads, hidden))
        # The target's MLP width (GPT-2's configs call it n_inner, None meaning 4 * hidden).
        width = getattr(target_config, "intermediate_size", None) or getattr(target_config, "n_inner", None) or 4 * hidden
        self.layer = nn.TransformerEncoderLayer(hidden, target_config.num_attention_heads, width, dropout=0.0,
                                                activation="gelu", batch_first=True, norm_first=True)
        for linear in (self.layer.self_attn.out_proj, self.layer.linear2):
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K, H = x.shape[-2:]
        return self.layer((x + self.position).reshape(-1, K, H)).reshape(x.shape)


class AmphistaHeads(Heads):
    """Staged adaptation layers (``stages``), the auto-embedding block (``auto``) and K Medusa heads (residual
    blocks and projections over the reduced vocabulary ``vocab_map``)."""

    def __init__(self, target_config, num_heads: int, vocab_map: torch.Tensor, layers: int = 1, stages: int = 2):
        super().__init__("amphista", target_config.hidden_size, num_heads, vocab_map, layers)
        self.stages = nn.ModuleList(AdaptStage(target_config) for _ in range(stages))
        self.auto = AutoEmbedding(target_config, num_heads)
        # Head k reads stage ceil((k + 1) S / K): with S = 2, K = 4 heads 0, 1 read stage 1 and heads 2, 3 stage 2.
        self.register_buffer("stage_of", torch.tensor([math.ceil((k + 1) * stages / num_heads) - 1
                                                       for k in range(num_heads)]), persistent=False)

    def init_from(self, target) -> None:
        super().init_from(target)
        for stage in self.stages:
            copy_last_layers(stage.body, target)

    def adapt(self, hidden: torch.Tensor, emb: torch.Tensor, caches=None) -> torch.Tensor:
        """The staged adaptation layers: ``hidden (B, n, H)``, ``emb (B, n, H)`` -> every stage's output
        ``(B, n, S, H)``. ``caches``: one KV cache per stage (``None``: the whole sequence at once)."""
        outs, f = [], hidden
        for s, stage in enumerate(self.stages):
            f = stage(f, emb, caches[s] if caches is not None else None)
            outs.append(f)
        return torch.stack(outs, dim=-2)

    def forward(self, staged: torch.Tensor) -> torch.Tensor:
        """Every head from the stages' outputs: ``(..., S, H) -> (..., K, V')``."""
        x = self.auto(staged[..., self.stage_of, :])  # (..., K, H): each head's stage, then attention among heads
        return torch.stack([self.head(k, x[..., k, :]) for k in range(self.num_heads)], dim=-2)

    def teacher_forced(self, hidden: torch.Tensor, chunks: torch.Tensor, embed) -> list[torch.Tensor]:
        """As :meth:`Heads.teacher_forced`: the token after position t is the text's own x_{t+1} (the last
        position has none and no label: it reads a zero embedding)."""
        T = hidden.shape[1]
        with torch.no_grad():  # the target's embedding is frozen
            emb = embed(chunks[:, 1:]).to(hidden.dtype)
            emb = torch.cat([emb, emb.new_zeros(emb.shape[0], 1, emb.shape[-1])], dim=1)
        logits = self(self.adapt(hidden, emb))  # (B, T, K, V')
        return [logits[:, : T - k - 1, k] for k in range(self.num_heads)]


class CountedStage(CountedLM):
    """An ``adapt<s>`` role, adaptation stage s (from 1) over n newly committed positions: ``stage(feats (B, n, H), emb
    (B, n, H), cache) -> (B, n, H)``, its decoder layer counted by :mod:`core.flops`' formula, ``fc`` (2H -> H) where it
    runs (:meth:`fused`). In a batch its forwards run as a causal LM's on its batch cache (:meth:`CountedLM.forward_rows`),
    ``fc``'s output swapped in for token embeddings and ``L``'s output returned as the logits (:class:`AdaptStage`)."""

    def __init__(self, stage: AdaptStage, role: str):
        super().__init__(stage, role)
        self.formula = self.formula.without([stage.fc], 0)  # fc runs before the forward: counted by fused()
        self.fc_weights = stage.fc.weight.numel()

    def fused(self, feats: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """:meth:`AdaptStage.fused`, its FLOPs counted (the forward reading its output is counted as the layer's)."""
        self._count_outside(2.0 * self.fc_weights * feats.shape[:-1].numel())
        return self.module.fused(feats, emb)

    def __call__(self, feats: torch.Tensor, emb: torch.Tensor, cache) -> torch.Tensor:
        batch, new = feats.shape[:2]
        x = self.fused(feats, emb)
        self._count(batch, new, cache.get_seq_length() + new)
        return self.module.combine(feats, lm_forward(self.module.body, None, cache, inputs_embeds=x).last_hidden_state)


class CountedAmphistaHeads(CountedModule):
    """The ``heads`` role: the auto-embedding block and the K heads at one position, ``heads(staged (..., S,
    H)) -> (..., K, V')``; a call scores the K head positions (the adaptation layers count as ``adapt<s>``). Positions
    are independent (the block attends across the heads of one position), so a batch's rows stack."""

    def __init__(self, heads: AmphistaHeads, role: str = "heads"):
        super().__init__(heads, role)
        K = heads.num_heads
        # Per position: the encoder layer over K rows attending to K keys, then each head on its own row.
        self.per_position = (FlopFormula(heads.auto, body_config(heads.stages[0].config))(K, K)
                             + 2.0 * sum(heads.head_weights(k) for k in range(K)))

    def count(self, staged: torch.Tensor) -> None:
        positions = staged.shape[:-2].numel()
        self._count(1, positions, 0, flops=positions * self.per_position)
