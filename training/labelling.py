"""The target's passes that produce labels: teacher-forced top-k (and hidden states, keys and values) over token rows,
and its greedy answers to instructions. Nothing here knows about shards or caching (``training/store.py``)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from core.errors import BenchError
from core.kv_cache import lm_forward


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
        raise BenchError("the text is shorter than one sequence; ask for a shorter seq_len.")
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



@torch.no_grad()
def target_answers(target, tokenizer, prompts: list[str], batch_size: int, max_new_tokens: int, desc: str, topk: int = 0):
    """The target's greedy answers to ``prompts`` (chat template where the tokenizer has one), batched.

    Yields ``(prompt_ids, answer_ids, idx, prob)`` per prompt, on the CPU whatever the target's device:
    ``LongTensor (P,)``, ``LongTensor (n,)`` (cut after the first EOS) and, when ``topk`` > 0, the target's top-k
    at each answer step: ``(n, topk)`` each.
    """
    device = next(target.parameters()).device
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
            out = target.generate(**enc.to(device), max_new_tokens=max_new_tokens, do_sample=False,
                                  output_logits=topk > 0, return_dict_in_generate=True, pad_token_id=eos)
            if topk:
                steps = torch.stack(out.logits, 1).float()  # (B, R, vocab): the target's logits for answer token t
                prob, idx = (t.cpu() for t in torch.softmax(steps, -1).topk(topk, dim=-1))
            enc, sequences = enc.to("cpu"), out.sequences.cpu()
            width = enc["input_ids"].shape[1]
            for b in range(len(batch)):
                answer = sequences[b, width:]
                ends = (answer == eos).nonzero()
                n = int(ends[0]) + 1 if ends.numel() else answer.numel()
                prompt = enc["input_ids"][b][enc["attention_mask"][b].bool()]
                yield prompt, answer[:n], (idx[b, :n] if topk else None), (prob[b, :n] if topk else None)
    finally:
        tokenizer.padding_side = side


@torch.no_grad()
def target_kv(target, ids: torch.Tensor, layer: int, batch_size: int, desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's keys and values of decoder ``layer`` at every position of ``ids (N, T)``: one teacher-forced
    forward per batch, read from the KV cache it returns (keys after rotary, exactly what decoding caches).
    Returns ``(k, v)``, each ``FloatTensor (N, n_kv_heads, T, head_dim)`` on the CPU."""
    device = next(target.parameters()).device
    ks, vs = [], []
    for start in tqdm(range(0, len(ids), batch_size), desc=desc, unit="batch"):
        cache = DynamicCache()
        lm_forward(target, ids[start : start + batch_size].to(device), cache, logits_to_keep=1)
        cached = cache.layers[layer]
        ks.append(cached.keys.float().cpu())
        vs.append(cached.values.float().cpu())
    return torch.cat(ks), torch.cat(vs)
