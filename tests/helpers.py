"""Shared test helpers: a method's shipped settings, and decoding a prompt with a named method on a pair."""

from collections.abc import Generator
from pathlib import Path

import torch
from omegaconf import OmegaConf

from core.kv_cache import cache_of, lm_forward
from decoding.sampling import Sampling, probs_from_logits

ROOT = Path(__file__).resolve().parent.parent  # the repository
from methods.registry import get_method


def method_cfg(name, **overrides):
    """Method ``name``'s settings as ``method=<name>`` composes them (its declared defaults), ``overrides`` on top."""
    return get_method(name).settings(overrides)


def build(pair, name, **overrides):
    """Method ``name`` on ``pair`` with its shipped settings (``overrides`` on top), set up."""
    method = get_method(name)(method_cfg(name, **overrides), pair)
    method.setup()
    return method


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


def with_drafts(pair, *modules):
    """``pair`` with other draft models (counted as draft, draft2, ...) and a role table of its own."""
    import dataclasses

    from core.counting import CountedLM

    drafts = [CountedLM(m, "draft" if i == 0 else f"draft{i + 1}") for i, m in enumerate(modules)]
    return dataclasses.replace(pair, drafts=drafts, roles={})


def noisy_copy(module, scale=0.02, seed=0):
    """The target with noise on its output head: a draft that is often, not always, right."""
    import copy

    draft = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = draft.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=gen) * scale)
    return draft


def repeating_prompt(pair):
    text = "The quick brown fox jumps over the lazy dog. " * 4 + "The quick brown"
    return pair.tokenizer(text, add_special_tokens=False)["input_ids"]


def refusal_of(call, *args) -> str:
    """The one sentence ``call(*args)`` refuses with (a :class:`core.errors.BenchError` of one line)."""
    import pytest

    from core.errors import BenchError

    with pytest.raises(BenchError) as err:
        call(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


def one_layer_pair(tiny_pair, seed=0):
    """The tiny pair with a random one-layer Llama target of the same sizes (``pair.target.module``), no draft
    models and a role table of its own: a published drafter written from that very layer is right most of the
    time, so a sampling test with it has power."""
    import dataclasses

    from transformers import LlamaForCausalLM

    from core.counting import CountedLM

    config = tiny_pair.target.module.config
    cut = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": 1})
    cut._attn_implementation = config._attn_implementation
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cut).eval()
    return dataclasses.replace(tiny_pair, target=CountedLM(model, "target"), drafts=[], roles={})


def assert_published_follows_the_target(pair, folder, name, **settings):
    """Method ``name`` with the published weights in ``folder`` on a prompt the target continues in a loop: greedy
    equal to ``ar``, and sampling its exact distribution (:func:`assert_sampling_is_the_targets`)."""
    method = build(pair, name, weights=str(folder), **settings)
    ids = repeating_prompt(pair)
    ids += decode(pair, "ar", ids, max_new=30).output_ids
    assert_greedy_equal_to_ar(method, [ids], max_new=24)
    assert_sampling_is_the_targets(method, ids, n=150)


# ------------------------------------------------------------------------------- lossless: the two checks


def assert_greedy_equal_to_ar(method, prompts, max_new=32):
    """Greedy output equals ``ar``'s token for token, and the per-call figures add up."""
    for ids in prompts:
        ref = decode(method.pair, "ar", ids, max_new=max_new).output_ids
        out = run(method, ids, max_new)
        assert out.output_ids == ref, f"{method.name} differs from ar greedily"
        assert len(out.drafted) == len(out.accept_lengths)
        if method.pair.tokenizer.eos_token_id not in out.output_ids:
            assert sum(out.accept_lengths) + 1 == len(out.output_ids)  # the prefill gives the first token
        assert all(0 < a <= d + 1 for a, d in zip(out.accept_lengths, out.drafted))


def run(method, ids, max_new, temperature=0.0, seed=0):
    """One decode with an already set-up method."""
    gen = torch.Generator(device=method.pair.device).manual_seed(seed)
    with torch.inference_mode():
        return method.decode(torch.tensor([ids], device=method.pair.device), max_new, Sampling(temperature, 1.0),
                             gen, lambda n: None)


def run_batch(method, prompts, max_new, temperature=0.0, seeds=None):
    """One batch decode of ``prompts`` (token lists) with an already set-up method, on the batch forwards its pair's
    models have (``lm.compiled`` with ``rows``); a generator per row, seeded by ``seeds`` (0 each by default)."""
    device = method.pair.device
    gens = [torch.Generator(device=device).manual_seed(s) for s in (seeds or [0] * len(prompts))]
    with torch.inference_mode():
        return method.decode_batch([torch.tensor([p], device=device) for p in prompts], max_new,
                                   Sampling(temperature, 1.0), gens, [lambda n: None] * len(prompts))


def second_token_counts(method, ids, temperature, n):
    """How often each token came second over ``n`` seeds (the last cell: decodes that ended first), and how
    many decodes drafted for the second token, and had it accepted."""
    vocab = method.pair.target.module.config.vocab_size
    counts = torch.zeros(vocab + 1)
    drafted = accepted = 0
    for seed in range(n):
        # Three tokens: after the first, the budget leaves room for one drafted token (one tree level).
        out = run(method, ids, 3, temperature, seed)
        counts[out.output_ids[1] if len(out.output_ids) > 1 else vocab] += 1
        drafted += bool(out.drafted) and out.drafted[0] > 0
        accepted += bool(out.accept_lengths) and out.accept_lengths[0] > 1
    return counts, drafted, accepted


def second_token_probs(pair, ids, temperature):
    """Exact P(second new token) under the target: the sum over first tokens t of p(t) p(. | t); the last
    cell is P(the first token is EOS)."""
    sampling = Sampling(temperature, 1.0)
    eos = pair.tokenizer.eos_token_id
    with torch.no_grad():
        p1 = probs_from_logits(pair.target.module(torch.tensor([ids])).logits[0, -1], sampling)
        firsts = ((p1 > 1e-9) & (torch.arange(len(p1)) != eos)).nonzero().flatten()
        batch = torch.cat([torch.tensor([ids]).expand(len(firsts), -1), firsts[:, None]], dim=1)
        p2 = probs_from_logits(pair.target.module(batch).logits[:, -1], sampling)
    return torch.cat([(p1[firsts, None] * p2).sum(0), p1[eos].view(1)])


def assert_sampling_is_the_targets(method, ids, temperature=0.05, n=300, min_share=0.05):
    """The second new token (one a drafter can propose) follows the target's exact marginal (chi-square), and
    the test had power: drafts were both accepted and rejected in at least ``min_share`` of the decodes."""
    from scipy.stats import chisquare

    counts, drafted, accepted = second_token_counts(method, ids, temperature, n)
    assert accepted >= min_share * n and drafted - accepted >= min_share * n, (method.name, drafted, accepted)
    expected = second_token_probs(method.pair, ids, temperature) * n
    assert counts[expected < 1e-6].sum() == 0  # nothing the target (practically) never emits
    big = expected >= 5  # chi-square needs enough expected counts per cell: the rest is pooled
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    assert big.sum() >= 3
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


def assert_cache_is_a_plain_pass(module, cache, prompt: list[int], seq: list[int]) -> None:
    """``cache`` (a draft's, after decoding ``seq`` from ``prompt``) holds more than the prompt and at most the
    committed text minus its pending token, and equals one plain forward of ``module`` over what it holds: the
    entries a method gathered from its token trees are the ones a plain pass computes."""
    n = cache.get_seq_length()
    assert len(prompt) < n <= len(seq) - 1
    with torch.no_grad():
        fresh = cache_of(module(torch.tensor([seq[:n]]), use_cache=True))
    for mine, ref in zip(cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.values, ref.values, atol=1e-4, rtol=1e-4)


def cache_free_greedy(pair, prompt: list[int], max_new: int) -> list[int]:
    """The plainest greedy decoding there is: the whole sequence read again by the target, without any cache, for
    each of ``max_new`` new tokens. What ``ar`` (which judges every method) is judged by."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new):
            x = torch.tensor([seq], device=pair.device)
            seq.append(int(lm_forward(pair.target.module, x).logits[0, -1].argmax()))
    return seq[len(prompt):]


def forwards_run(hook_result):
    """What a method's hook returns (``start``, ``propose``), each model forward it yields run as ``decode`` runs it
    alone (``methods.base.DraftVerify.steps``)."""
    if not isinstance(hook_result, Generator):
        return hook_result
    try:
        request = next(hook_result)
        while True:
            lm, cache = request.pop("lm"), request.pop("cache")
            request = hook_result.send(lm(cache=cache, **request))
    except StopIteration as stop:
        return stop.value


def run_keeping_state(method, *args, **kwargs):
    """:func:`run`, and the prompt's state as the decode left it (read by the loop's last hook, ``extra``)."""
    states = []
    method.extra = lambda state: states.append(state) or type(method).extra(method, state)
    try:
        out = run(method, *args, **kwargs)
    finally:
        del method.extra
    (state,) = states
    return out, state


def trained_pair(cfg, n_drafts=None):
    """The pair of ``cfg`` as a run gets it: its missing distilled drafts trained first (``train_if_missing``)."""
    from bench.models import load_pair

    return load_pair(cfg, n_drafts=n_drafts)


def local_folder(path, family, **config):
    """A random ``family`` model with the byte-level tokenizer saved as a local folder (a user's own model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.models import byte_tokenizer

    tok = byte_tokenizer()
    AutoModelForCausalLM.from_config(AutoConfig.for_model(family, vocab_size=len(tok), **config)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def longest_earlier(text, context):
    """Brute force: ``(length, first end)`` of the longest suffix of ``context`` occurring in ``text`` (``(0, -1)``:
    none), what SAM-Decoding's suffix automaton finds (tests/decoding/test_suffix_automaton.py, tests/methods/
    test_samd.py)."""
    for n in range(len(context), 0, -1):
        suffix = context[len(context) - n:]
        for end in range(n - 1, len(text)):
            if text[end - n + 1:end + 1] == suffix:
                return n, end
    return 0, -1
