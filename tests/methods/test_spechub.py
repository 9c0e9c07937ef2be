"""SpecHub beyond the registry walk (``tests/methods/test_methods.py`` covers its defaults): the hub pair and its transport
plan (``decoding/verify.py``) exact by enumeration and by sampling, the acceptance formulas against measurement,
when the hub beats RRS (and when it does not), and the method on the tiny pair with each verifier: lossless,
one target forward and gamma draft forwards per step, the draft's cache kept right, bad input."""

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from bench.__main__ import main
from decoding.sampling import Sampling, probs_from_logits
from decoding.tree import Tree
from decoding.verify import (
    draw_hub_pair,
    hub_acceptance,
    hub_outcome,
    hub_plan,
    hub_token,
    rrs_acceptance,
    verify_hub,
    verify_tree,
)
from tests.helpers import (
    assert_cache_is_a_plain_pass,
    assert_greedy_equal_to_ar,
    assert_sampling_is_the_targets,
    build,
    noisy_copy,
    prompts_for,
    run,
    run_keeping_state,
    with_drafts,
)

# Verification math and loop logic beyond the registry walk: the method's model calls (its draft's and the target's
# forwards) are those tests/methods/test_methods.py makes for it under both transformers releases; CI's oldest leg
# skips these.
pytestmark = pytest.mark.newest_only

VERIFIERS = ["hub", "rrs", "rrs_wo"]


@pytest.fixture()
def pair(tiny_pair):
    """The tiny pair (its random draft: often wrong, so second drafts get their turn) with a role table of its own."""
    return dataclasses.replace(tiny_pair, roles={})


@pytest.fixture(scope="module")
def good_pair(tiny_pair):
    """The tiny pair whose draft is a noisy copy of the target: drafts are often, not always, accepted."""
    return with_drafts(tiny_pair, noisy_copy(tiny_pair.target.module))


def distributions(n, vocab=6, seed=0):
    """``n`` (p, q) pairs in float64, peaked and flat, some with zeros (top-p, a reduced draft vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * (0.5 + i % 4), 0)
        q = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * (0.5 + (i // 4) % 4), 0)
        if i % 3 == 0:
            p[int(p.argmin())] = 0
        if i % 5 == 0:
            q[int(q.argmin())] = 0
        out.append((p / p.sum(), q / q.sum()))
    return out


def hub_pairs(q):
    """Every pair :func:`draw_hub_pair` can draw from ``q``, with its probability Q (the paper's sparse joint)."""
    a = hub_token(q)
    return [pair for i in range(len(q)) if i != a and q[i] > 0
            for pair in (((i, a), q[i]), ((a, i), q[a] * q[i] / (1 - q[a])))]


# --------------------------------------------------------------------------------------------- the plan, exactly


def test_the_hub_plan_delivers_exactly_the_targets_distribution():
    """Summed over every pair Q can draw, P(output x) is p(x) to rounding: the kept drafts, then the residual.
    P(a draft is kept) is the closed form ``hub_acceptance``, and Q's first draft alone is distributed as q."""
    for p, q in distributions(60):
        pairs = hub_pairs(q)
        assert abs(sum(m for _, m in pairs) - 1) < 1e-12
        first = torch.zeros_like(q)
        out, kept = torch.zeros_like(p), 0.0
        plan = hub_plan(p, q)
        for (x1, x2), mass in pairs:
            first[x1] += mass
            k1, k2 = hub_outcome(plan, x1, x2)
            out[x1] += mass * k1
            out[x2] += mass * k2
            kept += float(mass) * (k1 + k2)
        assert torch.allclose(first, q, atol=1e-12)
        assert abs(float(plan.left.sum()) - (1 - kept)) < 1e-9
        out += plan.left  # what the target draws from when both are refused: P(refused) x the normalised residual
        assert torch.allclose(out, p, atol=1e-9), (p, q, out)
        assert abs(kept - hub_acceptance(p, q)) < 1e-9
        assert float(plan.left[plan.hub]) < 1e-12  # the hub always gets all of p(hub)


@pytest.mark.parametrize("gap", [15.0, 30.0])
def test_the_plan_holds_for_a_confident_fp32_draft(gap):
    """A draft sure of its top token in fp32: 1 - q(a) rounds far from (or to exactly) what the sampler
    renormalises the other tokens by; the plan still delivers p exactly, and keeps a draft 70% of the time."""
    q = torch.softmax(torch.tensor([gap, 0.0, 0.0]), 0)
    p = torch.tensor([0.2, 0.8, 0.0])
    plan, qd = hub_plan(p, q), q.double() / q.double().sum()
    rest = qd[1:].sum()
    out = plan.left.clone()
    for i in (1, 2):  # the pairs as draw_hub_pair draws them: x1 ~ q; x2 = a, or x2 ~ q without a
        for (x1, x2), mass in (((i, 0), qd[i]), ((0, i), qd[0] * qd[i] / rest)):
            k1, k2 = hub_outcome(plan, x1, x2)
            out[x1] += mass * k1
            out[x2] += mass * k2
    assert torch.allclose(out, p.double(), atol=1e-9), out
    assert hub_acceptance(p, q) == pytest.approx(0.7, abs=1e-6)


def test_the_hub_pair_is_drawn_from_its_joint_distribution():
    q = torch.tensor([0.1, 0.45, 0.0, 0.25, 0.2])
    g = torch.Generator().manual_seed(0)
    counts: dict = {}
    for _ in range(4000):
        x1, x2 = draw_hub_pair(q, g)
        assert x1 != x2 and 1 in (x1, x2) and 2 not in (x1, x2)  # distinct, one is the hub, never a q = 0 token
        counts[(x1, x2)] = counts.get((x1, x2), 0) + 1
    pairs = hub_pairs(q.double())
    assert set(counts) <= {pair for pair, _ in pairs}
    observed = [counts.get(pair, 0) for pair, _ in pairs]
    assert chisquare(observed, [4000 * float(m) for _, m in pairs]).pvalue > 1e-3
    assert draw_hub_pair(torch.tensor([0.0, 1.0, 0.0]), g) == [1]  # no other token: one draft


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_verify_hub_samples_the_targets_distribution(temperature, top_p):
    """Through the sampler itself: pairs drawn afresh, a leaf each, the first committed token over many draws."""
    sampling = Sampling(temperature, top_p)
    g = torch.Generator().manual_seed(1)
    p_logits = torch.randn(1, 6, generator=g) * 1.5
    q = probs_from_logits(torch.randn(6, generator=g) * 1.5, sampling)
    p = probs_from_logits(p_logits[0], sampling)
    counts, kept, n = torch.zeros(6), 0, 6000
    for _ in range(n):
        tree = Tree(5)
        for tok in draw_hub_pair(q, g):
            tree.add_child(0, tok, merge=False)
        path, nxt = verify_hub(tree, p_logits.expand(3, -1), sampling, g, q.expand(3, -1))
        counts[tree.tokens[path[1]] if len(path) > 1 else nxt] += 1
        kept += len(path) > 1
    assert counts[p == 0].sum() == 0
    assert chisquare(counts[p > 0].numpy(), (p[p > 0] * n).numpy()).pvalue > 1e-3
    assert 0.05 * n < kept < 0.95 * n  # power: both kept and refused pairs were tested
    assert abs(kept / n - hub_acceptance(p, q)) < 4 * (0.25 / n) ** 0.5


# --------------------------------------------------------------------------------------------- hub against RRS


def measured_acceptance(p, q, verifier, n, seed):
    """Share of ``n`` two-draft verifications that keep a draft: SpecHub's pair, or two i.i.d. draws under RRS."""
    g = torch.Generator().manual_seed(seed)
    logits, kept = p.log().expand(3, -1), 0
    for _ in range(n):
        tree = Tree(0)
        tokens = draw_hub_pair(q, g) if verifier == "hub" else torch.multinomial(q, 2, True, generator=g).tolist()
        for tok in tokens:
            tree.add_child(0, tok, merge=False)
        verify = verify_hub if verifier == "hub" else verify_tree
        kept += len(verify(tree, logits, Sampling(1.0), g, q.expand(3, -1))[0]) > 1
    return kept / n


def test_the_hub_accepts_at_least_as_often_as_rrs_when_the_draft_is_confident():
    """Derived in ``methods/spechub.py``: hub >= RRS (two i.i.d. drafts) whenever the draft's top probability is
    >= 1/2. Checked on many distributions, then measured on one (both formulas against the samplers too)."""
    for p, q in distributions(300, vocab=8, seed=3):
        if float(q.max()) >= 0.5:
            assert hub_acceptance(p, q) >= rrs_acceptance(p, q, 2) - 1e-12
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])
    q = torch.tensor([0.60, 0.04, 0.06, 0.10, 0.20])  # confident, and wrong: the first draft is often refused
    hub, rrs = hub_acceptance(p, q), rrs_acceptance(p, q, 2)
    assert hub > rrs + 0.1  # 0.80 against 0.68
    n, sigma = 3000, 4 * (0.25 / 3000) ** 0.5
    measured_hub, measured_rrs = measured_acceptance(p, q, "hub", n, 0), measured_acceptance(p, q, "rrs", n, 1)
    assert abs(measured_hub - hub) < sigma and abs(measured_rrs - rrs) < sigma and measured_hub > measured_rrs


def test_with_a_flat_draft_the_hub_can_accept_less_than_rrs():
    """The condition matters: with no clear favourite, and a hub the target never emits, the pair spends a draft
    on the hub every time while two i.i.d. draws land on the target's tokens more often."""
    p = torch.tensor([0.0, 0.0, 0.5, 0.5])
    q = torch.tensor([0.3, 0.3, 0.2, 0.2])
    assert hub_acceptance(p, q) < rrs_acceptance(p, q, 2) - 0.05  # 0.57 against 0.64


# --------------------------------------------------------------------------------------------- the method


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_lossless_with_each_verifier(good_pair, looping_prompt, verifier):
    method = build(good_pair, "spechub", verifier=verifier)
    assert_greedy_equal_to_ar(method, prompts_for(good_pair, 2) + [looping_prompt])
    assert_sampling_is_the_targets(method, looping_prompt)


@pytest.mark.parametrize("verifier,drafts", [("hub", 2), ("rrs", 3), ("rrs_wo", 3)])
def test_one_target_forward_per_step_and_the_draft_cache_kept_right(good_pair, looping_prompt, verifier, drafts):
    """Sampled (at a temperature, and a seed, where later drafts are kept at times): afterwards the draft's cache
    equals one plain pass of the draft over the committed text (its tree entries were gathered, not recomputed);
    gamma draft forwards per step (the first one also reads what the draft had not), one target forward."""
    pair = good_pair
    method = build(pair, "spechub", verifier=verifier, drafts=drafts, gamma=3)
    pair.reset_counts()
    out, state = run_keeping_state(method, looping_prompt, 40, temperature=0.1, seed=2)
    counts, steps = pair.counts(), len(out.accept_lengths)
    assert counts["target"]["calls"] == steps + 1
    assert counts["draft"]["calls"] == 1 + sum(out.drafted)  # the prefill, then one per depth drafted
    assert sum(out.extra["root_kept_by_draft"][1:]) > 0 and len(out.extra["root_kept_by_draft"]) == drafts
    assert max(out.drafted) == 3 and out.extra["verifier"] == verifier
    assert_cache_is_a_plain_pass(pair.draft.module, state.dcache, looping_prompt, looping_prompt + out.output_ids)


def test_the_figures_compare_both_schemes_on_the_same_contexts(pair, looping_prompt):
    method = build(pair, "spechub")
    sampled = run(method, looping_prompt, 24, temperature=1.0, seed=0).extra
    assert 0 < sampled["root_accept_expected_hub"] <= 1 and 0 < sampled["root_accept_expected_rrs"] <= 1
    assert 0 <= sampled["root_accept_rate"] <= 1 and sampled["drafts"] == 2
    greedy = run(method, looping_prompt, 24).extra
    assert greedy["root_accept_expected_hub"] != greedy["root_accept_expected_hub"]  # NaN: nothing sampled


# --------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("override, words", [
    ("method.drafts=0", r"^error: method.drafts=0 is not allowed; it takes an integer >= 1 "),
    ("method.drafts=3", r"^error: method=spechub: verifier=hub takes at most 2 drafts, not 3: "),
    ("method.verifier=spectr", r"^error: method.verifier='spectr' is not allowed; it takes one of: hub, rrs, rrs_wo "),
])
def test_bad_settings_are_one_sentence_and_nothing_is_written(override, words, tmp_path, capsys):
    import re

    code = main(["run", "pair=tiny", "method=spechub", override, f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and re.match(words, err), err
    assert not (tmp_path / "run").exists()
