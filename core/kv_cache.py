"""Handing a KV cache to a transformers model and reading it back, on every supported transformers release.

transformers 5.24 renamed the forward's cache argument from ``past_key_values`` to ``cache`` (and the output field
with it); the old name is deprecated there and removed in 5.40. Before 5.24 a model's forward takes ``**kwargs``
and silently swallows a ``cache=`` keyword: the cache stays empty, every step decodes without its context, and
``ar`` and a lossless method then agree on the same wrong tokens. So the harness never spells the name itself:
every call that hands a model (or one of its attention modules) a cache goes through :func:`cache_kwargs` or
:func:`lm_forward`, every read of an output's cache through :func:`cache_of`, and :func:`check_cache_used` refuses,
right after a model loads, any model whose cached forward does not give what the same tokens read whole give.
"""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version

from core.errors import BenchError

OLDEST = Version("5.17")  # the oldest release the tiny-pair suite passes on (CI runs it there: .ci/run)
RENAMED_IN = Version("5.24")  # the first release whose forwards take the cache as `cache`
INSTALLED = Version(transformers.__version__)
# `release` ignores dev/rc suffixes: a 5.24 pre-release already has the new name.
CACHE_ARG = "cache" if INSTALLED.release >= RENAMED_IN.release else "past_key_values"


def cache_kwargs(cache) -> dict:
    """The keyword that hands ``cache`` (a transformers ``Cache``, or None) to a forward of the installed
    release: a model's, a decoder layer's or an attention module's."""
    return {CACHE_ARG: cache}


def lm_forward(model, input_ids: torch.Tensor | None = None, cache=None, **kwargs):
    """``model``'s output for ``input_ids (B, n)`` (or ``inputs_embeds=``) after the positions ``cache`` holds,
    which it extends in place; ``cache=None`` reads the tokens alone and keeps nothing."""
    return model(input_ids=input_ids, use_cache=cache is not None, **cache_kwargs(cache), **kwargs)


def cache_of(output):
    """The ``Cache`` a forward returned (``output.cache`` from 5.24 on, ``output.past_key_values`` before)."""
    return getattr(output, CACHE_ARG)


def output_with_cache(output_class, cache, **fields):
    """A transformers output object (``CausalLMOutputWithPast``, ...) holding ``cache`` under this release's name."""
    return output_class(**fields, **cache_kwargs(cache))


def check_cache_used(model, label: str, context: int = 6, new: int = 2) -> None:
    """Refuse (one sentence) a causal LM whose KV cache does not work as the harness uses it: after a cached
    forward of ``context`` tokens the cache must hold them, and ``new`` more tokens read after it must get the
    logits they get when the whole sequence is read at once, not those they get alone (what a model that drops
    the cache computes). ``label`` names the model in the sentence ("the target", "draft 1").

    Costs three short forwards (``context + new`` tokens at most). A model whose logits do not depend on the
    context at all (a degenerate random model) cannot show the difference; then the cache's length alone is
    checked."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    # Distinct, non-special-looking ids: the middle of the vocabulary.
    ids = (torch.arange(context + new, device=device) * 7 + vocab // 3).remainder(vocab).unsqueeze(0)
    with torch.inference_mode():
        whole = lm_forward(model, ids).logits[0, -new:].float()
        alone = lm_forward(model, ids[:, -new:]).logits[0].float()
        cache = DynamicCache()
        lm_forward(model, ids[:, :context], cache)
        held = cache.get_seq_length()
        cached = lm_forward(model, ids[:, context:], cache).logits[0].float() if held == context else None
    why = None
    if held != context:
        why = f"after reading {context} tokens its KV cache holds {held}"
    else:
        error, context_effect = (cached - whole).abs().max().item(), (alone - whole).abs().max().item()
        if context_effect > 0 and not error < 0.25 * context_effect:  # dropping the cache: error == effect
            why = (f"tokens read after its KV cache get logits {error:.3g} away from those of the whole sequence "
                   f"(the context moves them by {context_effect:.3g})")
    if why is not None:
        raise BenchError(f"{label} ignores the KV cache the harness hands it ({why}) under transformers "
                         f"{transformers.__version__}, so every decode would be wrong; the harness supports "
                         f"transformers >= {OLDEST} with models whose forward takes a transformers Cache.")
