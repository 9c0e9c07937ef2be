"""A draft made by the harness: a few of the target's own layers with its embedding and final norm, and an
output head over a reduced drafting vocabulary, distilled to match the target's next-token distribution.

Why this design (measured on 2 CPU cores, SmolLM2-135M, fp32): a forward of one token through the target
costs ~65 ms, of which ~9 ms is the 49,152-way output head and ~1.8 ms each of the 30 layers. A draft of
a few layers with the full head would spend most of its time in the head, so it drafts over the V most
frequent tokens only (8,192 by default: ~1/6 of the head's cost). The draft's logits are scattered back
into the full vocabulary (-inf elsewhere), so verification stays exactly lossless: greedily the target
just rejects a token the draft cannot propose, and for sampling q(x) = 0 outside the subset, which the
rejection rule handles exactly.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from omegaconf import DictConfig
from pydantic import Field, NonNegativeInt
from torch import nn
from tqdm.auto import tqdm
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from bench.artifacts import Artifact, load_or_build, model_fingerprint, report_of
from bench.errors import BenchError
from bench.schema import Settings
from decoding.corpus import Corpus, corpus
from decoding.training import fit

log = logging.getLogger(__name__)


class SelfDistill(Settings):
    """The target answers packaged instructions; the draft learns those answers (on-policy text)."""

    prompts: int = Field(64, ge=0, description="how many instructions the target answers (0: none)")
    batch_size: int = Field(16, ge=1, description="answers generated per batch")
    max_new_tokens: int = Field(128, ge=1, description="tokens per answer at most")


class DistillRecipe(Settings):
    """How a draft is distilled from the target (cached under cache_dir/drafts/, keyed by target and recipe)."""

    layers: list[NonNegativeInt] = Field([0, 1, 2, 3], min_length=1, description="which target layers the draft "
                                         "starts from (renumbered 0..k-1)")
    vocab: int = Field(8192, ge=1, description="drafting vocabulary: the most frequent tokens (verification stays "
                       "lossless)")
    corpus: Corpus = Field("lee", description="packaged training text")
    max_tokens: int = Field(49152, ge=1, description="teacher-forced training tokens")
    eval_tokens: int = Field(8192, ge=1, description="held-out tokens for the agreement report")
    seq_len: int = Field(256, ge=2, description="tokens per training sequence")
    batch_size: int = Field(8, ge=1, description="sequences per training step")
    epochs: int = Field(4, ge=1, description="passes over the training tokens")
    lr: float = Field(5.0e-4, gt=0, description="AdamW learning rate")
    topk: int = Field(32, ge=1, description="the target's top-k probabilities kept as soft labels")
    self_distill: SelfDistill | None = Field(None, description="on-policy answers added to the training text "
                                             "(null: none)")
    seed: int = Field(0, ge=0, description="seeds initialisation, data order and instruction choice")


class DraftLM(PreTrainedModel, GenerationMixin):
    """A small causal LM with a reduced output vocabulary; its logits come back over the full vocabulary.

    ``forward(input_ids (B, T), past_key_values, ...)`` returns ``logits`` of shape ``(B, T, full_vocab)``
    (``-inf`` outside ``vocab_map``) and ``hidden_states = (last_hidden (B, T, hidden),)``. It is a
    Hugging Face ``PreTrainedModel`` with ``generate``, so transformers' own assisted generation can use it
    as ``assistant_model`` (the benchmark script compares against that).
    """

    _supports_sdpa = True
    _can_compile_fullgraph = False

    def __init__(self, config, vocab_map: torch.Tensor):
        super().__init__(config)
        from transformers import AutoModel

        self.body = AutoModel.from_config(config)
        self.head = nn.Linear(config.hidden_size, vocab_map.numel(), bias=False)
        self.register_buffer("vocab_map", vocab_map.long(), persistent=True)

    def sub_logits(self, input_ids, past_key_values=None, use_cache=False, **kwargs):
        """Logits over the drafting vocabulary only: ``(B, T, len(vocab_map))``, and the last hidden state."""
        out = self.body(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        return self.head(hidden), hidden

    def get_input_embeddings(self):
        return self.body.embed_tokens

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, past_key_values=None, use_cache=False, output_hidden_states=False,
                logits_to_keep: int = 0, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("return_dict", "output_attentions")}
        out = self.body(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        sub = self.head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        logits = sub.new_full((*sub.shape[:-1], self.config.vocab_size), float("-inf"))
        logits[..., self.vocab_map] = sub
        return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values, hidden_states=(hidden,))


def draft_from_target(target, layers: list[int], vocab_map: torch.Tensor) -> DraftLM:
    """Initialise a draft from the target: its embedding, the chosen layers (renumbered), norm and head rows."""
    n_layer = target.config.num_hidden_layers
    bad = [i for i in layers if not 0 <= i < n_layer and not -n_layer <= i < 0]
    if bad or not layers:
        raise BenchError(f"draft layers {list(layers)} are not layers of a {n_layer}-layer target.")
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = len(layers)
    for attr in ("layer_types",):  # per-layer lists must shrink with the layer count
        if getattr(config, attr, None) is not None:
            setattr(config, attr, [getattr(config, attr)[i] for i in layers])
    draft = DraftLM(config, vocab_map)
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    draft.body.embed_tokens.load_state_dict(base.embed_tokens.state_dict())
    draft.body.norm.load_state_dict(base.norm.state_dict())
    for j, i in enumerate(layers):
        draft.body.layers[j].load_state_dict(base.layers[i].state_dict())
    draft.head.weight.data.copy_(target.get_output_embeddings().weight.data[vocab_map])
    return draft


def token_chunks(tokenizer, docs, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Documents joined by EOS and cut into ``(n_chunks, seq_len)`` token rows, at most ``max_tokens``."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos])
        if len(ids) >= max_tokens:
            break
    n = min(len(ids), max_tokens) // seq_len
    if n == 0:
        raise BenchError("the training corpus is shorter than one sequence; lower recipe.seq_len.")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


@torch.no_grad()
def teacher_pass(target, chunks: torch.Tensor, topk: int, batch_size: int, desc: str, with_hidden: bool = False):
    """Teacher-forced target outputs at every position of ``chunks (N, T)``.

    Returns ``(hidden, idx, prob)``: the last hidden states ``(N, T, hidden)`` (``None`` unless
    ``with_hidden``) and the target's top-k next-token ids and probabilities ``(N, T, topk)``
    (``idx[..., 0]`` is its greedy token).
    """
    hidden, idx, prob = [], [], []
    for start in tqdm(range(0, len(chunks), batch_size), desc=desc, unit="batch"):
        out = target(chunks[start : start + batch_size], output_hidden_states=with_hidden)
        p, i = torch.softmax(out.logits.float(), -1).topk(topk, dim=-1)
        if with_hidden:
            hidden.append(out.hidden_states[-1].float())
        idx.append(i)
        prob.append(p)
    return (torch.cat(hidden) if with_hidden else None), torch.cat(idx), torch.cat(prob)


def pick_vocab(tokenizer, chunks: torch.Tensor, top1: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` tokens the target predicts or reads most often, plus every special token (EOS first)."""
    counts = Counter(top1.flatten().tolist())
    counts.update(chunks.flatten().tolist())
    # Chat markup and specials must be proposable: instruct answers start and end with them.
    specials = set(tokenizer.all_special_ids) | {tokenizer.eos_token_id}
    chosen = list(dict.fromkeys([*sorted(specials), *(t for t, _ in counts.most_common())]))[:size]
    if len(chosen) < size:  # a tiny corpus: pad with the lowest ids not yet chosen
        rest = (t for t in range(len(tokenizer)) if t not in set(chosen))
        chosen += [next(rest) for _ in range(size - len(chosen))]
    return torch.tensor(sorted(chosen))


def sub_index(vocab_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``LongTensor (vocab_size,)``: a token's row in the reduced vocabulary ``vocab_map``, -1 outside it."""
    to_sub = torch.full((vocab_size,), -1, dtype=torch.long, device=vocab_map.device)
    to_sub[vocab_map] = torch.arange(vocab_map.numel(), device=vocab_map.device)
    return to_sub


def distill_loss(draft: DraftLM, x, idx, prob, to_sub):
    """Cross-entropy of the draft against the target's top-k distribution, restricted to the draft vocab.

    ``x``: ``(B, T)`` token ids; ``idx`` / ``prob``: ``(B, T, k)`` the target's top-k at each position, with
    ``prob`` all zero where a position has no label (prompt text, padding).
    """
    sub_logits, _ = draft.sub_logits(x)
    logq = torch.log_softmax(sub_logits.float(), -1)
    sub_idx = to_sub[idx]  # (B, T, k); -1 where the target's token is outside the drafting vocabulary
    w = prob * (sub_idx >= 0)
    mass = w.sum(-1, keepdim=True)
    labelled = (mass.squeeze(-1) > 0).float()
    w = w / mass.clamp_min(1e-9)
    per_pos = -(w * logq.gather(-1, sub_idx.clamp_min(0))).sum(-1)
    return (per_pos * labelled).sum() / labelled.sum().clamp_min(1.0)


@torch.no_grad()
def top1_agreement(draft: DraftLM, chunks, top1, batch_size: int) -> float:
    """Fraction of held-out positions where the draft's greedy token equals the target's (the greedy α)."""
    hits = total = 0
    for start in range(0, len(chunks), batch_size):
        sub, _ = draft.sub_logits(chunks[start : start + batch_size])
        pred = draft.vocab_map[sub.argmax(-1)]
        hits += (pred == top1[start : start + batch_size]).sum().item()
        total += pred.numel()
    return hits / max(total, 1)


@torch.no_grad()
def target_answers(target, tokenizer, prompts: list[str], batch_size: int, max_new_tokens: int, desc: str, topk: int = 0):
    """The target's greedy answers to ``prompts`` (chat template where the tokenizer has one), batched.

    Yields ``(prompt_ids, answer_ids, idx, prob)`` per prompt: ``LongTensor (P,)``, ``LongTensor (n,)`` (cut
    after the first EOS) and, when ``topk`` > 0, the target's top-k at each answer step: ``(n, topk)`` each.
    """
    eos = tokenizer.eos_token_id
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation appends on the right, so prompts are aligned on the right
    try:
        for start in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch"):
            batch = prompts[start : start + batch_size]
            if getattr(tokenizer, "chat_template", None):
                batch = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       tokenize=False) for p in batch]
            enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            out = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, output_logits=topk > 0,
                                  return_dict_in_generate=True, pad_token_id=eos)
            if topk:
                steps = torch.stack(out.logits, 1).float()  # (B, R, vocab): the target's logits for answer token t
                prob, idx = torch.softmax(steps, -1).topk(topk, dim=-1)
            width = enc["input_ids"].shape[1]
            for b in range(len(batch)):
                answer = out.sequences[b, width:]
                ends = (answer == eos).nonzero()
                n = int(ends[0]) + 1 if ends.numel() else answer.numel()
                prompt = enc["input_ids"][b][enc["attention_mask"][b].bool()]
                yield prompt, answer[:n], (idx[b, :n] if topk else None), (prob[b, :n] if topk else None)
    finally:
        tokenizer.padding_side = side


def self_distill_data(target, tokenizer, recipe: DictConfig):
    """The target answers packaged instructions greedily (batched); its distribution at every answer position
    is kept as top-k soft labels. The draft then learns the target on the target's own kind of text.

    Returns ``(ids, idx, prob)``: ``LongTensor (N, L)`` (right-padded with EOS), ``LongTensor (N, L, k)`` and
    ``FloatTensor (N, L, k)`` with zero ``prob`` on prompt and padding positions.
    """
    from decoding.corpus import instruction_prompts

    sd, k = recipe.self_distill, int(recipe.topk)
    prompts = instruction_prompts(int(sd.prompts), int(recipe.seed))
    rows = []
    for prompt, answer, i, p in target_answers(target, tokenizer, prompts, int(sd.batch_size), int(sd.max_new_tokens),
                                               "draft: target answers", topk=k):
        ids = torch.cat([prompt, answer])
        ridx = torch.zeros(len(ids), k, dtype=torch.long)
        rprob = torch.zeros(len(ids), k)
        # Position P-1+t predicts answer token t: that is where answer step t's distribution belongs.
        ridx[len(prompt) - 1 : len(ids) - 1] = i
        rprob[len(prompt) - 1 : len(ids) - 1] = p
        rows.append((ids, ridx, rprob))
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id, dtype=torch.long)
    idx = torch.zeros(len(rows), width, k, dtype=torch.long)
    prob = torch.zeros(len(rows), width, k)
    for r, (a, b, c) in enumerate(rows):
        ids[r, : len(a)], idx[r, : len(a)], prob[r, : len(a)] = a, b, c
    return ids, idx, prob


@torch.no_grad()
def answer_agreement(draft: DraftLM, ids, idx, prob, batch_size: int) -> float:
    """Greedy agreement on held-out target answers: the acceptance rate greedy SD sees, token by token."""
    hits = total = 0
    for start in range(0, len(ids), batch_size):
        sl = slice(start, start + batch_size)
        sub, _ = draft.sub_logits(ids[sl])
        labelled = prob[sl][..., 0] > 0
        hits += (draft.vocab_map[sub.argmax(-1)] == idx[sl][..., 0])[labelled].sum().item()
        total += labelled.sum().item()
    return hits / max(total, 1)


def train_draft(target, tokenizer, recipe: DictConfig) -> tuple[DraftLM, dict]:
    """Distil a draft from the frozen target on packaged text; returns the draft and its training report."""
    torch.manual_seed(int(recipe.seed))
    target = target.float().eval()
    train = token_chunks(tokenizer, corpus(recipe.corpus, "train"), recipe.seq_len, recipe.max_tokens)
    held = token_chunks(tokenizer, corpus(recipe.corpus, "test"), recipe.seq_len, recipe.eval_tokens)
    _, idx, prob = teacher_pass(target, train, recipe.topk, recipe.batch_size, "draft: target labels")
    top1 = idx[..., 0]
    held_top1 = teacher_pass(target, held, 1, recipe.batch_size, "draft: held-out labels")[1][..., 0]
    batches = [(train, idx, prob)]
    answers = None
    if recipe.get("self_distill") and int(recipe.self_distill.prompts) > 0:
        answers = self_distill_data(target, tokenizer, recipe)
        hold = max(1, len(answers[0]) // 10)  # the last tenth of the answers is held out
        held_answers = tuple(t[-hold:] for t in answers)
        answers = tuple(t[:-hold] for t in answers)
        batches.append(answers)
        top1 = torch.cat([top1.flatten(), answers[1][..., 0][answers[2][..., 0] > 0]])
    vocab_map = pick_vocab(tokenizer, train, top1, min(int(recipe.vocab), target.config.vocab_size))
    to_sub = sub_index(vocab_map, target.config.vocab_size)

    draft = draft_from_target(target, list(recipe.layers), vocab_map)
    report = {"agreement_before": top1_agreement(draft, held, held_top1, recipe.batch_size)}
    draft.body.embed_tokens.weight.requires_grad_(False)  # the input embedding stays the target's
    params = [p for p in draft.parameters() if p.requires_grad]
    bs = int(recipe.batch_size)
    # Batches from the news text and from the target's answers are interleaved at random each epoch.
    plan = [(src, lo) for src, (x, _, _) in enumerate(batches) for lo in range(0, len(x), bs)]

    def epoch():
        for j in torch.randperm(len(plan)).tolist():
            src, lo = plan[j]
            yield tuple(t[lo : lo + bs] for t in batches[src])

    draft.train()
    fit(params, epoch, lambda b: distill_loss(draft, *b, to_sub), epochs=int(recipe.epochs),
        steps_per_epoch=len(plan), lr=float(recipe.lr), desc="draft: distilling")
    draft.eval()
    if answers is not None:
        report["answer_tokens"] = int((answers[2][..., 0] > 0).sum())
        report["answer_agreement"] = answer_agreement(draft, *held_answers, recipe.batch_size)
    report.update(
        agreement_after=top1_agreement(draft, held, held_top1, recipe.batch_size),
        train_tokens=train.numel(),
        heldout_tokens=held.numel(),
        vocab=int(vocab_map.numel()),
        vocab_coverage=float((to_sub[held_top1] >= 0).float().mean()),
    )
    return draft, report


def draft_artifact(target, tokenizer, recipe: DictConfig) -> Artifact:
    """The distilled draft of (target, recipe) as a cached artifact: ``draft.pt`` (config and weights).

    Keyed by the target's weights, not its path: the same target found elsewhere keeps its draft.
    """
    ident = model_fingerprint(target)

    def build(folder: Path) -> dict:
        draft, report = train_draft(target, tokenizer, recipe)
        torch.save({"config": draft.config.to_dict(), "state": draft.state_dict()}, folder / "draft.pt")
        return report

    def load(folder: Path) -> DraftLM:
        blob = torch.load(folder / "draft.pt", map_location="cpu", weights_only=True)
        draft = DraftLM(target.config.__class__.from_dict(blob["config"]), blob["state"]["vocab_map"])
        draft.load_state_dict(blob["state"])
        return draft.eval()

    return Artifact("drafts", ident["name"], {"target": ident, "recipe": recipe}, build, load,
                    hint="run 'python -m bench train draft' with the same pair= setting",
                    description="distilled draft")


def load_or_train_draft(target, tokenizer, recipe: DictConfig, cache: Path, train_if_missing: bool = True) -> DraftLM:
    """The cached draft for (target, recipe), trained first when missing and ``train_if_missing``."""
    return load_or_build(draft_artifact(target, tokenizer, recipe), cache, train_if_missing)


def draft_report(target, recipe: DictConfig, cache: Path) -> dict:
    """The training report of the cached draft for (target, recipe) ({} when there is none)."""
    return report_of(draft_artifact(target, None, recipe), cache)
