"""SPRINTER (Zhong, Teku and Tandon, 2025, "Speeding up Speculative Decoding via Approximate Verification").

The draft generates one token at a time. After each token a small learned verifier, reading the draft's
last hidden state (and its top probability and entropy), predicts whether the target would accept it.
While it predicts acceptance the draft keeps going, up to ``max_run`` tokens, and the target is not
called. When the verifier flags a token (or the run reaches ``max_run``, or the draft proposes EOS) the
target is called ONCE over the pending tokens, and the standard rule (:func:`decoding.verify.verify_chain`)
is applied to that last token only: it is kept and the target adds a bonus token, or it is replaced by
the target's own (resampled) token. The earlier tokens of the run stand without a target check.

LOSSY: tokens the verifier lets through are never checked, so greedy output may differ from ``ar``;
``bench/quality.py`` measures by how much. With ``threshold`` above 1 every token is flagged and the
method is exactly SD with gamma = 1 (a test checks it); with ``threshold: 0`` nothing is flagged and the
target checks only every ``max_run``-th token.

The verifier is trained once per (target, draft, recipe) by :func:`train_verifier` and cached under
``cache_dir/verifiers/``: the draft and the target read packaged text teacher-forced, the draft's own
token at each position is the candidate, and the label says whether the target would accept it.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from omegaconf import DictConfig

from bench.counting import CountedModule, truncate_cache
from bench.errors import BenchError
from bench.registry import register
from decoding.sampling import next_token, probs_from_logits, sample
from decoding.verify import verify_chain
from methods._sprinter_verifier import (
    LABELS,
    draft_forward,
    features,
    load_or_train_verifier,
    verifier_dir,
)
from methods.base import Decoded, Method


@register("sprinter")
class Sprinter(Method):
    lossless = False  # unchecked tokens stand: see the module docstring and bench/quality.py
    drafts = 1

    @classmethod
    def check(cls, cfg: DictConfig) -> None:
        try:
            threshold = float(cfg.get("threshold"))
        except (TypeError, ValueError):
            threshold = math.nan
        if not threshold >= 0:
            raise BenchError(f"method.threshold must be a number >= 0 (above 1 every token is checked), got {cfg.get('threshold')}.")
        recipe = cfg.verifier
        if recipe.label not in LABELS:
            raise BenchError(f"method.verifier.label must be one of {', '.join(LABELS)}, got '{recipe.label}'.")
        if recipe.label == "sampling" and not float(recipe.temperature) > 0:
            raise BenchError(f"method.verifier.temperature must be > 0 for sampling labels, got {recipe.temperature}.")
        for key in ("max_tokens", "eval_tokens", "seq_len", "batch_size", "epochs", "train_batch"):
            if int(recipe[key]) < 1:
                raise BenchError(f"method.verifier.{key} must be at least 1, got {recipe[key]}.")
        if int(recipe.width) < 0:
            raise BenchError(f"method.verifier.width must be >= 0 (0 = logistic regression), got {recipe.width}.")

    def setup(self, train_if_missing: bool = True) -> None:
        model, self.report = load_or_train_verifier(self.pair, self.cfg.verifier, train_if_missing)
        expected = int(self.pair.draft.module.config.hidden_size) + (2 if self.cfg.verifier.probs else 0)
        if model.d_in != expected:
            raise BenchError(f"the cached SPRINTER verifier reads {model.d_in} features but this draft gives "
                             f"{expected}; delete {verifier_dir(self.pair, self.cfg.verifier)} to retrain it.")
        self.verifier = self.pair.add(CountedModule(model.to(self.pair.device), "verifier"))

    def draft_run(self, dcache, seq: list[int], limit: int, sampling, generator, device):
        """Draft up to ``limit`` tokens after ``seq``, stopping at the first token the verifier flags.

        Returns ``(tokens, q_last, why)``: the drafted token ids, the distribution the last one was drawn
        from (``FloatTensor (vocab,)``, ``None`` when greedy) and why the run ended (``flagged``,
        ``max_run``, ``eos`` or ``budget``). The last token is the one the target will check.
        """
        threshold, use_probs, eos = float(self.cfg.threshold), bool(self.cfg.verifier.probs), self.eos_ids
        x = torch.tensor([seq[dcache.get_seq_length():]], device=device)
        tokens, q = [], None
        for i in range(limit):
            logits, hidden = draft_forward(self.pair.draft, x, dcache, logits_to_keep=1)
            logits, hidden = logits[0, -1], hidden[0, -1]
            if sampling.greedy:
                tok = logits.argmax(-1)
            else:
                q = probs_from_logits(logits, sampling)
                tok = sample(q, generator)
            tokens.append(int(tok))
            if i == limit - 1:
                # The target checks this token anyway: no need to ask the verifier.
                return tokens, q, "max_run" if limit == int(self.cfg.max_run) else "budget"
            if tokens[-1] in eos:
                return tokens, q, "eos"  # an end of answer is always checked, never waved through
            score = torch.sigmoid(self.verifier(features(hidden, logits, use_probs).unsqueeze(0)))[0]
            if float(score) < threshold:
                return tokens, q, "flagged"
            x = tok.view(1, 1)
        return tokens, q, "budget"  # limit == 0: nothing drafted

    def decode(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens) -> Decoded:
        target, draft, device = self.pair.target, self.pair.draft, prompt_ids.device
        max_run = int(self.cfg.max_run)
        tcache, dcache, seq, out, done = self.prefill(prompt_ids, max_new_tokens, sampling, generator, on_tokens, draft)
        accept_lengths, drafted = [], []
        stats = Counter()
        while not done:
            # Never draft past the budget: the target's own token fills the last slot.
            tokens, q_last, why = self.draft_run(dcache, seq, min(max_run, max_new_tokens - len(out) - 1),
                                                 sampling, generator, device)
            k = len(tokens)
            stats[f"runs_{why}"] += 1
            # ONE target forward over the pending token and the run; only the last two rows are needed:
            # the row scoring the last drafted token and the bonus row after it.
            block = torch.tensor([seq[-1:] + tokens], device=device)
            logits = target(block, tcache, logits_to_keep=min(2, k + 1)).logits[0]
            if k == 0:
                n, nxt = 0, int(next_token(logits[-1], sampling, generator))
            else:
                q = q_last.unsqueeze(0) if q_last is not None else None
                # The SD rule on the last token only; the k - 1 before it are committed unchecked.
                n, nxt = verify_chain(torch.tensor(tokens[-1:], device=device), q, logits, sampling, generator)
                stats["checked_rejected"] += 1 - n
                stats["unchecked_tokens"] += k - 1
            committed = tokens[: k - 1 + n] + [nxt] if k else [nxt]
            seq.extend(committed)
            out.extend(committed)
            truncate_cache(tcache, len(seq) - 1)
            truncate_cache(dcache, min(dcache.get_seq_length(), len(seq) - 1))
            accept_lengths.append(len(committed))
            drafted.append(k)
            before = len(out)
            out, done = self.finish(out, max_new_tokens)
            on_tokens(len(committed) - (before - len(out)))
        extra = {
            # Drafted tokens committed without any target check (counted before the EOS / budget cut).
            "unchecked_tokens": stats["unchecked_tokens"],
            # Runs that ended because the verifier flagged a token / reached max_run / drafted EOS / hit
            # the token budget; each ends in one target call.
            "runs_flagged": stats["runs_flagged"],
            "runs_max_run": stats["runs_max_run"],
            "runs_eos": stats["runs_eos"],
            "runs_budget": stats["runs_budget"],
            # Checked (last) tokens the target rejected and replaced.
            "checked_rejected": stats["checked_rejected"],
        }
        return Decoded(out, accept_lengths=accept_lengths, drafted=drafted, extra=extra)
