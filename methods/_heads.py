"""Draft heads on the target's last hidden state: Medusa (Cai et al. 2024) and Hydra (Ankner et al. 2024).

Head k (k = 0 .. K-1) reads the target's last (normed) hidden state h_t at position t and proposes the
token k + 1 steps after the target's own next token, i.e. x_{t+k+2}:

- Medusa: ``proj_k(h + SiLU(W_k h))``, the heads independent of each other.
- Hydra: ``proj_k(h + SiLU(W_k [h; e(x_{t+1}); ...; e(x_{t+k+1})]))``: head k also reads the target's input
  embeddings of the k + 1 tokens already chosen along the candidate path (sequentially dependent heads).

Every ``W_k`` starts at zero and every ``proj_k`` from the target's output head (rows of a reduced
vocabulary, as in :mod:`decoding.distill`), so an untrained head already proposes the target's own next-token
guess. Candidates outside the reduced vocabulary are never proposed; the target verifies every candidate,
so decoding stays lossless.

Hydra++'s prefix attention layer (Ankner et al. 2024, Sec. 5; ``recipe.prefix_layer: true``, the default of
``hydra_pp`` only): one more decoder layer of the target's own architecture (:class:`PrefixLayer`) reads the
target's last hidden states of the whole sequence, and its output at position t replaces h_t as the heads'
input. It keeps a KV cache of its own while decoding and is trained jointly with the heads.

Training is self-distillation from the teacher store (:mod:`decoding.teacher`: packaged text and the target's
own answers, teacher-forced once per target): the heads read the stored hidden states, and the label of head
k at position t is the target's own next-token distribution at position t + k + 1 -- its greedy token
(``loss: top1``) or its whole distribution over the heads' vocabulary, recomputed from the stored hidden
state by the target's output rows (``loss: teacher``, Hydra++'s teacher distillation). Hydra++'s heads are
also deeper (``recipe.layers``: 4 residual blocks per head, after the paper's Sec. 5).
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Literal

import torch
from omegaconf import DictConfig
from pydantic import Field
from torch import nn

from bench.adapter import copy_from, decoder_layers
from bench.artifacts import (
    Artifact,
    load_or_build,
    model_fingerprint,
    recipe_key,
    report_of,
)
from bench.counting import Counted, CountedModule
from bench.errors import BenchError
from decoding.distill import store_data, store_vocab, sub_index
from decoding.teacher import Teacher
from decoding.training import TrainRecipe, fit
from methods._adversarial import Adversary, AdversaryRecipe

log = logging.getLogger(__name__)

KINDS = ("medusa", "hydra", "amphista")


class HeadsRecipe(TrainRecipe):
    """How Medusa / Hydra heads are trained (cached under cache_dir/heads/, keyed by the target, this recipe and
    the run's training recipe: how many teacher tokens, how many epochs)."""

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
    """``x + SiLU(W x')`` where ``x'`` is ``x`` or ``x`` with extra features concatenated; ``W`` starts at 0."""

    def __init__(self, hidden: int, in_features: int | None = None):
        super().__init__()
        self.linear = nn.Linear(in_features or hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x if features is None else features))


class Heads(nn.Module):
    """K draft heads over a reduced vocabulary ``vocab_map`` (``LongTensor (V',)`` of full-vocabulary ids), each
    ``layers`` residual blocks deep (the first reads the head's input features) and a projection."""

    def __init__(self, kind: str, hidden: int, num_heads: int, vocab_map: torch.Tensor, layers: int = 1):
        super().__init__()
        self.kind = kind
        self.num_heads = num_heads
        self.layers = layers
        # Hydra head k reads h and the k + 1 path embeddings: (k + 2) * hidden input features.
        width = [(k + 2) * hidden if kind == "hydra" else hidden for k in range(num_heads)]
        self.blocks = nn.ModuleList(ResBlock(hidden, w) for w in width)
        # Hydra++'s deeper heads: more blocks of x + SiLU(W x) after the first (each starts as the identity).
        self.deeper = nn.ModuleList(nn.Sequential(*(ResBlock(hidden) for _ in range(layers - 1))) for _ in width)
        self.proj = nn.ModuleList(nn.Linear(hidden, vocab_map.numel(), bias=False) for _ in range(num_heads))
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
        return self.blocks[k].linear.weight.numel() + deeper + self.proj[k].weight.numel()


def new_heads(kind: str, target_config, num_heads: int, vocab_map: torch.Tensor, layers: int = 1,
              stages: int = 0) -> Heads:
    """Untrained heads of ``kind`` (Amphista's with ``stages`` adaptation layers) for a target of ``target_config``."""
    if kind == "amphista":  # built on this module's Heads, so imported only when asked for
        from methods._amphista import AmphistaHeads

        return AmphistaHeads(target_config, num_heads, vocab_map, layers, stages)
    return Heads(kind, target_config.hidden_size, num_heads, vocab_map, layers)


class CountedHeads(CountedModule):
    """The ``heads`` role. A Medusa call runs every head; a Hydra call runs one head, so it is counted as
    that head's weights only (2 FLOPs per weight per row, as in :mod:`bench.flops`)."""

    def __call__(self, hidden: torch.Tensor, path_emb: torch.Tensor | None = None):
        if self.module.kind == "medusa":
            return super().__call__(hidden)
        rows = hidden.shape[:-1].numel()
        self.calls += 1
        self.tokens += rows
        self.flops += 2.0 * self.module.head_weights(path_emb.shape[-2] - 1) * rows
        return self.module(hidden, path_emb)


def body_config(target_config, layers: int = 1):
    """The target's config cut to ``layers`` decoder layers (of its last layer's kind), with a one-row token
    embedding: such a body (Hydra++'s prefix layer, EAGLE's and KOALA's drafts) is fed vectors, never token
    ids, so a vocabulary-sized table would be dead weight."""
    config = target_config.__class__.from_dict(target_config.to_dict())
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:  # per-layer lists follow the layer count
        config.layer_types = [config.layer_types[-1]] * layers
    config.vocab_size = 1
    config.pad_token_id = config.bos_token_id = config.eos_token_id = None  # ids outside a 1-row table
    config._attn_implementation = target_config._attn_implementation
    return config


def copy_last_layers(body: nn.Module, target) -> None:
    """Load the target's last decoder layers into ``body``'s (a model built from :func:`body_config`: its one
    layer gets the target's last, K layers the last K in order), and whatever else has the same name and shape
    (the final norm, GPT-2's position table): :func:`bench.adapter.copy_from`."""
    n, k = len(decoder_layers(target)), len(decoder_layers(body))
    copy_from(body, target, list(range(n - k, n)))


class PrefixLayer(nn.Module):
    """Hydra++'s prefix attention layer: ``hidden + gamma * L(hidden)``.

    ``L`` is a one-layer decoder of the target's own class (attention over the sequence so far + MLP, the
    target's final norm), fed the target's last hidden states as input embeddings; ``gamma (hidden,)`` starts
    at zero, so an untrained layer passes the target's hidden state through and the heads start exactly where
    Hydra's do. :meth:`from_target` initialises ``L`` from the target's last layer and final norm.
    """

    def __init__(self, target_config):
        super().__init__()
        from transformers import AutoModel

        self.config = body_config(target_config)
        self.body = AutoModel.from_config(self.config).float()
        self.gamma = nn.Parameter(torch.zeros(self.config.hidden_size))

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
        out = self.body(inputs_embeds=hidden, past_key_values=cache, use_cache=cache is not None)
        return hidden + self.gamma * out.last_hidden_state


class CountedPrefix(Counted):
    """The ``prefix`` role: ``layer(hidden (B, n, hidden), cache)``, one decoder layer whose n query positions
    attend to the cache and to themselves (FLOPs by :mod:`bench.flops`, as for any model)."""

    def __init__(self, layer: PrefixLayer, role: str = "prefix"):
        super().__init__(layer, role, layer.config)

    def __call__(self, hidden: torch.Tensor, cache) -> torch.Tensor:
        batch, new = hidden.shape[:2]
        self._count(batch, new, cache.get_seq_length() + new)
        return self.module(hidden, cache)


# --------------------------------------------------------------------------------------------- training


def fp32_eval(target):
    """The frozen target to train from, in fp32 (a copy when it is not, so the pair's target is unchanged)."""
    if next(target.parameters()).dtype != torch.float32:
        target = copy.deepcopy(target).float()
    return target.eval()


def check_store_keeps_hidden(method: str, recipe) -> None:
    """A method whose trained part reads the target's stored hidden states needs a store that keeps them: said
    before any model loads (``check_recipe``)."""
    if not recipe.store.hidden:
        raise BenchError(f"method={method} reads the target's hidden states, which recipe.store.hidden=false does "
                         "not keep.")


def feature_stores(target, tokenizer, teacher: Teacher, who: str):
    """The run's train and held-out teacher stores for a trainer that reads the stored hidden states (heads,
    EAGLE's draft layer); ``who`` starts the sentence that says so when the store keeps none."""
    if not teacher.recipe.store.hidden:
        raise BenchError(f"{who} the target's hidden states, which this store does not keep; set "
                         "recipe.store.hidden=true.")
    return teacher.store(target, tokenizer, "train"), teacher.store(target, tokenizer, "test")


def draft_artifact(kind: str, target, key: dict, train, new, hint: str, description: str) -> Artifact:
    """A draft module trained from the target (EAGLE's, GliDe's) as a cached artifact ``<kind>.pt`` holding its
    hidden size, depth and weights. ``key``: what it depends on besides the target's weights; ``train() ->
    (module, report)`` builds it; ``new(vocab_map, layers)`` makes an untrained one to load the weights into."""
    ident = model_fingerprint(target)

    def build(folder: Path) -> dict:
        draft, report = train()
        torch.save({"hidden": target.config.hidden_size, "layers": draft.config.num_hidden_layers,
                    "state": draft.state_dict()}, folder / f"{kind}.pt")
        return report

    def load(folder: Path):
        blob = torch.load(folder / f"{kind}.pt", map_location="cpu", weights_only=True)
        if blob["hidden"] != target.config.hidden_size:
            raise ValueError(f"its hidden size is {blob['hidden']}, the target's {target.config.hidden_size}")
        draft = new(blob["state"]["vocab_map"], blob.get("layers", 1))
        draft.load_state_dict(blob["state"])
        return draft.eval()

    return Artifact(kind, f"{kind}-{ident['name']}", {"target": ident, **key}, build, load, hint=hint,
                    description=description)


def heads_loss(heads: Heads, batch: dict, to_sub, loss: str, embed, decay: float, prefix: PrefixLayer | None = None,
               teacher_head: nn.Linear | None = None, adversary: Adversary | None = None) -> torch.Tensor:
    """Sum over heads of ``decay**k`` times head k's cross-entropy against the target at position t + k + 1,
    restricted to the reduced vocabulary, over positions where both t and t + k + 1 are text (not padding).

    ``batch``: a store's ``ids (B, T)``, ``idx (B, T, k)``, ``mask (B, T)`` and ``hidden (B, T, H)``. ``loss``
    ``top1``: the target's greedy token (labels outside the vocabulary are dropped); ``teacher``: the target's
    whole distribution over the heads' vocabulary, ``softmax(teacher_head(h_{t+k+1}))`` (the target's own output
    rows over its stored hidden state, so nothing is cut to a top-k). With a ``prefix`` layer the heads read its
    output over the hidden states (trained jointly, through this loss).
    """
    hidden, ids, mask = batch["hidden"], batch["ids"], batch["mask"]
    T = hidden.shape[1]
    inputs = prefix(hidden) if prefix is not None else hidden
    total = hidden.new_zeros(())
    for k, logits in enumerate(heads.teacher_forced(inputs, ids, embed)):
        logq = torch.log_softmax(logits.float(), -1)
        keep = mask[:, : T - k - 1] & mask[:, k + 1 :]
        later = hidden[:, k + 1 :]  # the target's hidden state where head k's label is its next token

        def target_probs(rows=(slice(None),)) -> torch.Tensor:
            with torch.no_grad():
                return torch.softmax(teacher_head(later[rows]).float(), -1)

        if loss == "top1":
            label = to_sub[batch["idx"][:, k + 1 :, 0]]  # -1 outside the reduced vocabulary
            keep = keep & (label >= 0)
            ce = -logq.gather(-1, label.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        else:
            ce = -(target_probs() * logq).sum(-1)
        total = total + decay**k * (ce * keep).sum() / keep.sum().clamp_min(1)
        if adversary is not None:  # the target's distributions at the positions it draws are the real ones
            total = total + decay**k * adversary.term(logq, target_probs, keep)
    return total


@torch.no_grad()
def head_agreement(heads: Heads, store, embed, batch_size: int, prefix: PrefixLayer | None = None,
                   device=None, answer_only: bool = False) -> list[float]:
    """Per head: fraction of held-out positions where head k's greedy token equals the target's greedy token
    k + 1 steps after its next one (teacher-forced: the acceptance rate of a depth-(k+1) chain node whose
    ancestors were accepted), on the store's text positions (``answer_only``: those whose label is the target's
    own answer token)."""
    hits, total = [0] * heads.num_heads, [0] * heads.num_heads
    for part in torch.arange(len(store)).split(batch_size):
        b = {n: t.to(device) for n, t in store.rows(part, ("ids", "idx", "mask", "hidden", "answer")).items()}
        h = b["hidden"] if prefix is None else prefix(b["hidden"])
        T = h.shape[1]
        for k, logits in enumerate(heads.teacher_forced(h, b["ids"], embed)):
            pred = heads.vocab_map[logits.argmax(-1)]
            keep = b["mask"][:, : T - k - 1] & b["mask"][:, k + 1 :]
            if answer_only:
                keep = keep & b["answer"][:, k + 1 :]
            hits[k] += (pred == b["idx"][:, k + 1 :, 0])[keep].sum().item()
            total[k] += keep.sum().item()
    return [round(h / max(n, 1), 4) for h, n in zip(hits, total)]


def train_heads(target, tokenizer, kind: str, recipe: DictConfig, teacher: Teacher) -> tuple[Heads, PrefixLayer | None, dict]:
    """Train K heads of ``kind`` (and the prefix layer, when the recipe asks for one) from the teacher store of
    the frozen target: its stored hidden states are the heads' input, its labels their targets. Returns them
    (on the CPU) and a report."""
    torch.manual_seed(int(recipe.seed))
    target = fp32_eval(target)
    device = next(target.parameters()).device
    embed = target.get_input_embeddings()
    K, bs = int(recipe.num_heads), int(recipe.batch_size)
    settings = teacher.recipe.store
    if settings.seq_len <= K + 1:  # also checked with the config (TreeHeadsMethod.check_recipe)
        raise BenchError(f"recipe.store.seq_len ({settings.seq_len}) must exceed method.recipe.num_heads + 1 ({K + 1}).")
    train, held = feature_stores(target, tokenizer, teacher, "heads read")
    cols = store_data(train, ("ids", "idx", "mask"))
    m = cols["mask"]
    vocab_map = store_vocab(tokenizer, cols, int(recipe.vocab), target.config.vocab_size)
    to_sub = sub_index(vocab_map, target.config.vocab_size).to(device)

    heads = new_heads(kind, target.config, K, vocab_map, int(recipe.get("layers", 1)), int(recipe.get("stages", 0)))
    heads = heads.to(device)
    heads.init_from(target)
    teacher_head = None
    adversarial = recipe.get("adversarial")
    adversary = Adversary(len(vocab_map), AdversaryRecipe(**adversarial), device) if adversarial else None
    if recipe.loss == "teacher" or adversary is not None:  # the target's own output rows over the heads' vocabulary, frozen
        teacher_head = nn.Linear(target.config.hidden_size, len(vocab_map), bias=False).to(device).requires_grad_(False)
        teacher_head.weight.data.copy_(target.get_output_embeddings().weight.data[vocab_map.to(device)])
    prefix = PrefixLayer.from_target(target).to(device) if recipe.get("prefix_layer", False) else None
    modules = [heads] + ([prefix] if prefix is not None else [])
    report = {"agreement_before": head_agreement(heads, held, embed, bs, prefix, device)}
    params = [p for mod in modules for p in mod.parameters() if p.requires_grad]
    for mod in modules:
        mod.train()

    def step(rows: torch.Tensor) -> torch.Tensor:
        batch = {n: t.to(device) for n, t in train.rows(rows, ("ids", "idx", "mask", "hidden")).items()}
        return heads_loss(heads, batch, to_sub, recipe.loss, embed, float(recipe.decay), prefix, teacher_head, adversary)

    fit(params, lambda: torch.randperm(len(train)).split(bs), step, epochs=int(teacher.recipe.heads_epochs),
        steps_per_epoch=math.ceil(len(train) / bs), lr=float(recipe.lr),
        desc=f"{kind}: training {K} heads" + (" and the prefix layer" if prefix is not None else "")
        + (" against a discriminator" if adversary is not None else ""))
    for mod in modules:
        mod.eval()
    held_top1 = held.rows(range(len(held)), ("idx", "mask"))
    report.update(
        # Per head k: P(head k's top-1 == the target's greedy token k + 1 steps after its next one), held out.
        agreement_after=head_agreement(heads, held, embed, bs, prefix, device),
        # The same where the label is the target's own answer token: what acceptance while decoding follows.
        answer_token_agreement=head_agreement(heads, held, embed, bs, prefix, device, answer_only=True),
        prefix_layer=prefix is not None,
        layers=heads.layers,
        **({"stages": len(heads.stages)} if kind == "amphista" else {}),
        **(adversary.report() if adversary is not None else {}),
        recipe=teacher.recipe.name,
        train_tokens=int(m.sum()),
        heldout_tokens=int(held_top1["mask"].sum()),
        vocab=int(vocab_map.numel()),
        vocab_coverage=round(float((to_sub.cpu()[held_top1["idx"][..., 0][held_top1["mask"]]] >= 0).float().mean()), 4),
    )
    return heads.cpu(), (prefix.cpu() if prefix is not None else None), report


# --------------------------------------------------------------------------------------------- caching


def heads_artifact(target, tokenizer, kind: str, recipe: DictConfig, teacher: Teacher, method: str | None = None) -> Artifact:
    """The heads of (target, kind, recipe, the run's training recipe) as a cached artifact: ``heads.pt`` (heads
    and prefix layer).

    ``prefix_layer`` is keyed as a bool (absent = false), so a cached file always has the prefix layer its
    recipe asks for; loading checks it anyway, since a mismatch would decode with the wrong heads' input.
    """
    keyed = {**recipe_key(recipe, adversarial=None), "prefix_layer": bool(recipe.get("prefix_layer", False))}
    ident = model_fingerprint(target)

    def build(folder: Path) -> dict:
        heads, prefix, report = train_heads(target, tokenizer, kind, recipe, teacher)
        torch.save({"kind": kind, "hidden": heads.blocks[0].linear.out_features, "num_heads": heads.num_heads,
                    "layers": heads.layers, "stages": len(getattr(heads, "stages", ())),
                    "state": heads.state_dict(), "prefix": prefix.state_dict() if prefix is not None else None},
                   folder / "heads.pt")
        return report

    def load(folder: Path) -> tuple[Heads, PrefixLayer | None]:
        blob = torch.load(folder / "heads.pt", map_location="cpu", weights_only=True)
        has_prefix = blob.get("prefix") is not None
        if has_prefix != keyed["prefix_layer"]:
            # Not a BenchError: a file that does not fit its key is broken, rebuilt when building is allowed.
            raise ValueError(f"it {'has' if has_prefix else 'lacks'} a prefix layer, unlike method.recipe.prefix_layer")
        heads = new_heads(blob["kind"], target.config, blob["num_heads"], blob["state"]["vocab_map"],
                          blob.get("layers", 1), blob.get("stages", 0))
        heads.load_state_dict(blob["state"])
        prefix = None
        if has_prefix:
            prefix = PrefixLayer(target.config)
            prefix.load_state_dict(blob["prefix"])
            prefix.eval()
        return heads.eval(), prefix

    key = {"target": ident, "kind": kind, "recipe": keyed, "teacher": teacher.recipe.budget("heads")}
    return Artifact("heads", f"{kind}-{ident['name']}", key, build, load,
                    hint=f"run 'python -m bench train method method={method or kind}' with the same recipe=",
                    description=f"{kind} heads")


def load_or_train_heads(target, tokenizer, kind: str, recipe: DictConfig, teacher: Teacher,
                        train_if_missing: bool = True, method: str | None = None) -> tuple[Heads, PrefixLayer | None, dict]:
    """The cached heads for (target, kind, recipe, teacher.recipe), trained first when missing and
    ``train_if_missing``.

    Returns the heads, the prefix layer (``None`` unless ``recipe.prefix_layer``), both on the CPU in fp32,
    and their training report.
    """
    art = heads_artifact(target, tokenizer, kind, recipe, teacher, method)
    heads, prefix = load_or_build(art, teacher.cache, train_if_missing)
    return heads, prefix, report_of(art, teacher.cache)
