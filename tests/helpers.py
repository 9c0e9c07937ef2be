"""Shared test helpers: decode a prompt with a named method on a pair."""

import torch
from omegaconf import OmegaConf

from bench.registry import get_method
from decoding.sampling import Sampling


def decode(pair, name, prompt_ids, max_new=24, temperature=0.0, top_p=1.0, seed=0, **method_cfg):
    cfg = OmegaConf.create({"name": name, **method_cfg})
    method = get_method(name)(cfg, pair)
    method.setup()
    gen = torch.Generator(device=pair.device).manual_seed(seed)
    x = torch.tensor([prompt_ids], device=pair.device)
    with torch.inference_mode():
        return method.decode(x, max_new, Sampling(temperature, top_p), gen, lambda n: None)


def prompts_for(pair, n=3):
    """A few real prompts (the builtin set), tokenised as the harness does."""
    from bench.data import builtin_prompts, encode

    ps = builtin_prompts(OmegaConf.create({}))
    step = max(len(ps) // n, 1)
    return [encode(p, pair.tokenizer) for p in ps[::step][:n]]
