"""Draft heads on the target's last hidden state: Medusa (Cai et al. 2024) and Hydra (Ankner et al. 2024).

Head k (k = 0 .. K-1) reads the target's last (normed) hidden state h_t at position t and proposes the
token k + 1 steps after the target's own next token, i.e. x_{t+k+2}:

- Medusa: ``proj_k(h + SiLU(W_k h))``, the heads independent of each other.
- Hydra: ``proj_k(h + SiLU(W_k [h; e(x_{t+1}); ...; e(x_{t+k+1})]))``: head k also reads the target's input
  embeddings of the k + 1 tokens already chosen along the candidate path (sequentially dependent heads).

Every ``W_k`` starts at zero and every ``proj_k`` from the target's output head (rows of a reduced
vocabulary, as in :mod:`training.distill`), so an untrained head already proposes the target's own next-token
guess. Candidates outside the reduced vocabulary are never proposed; the target verifies every candidate,
so decoding stays lossless.

Hydra++'s prefix attention layer (Ankner et al. 2024, Sec. 5; ``recipe.prefix_layer: true``, the default of
``hydra_pp`` only): one more decoder layer of the target's own architecture (:class:`PrefixLayer`) reads the
target's last hidden states of the whole sequence, and its output at position t replaces h_t as the heads'
input. It keeps a KV cache of its own while decoding and is trained jointly with the heads.

Training is self-distillation from the teacher store (:mod:`training.teacher`: packaged text and the target's
own answers, teacher-forced once per target): the heads read the stored hidden states, and the label of head
k at position t is the target's own next-token distribution at position t + k + 1 -- its greedy token
(``loss: top1``) or its whole distribution over the heads' vocabulary, recomputed from the stored hidden
state by the target's output rows (``loss: teacher``, Hydra++'s teacher distillation). Hydra++'s heads are
also deeper (``recipe.layers``: 4 residual blocks per head, after the paper's Sec. 5).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from core.counting import CountedLM, CountedModule
from core.kv_cache import lm_forward
from core.model_parts import body_config, copy_last_layers
from training.adversarial import AdversaryRecipe
from training.kit import trained_part
from training.loop import TrainRecipe

log = logging.getLogger(__name__)

KINDS = ("medusa", "hydra", "amphista")


@trained_part("heads")
class HeadsRecipe(TrainRecipe):
    """How Medusa / Hydra heads are trained (cached under cache_dir/heads/, keyed by the target, this recipe and
    the run's training recipe: how many teacher tokens, how many epochs)."""

    EPOCHS = {"smoke": 1, "quick": 2, "full": 1}

    num_heads: int = Field(4, ge=1, description="head k proposes the token k + 1 steps after the target's next one")
    layers: int = Field(1, ge=1, description="residual MLP blocks per head (Medusa and Hydra: 1; Hydra++: 4; KOALA: K)")
    vocab: int = Field(8192, ge=1, description="heads propose from the most frequent tokens only (verification "
                       "stays lossless)")
    loss: Literal["top1", "teacher"] = Field("top1", description="top1: the target's greedy token; teacher: the "
                                             "target's whole distribution (over the heads' vocabulary, from its "
                                             "stored hidden states: Hydra++'s teacher distillation)")
    decay: float = Field(0.8, gt=0, le=1, description="head k's loss weight is decay**k (later heads are harder "
                         "and matter less)")
    prefix_layer: bool = Field(False, description="Hydra++'s prefix attention layer feeds the heads "
                               "(hydra_pp's default)")
    adversarial: AdversaryRecipe | None = Field(None, description="KOALA's adversarial learning beside the "
                                                "supervised loss (koala's default; null: none)")


class ResBlock(nn.Module):
    """``x + SiLU(W x')`` where ``x'`` is ``x`` or ``x`` with extra features concatenated; ``W`` starts at 0.

    ``res_proj``: the residual is a learned projection of ``x'`` instead of ``x``, ``R x' + SiLU(W x')`` (the
    first block of a published Hydra head, whose input is wider than its output; read, never trained here).
    """

    def __init__(self, hidden: int, in_features: int | None = None, res_proj: bool = False):
        super().__init__()
        self.linear = nn.Linear(in_features or hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.res_connection = nn.Linear(in_features or hidden, hidden) if res_proj else None

    def forward(self, x: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        x_in = x if features is None else features
        residual = x if self.res_connection is None else self.res_connection(x_in)
        return residual + nn.functional.silu(self.linear(x_in))


class Heads(nn.Module):
    """K draft heads over a reduced vocabulary ``vocab_map`` (``LongTensor (V',)`` of full-vocabulary ids), each
    ``layers`` residual blocks deep (the first reads the head's input features) and a projection."""

    def __init__(self, kind: str, hidden: int, num_heads: int, vocab_map: torch.Tensor, layers: int = 1,
                 published: bool = False):
        super().__init__()
        self.kind = kind
        self.num_heads = num_heads
        self.layers = layers
        # Hydra's published heads (``published``, kind hydra) differ from those trained here in two places: the
        # first block's residual is a learned projection of its wide input, and each output layer has a bias.
        res_proj = published and kind == "hydra"
        # Hydra head k reads h and the k + 1 path embeddings: (k + 2) * hidden input features.
        width = [(k + 2) * hidden if kind == "hydra" else hidden for k in range(num_heads)]
        self.blocks = nn.ModuleList(ResBlock(hidden, w, res_proj) for w in width)
        # Hydra++'s deeper heads: more blocks of x + SiLU(W x) after the first (each starts as the identity).
        self.deeper = nn.ModuleList(nn.Sequential(*(ResBlock(hidden) for _ in range(layers - 1))) for _ in width)
        self.proj = nn.ModuleList(nn.Linear(hidden, vocab_map.numel(), bias=res_proj) for _ in range(num_heads))
        self.register_buffer("vocab_map", vocab_map.long(), persistent=True)

    def head(self, k: int, hidden: torch.Tensor, path_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Head k's logits over the reduced vocabulary.

        Args:
            hidden: ``(..., hidden)`` target hidden states.
            path_emb: Hydra only: ``(..., k + 1, hidden)`` input embeddings of the tokens after ``hidden``'s
                position along the candidate path (the target's next token first).
        Returns:
            ``(..., V')``.
        """
        if self.kind != "hydra":
            return self.proj[k](self.deeper[k](self.blocks[k](hidden)))
        features = torch.cat([hidden, path_emb.flatten(-2)], dim=-1)
        return self.proj[k](self.deeper[k](self.blocks[k](hidden, features)))

    def forward(self, hidden: torch.Tensor, path_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Medusa: all heads, ``(..., hidden)`` -> ``(..., K, V')``. Hydra: the head that ``path_emb``'s length
        ``k + 1`` selects, ``(..., hidden), (..., k + 1, hidden)`` -> ``(..., V')``."""
        if self.kind != "hydra":
            return torch.stack([self.head(k, hidden) for k in range(self.num_heads)], dim=-2)
        return self.head(path_emb.shape[-2] - 1, hidden, path_emb)

    def teacher_forced(self, hidden: torch.Tensor, chunks: torch.Tensor, embed) -> list[torch.Tensor]:
        """Per head k, its logits at every position t that has a label (t + k + 1 < T), ``(B, T - k - 1, V')``,
        from the target's hidden states ``(B, T, H)`` over the text ``chunks (B, T)`` (training, held-out
        agreement)."""
        T = hidden.shape[1]
        if self.kind != "hydra":
            return [self.head(k, hidden[:, : T - k - 1]) for k in range(self.num_heads)]
        out = []
        for k in range(self.num_heads):
            # Teacher forcing: the path tokens after position t are the text's own x_{t+1} .. x_{t+k+1}.
            with torch.no_grad():  # the target's embedding is frozen: no gradient for it (a vocabulary-sized one)
                emb = torch.stack([embed(chunks[:, 1 + j : T - k + j]) for j in range(k + 1)], dim=-2)
            out.append(self.head(k, hidden[:, : T - k - 1], emb))
        return out

    def init_from(self, target) -> None:
        """Start from the target: every projection is its output rows over ``vocab_map``."""
        rows = target.get_output_embeddings().weight.data[self.vocab_map.to(target.device)]
        for proj in self.proj:
            proj.weight.data.copy_(rows)

    def head_weights(self, k: int) -> int:
        """Matmul weights of head k alone (for FLOPs)."""
        deeper = sum(b.linear.weight.numel() for b in self.deeper[k])
        first = self.blocks[k]
        res = first.res_connection.weight.numel() if first.res_connection is not None else 0
        return first.linear.weight.numel() + res + deeper + self.proj[k].weight.numel()


class CountedHeads(CountedModule):
    """The ``heads`` role. A Medusa call runs every head; a Hydra call runs one head, so it is counted as
    that head's weights only (2 FLOPs per weight per row, as in :mod:`core.flops`)."""

    def count(self, hidden: torch.Tensor, path_emb: torch.Tensor | None = None) -> None:
        if self.module.kind == "medusa":
            return super().count(hidden)
        rows = hidden.shape[:-1].numel()
        self._count(1, rows, 0, flops=2.0 * self.module.head_weights(path_emb.shape[-2] - 1) * rows)


class BodyAsDecoder:
    """What ``core.compiled.CompiledLM`` reads of a causal LM, for a layer fed vectors over a one-layer ``body``
    (Hydra++'s prefix layer, Amphista's adaptation stages), so that a batch runs its forwards on a batch cache (as
    EAGLE's draft layer): the decoder (``body``), its one-row token table (every real row's input is swapped in for it)
    and, as its "head", nothing: the logits a forward returns are ``body``'s output itself, which the layer then
    combines with its input."""

    def get_decoder(self) -> nn.Module:
        return self.body

    def get_input_embeddings(self) -> nn.Embedding:
        return self.body.get_input_embeddings()

    def get_output_embeddings(self) -> None:
        return None

    def logits_of(self, out: torch.Tensor) -> torch.Tensor:
        """``body``'s output as it is (core.compiled.logits_head: what a batch forward returns as its logits)."""
        return out


class PrefixLayer(BodyAsDecoder, nn.Module):
    """Hydra++'s prefix attention layer: ``hidden + gamma * L(hidden)``.

    ``L`` is a one-layer decoder of the target's own class (attention over the sequence so far + MLP, the
    target's final norm), fed the target's last hidden states as input embeddings; ``gamma (hidden,)`` starts
    at zero, so an untrained layer passes the target's hidden state through and the heads start exactly where
    Hydra's do. :meth:`from_target` initialises ``L`` from the target's last layer and final norm.

    ``residual=False``: ``L(hidden)`` alone, as the authors' layer is (their published Hydra++ weights; the
    residual with ``gamma`` is this harness's start for training from a small teacher budget).
    """

    def __init__(self, target_config, residual: bool = True):
        super().__init__()
        from transformers import AutoModel

        self.config = body_config(target_config)
        self.body = AutoModel.from_config(self.config).float()
        self.gamma = nn.Parameter(torch.zeros(self.config.hidden_size)) if residual else None

    @classmethod
    def from_target(cls, target) -> PrefixLayer:
        layer = cls(target.config)
        copy_last_layers(layer.body, target)
        return layer

    def forward(self, hidden: torch.Tensor, cache=None) -> torch.Tensor:
        """``(B, n, hidden) -> (B, n, hidden)``, causal, at positions ``len(cache) .. len(cache) + n - 1``.

        ``cache``: a transformers ``Cache`` holding the layer's keys and values of the earlier positions,
        extended in place (``None`` when the whole sequence is given at once, as in training).
        """
        return self.combine(hidden, lm_forward(self.body, None, cache, inputs_embeds=hidden).last_hidden_state)

    def combine(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input ``hidden`` and ``L``'s output ``out`` (both ``(..., hidden)``)."""
        return out if self.gamma is None else hidden + self.gamma * out


class CountedPrefix(CountedLM):
    """The ``prefix`` role: ``layer(hidden (B, n, hidden), cache)``, one decoder layer whose n query positions
    attend to the cache and to themselves (FLOPs by :mod:`core.flops`, as for any model). In a batch its forwards
    run as a causal LM's on its batch cache (:meth:`CountedLM.forward_rows`), the hidden states swapped in for token
    embeddings and ``L``'s output returned as the logits (:class:`PrefixLayer`)."""

    def __init__(self, layer: PrefixLayer, role: str = "prefix"):
        super().__init__(layer, role)

    def __call__(self, hidden: torch.Tensor, cache) -> torch.Tensor:
        batch, new = hidden.shape[:2]
        self._count(batch, new, cache.get_seq_length() + new)
        return self.module(hidden, cache)


