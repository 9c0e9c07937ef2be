"""Plain autoregressive decoding with a KV cache: one target forward per new token."""

from __future__ import annotations

import torch

from bench.registry import register
from decoding.sampling import next_token
from methods.base import Decoded, Method


@register("ar")
class AR(Method):
    lossless = True

    def decode(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens) -> Decoded:
        target = self.pair.target
        # Prefill: the whole prompt in one forward; only the last position needs logits.
        cache, _, _, out, done = self.prefill(prompt_ids, max_new_tokens, sampling, generator, on_tokens)
        step = torch.empty((1, 1), dtype=torch.long, device=prompt_ids.device)
        while not done:
            step.fill_(out[-1])
            logits = target(step, cache).logits[0, -1]
            out.append(int(next_token(logits, sampling, generator)))
            on_tokens(1)
            out, done = self.finish(out, max_new_tokens)
        calls = len(out) - 1
        return Decoded(out, accept_lengths=[1] * calls, drafted=[0] * calls)
