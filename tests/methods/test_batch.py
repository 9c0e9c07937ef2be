"""Issue 41, first step: ``DraftVerify.decode_batch`` decodes prompts together, ONE target forward per step over
every row, on the target's static cache of B rows (``core.compiled.CompiledLM(rows=B)``); each row's greedy output
and accepted lengths are what its decode alone gives. Prompts of different lengths, a row that ends while the others
run on (a smaller budget ends none early; EOS does), idle rows as padding. Eager batch forwards (the compiled graphs'
code, uncompiled) for every method; one compiled batch."""

import dataclasses

import pytest

from core.compiled import CompiledLM, no_recompiles
from core.counting import CountedLM
from core.errors import BenchError
from methods.registry import get_method, known_methods
from tests.helpers import build, noisy_copy, prompts_for, run, run_batch, with_drafts

BATCH = 3


@pytest.fixture(scope="module")
def good_pair(tiny_pair):
    return with_drafts(tiny_pair, noisy_copy(tiny_pair.target.module), tiny_pair.drafts[0].module)


@pytest.fixture(scope="module")
def batch_graphs(tiny_pair):
    """The tiny target's forwards over a cache of BATCH rows; compiled only where a test warms them, for the first 2
    rows and for all 3."""
    return CompiledLM(tiny_pair.target.module, max_len=1024, buckets=(1, 4, 16), rows=BATCH, batch_sizes=(2,))


@pytest.fixture(scope="module")
def draft_graphs(good_pair):
    """The first draft's forwards over a cache of BATCH rows, eager (a method with batched drafting runs them)."""
    return CompiledLM(good_pair.drafts[0].module, max_len=1024, buckets=(1, 4, 16), role="draft", rows=BATCH,
                      compiled=False)


def batched(pair, graphs, draft_graphs=None):
    """``pair`` whose target forwards go through ``graphs``, and its first draft's through ``draft_graphs`` when given
    (new counters and a role table of its own)."""
    target = CountedLM(pair.target.module, "target")
    target.compiled = graphs
    drafts = [CountedLM(d.module, d.role) for d in pair.drafts]
    if draft_graphs is not None:
        drafts[0].compiled = draft_graphs
    return dataclasses.replace(pair, target=target, drafts=drafts, roles={})


def prompts(pair):
    """Three prompts of different lengths (the shortest first: its prefill pads to the longest)."""
    ps = sorted(prompts_for(pair, 6), key=len)
    return [ps[0], ps[-1][:40], ps[2]]


def decode_compiled_rows(method, alone, rows):
    """``method``'s batch decode of ``rows`` (16 tokens) through warmed compiled graphs (a recompile is an error), each
    row checked against ``alone``'s decode of it by itself."""
    with no_recompiles():
        got = run_batch(method, rows, 16)
    for ids, out in zip(rows, got):
        ref = run(alone, ids, 16)
        assert out.output_ids == ref.output_ids and out.accept_lengths == ref.accept_lengths
    return got


def decode_counting_rows(method, alone, part, graphs, rows):
    """``method``'s batch decode of ``rows`` (16 tokens, eager batch forwards), each row checked against ``alone``'s
    decode of it by itself; returns the outputs and, per call of ``part.forward_rows`` (a batch forward of a draft, a
    stacked heads call), the rows it ran."""
    sizes = []
    run_rows = part.forward_rows
    part.forward_rows = lambda calls: sizes.append(sum(c is not None for c in calls)) or run_rows(calls)
    try:
        with graphs.eagerly():
            got = run_batch(method, rows, 16)
    finally:
        del part.forward_rows
    for ids, out in zip(rows, got):
        ref = run(alone, ids, 16)
        assert out.output_ids == ref.output_ids and out.accept_lengths == ref.accept_lengths
    return got, sizes


@pytest.mark.parametrize("name", [m for m in known_methods() if get_method(m).lossless])
def test_each_row_of_a_batch_decodes_what_it_decodes_alone(name, good_pair, batch_graphs):
    pair = batched(good_pair, batch_graphs)
    method, alone = build(pair, name), build(good_pair, name)
    rows = prompts(good_pair)
    with batch_graphs.eagerly():
        got = run_batch(method, rows, 16)
    for ids, out in zip(rows, got):
        ref = run(alone, ids, 16)
        assert out.output_ids == ref.output_ids, f"{name}: a row of the batch differs from its decode alone"
        assert out.accept_lengths == ref.accept_lengths


def test_a_compiled_batch_decodes_what_each_row_decodes_alone(good_pair, batch_graphs):
    """The same through the compiled graphs (a graph per bucket for the first 2 rows and for all 3), with a row that
    stops at EOS first: the last row takes its place and the 2-row graphs run from then on, until one row is left,
    which still runs the 2-row graphs, the other row as padding; pld's chains of different lengths per row share a
    bucket."""
    batch_graphs.warm()
    assert batch_graphs.batch_sizes == (2, 3)
    computed, run_rows = [], batch_graphs._run

    def counted(rows):  # per forward: the rows running, the rows computed
        out = run_rows(rows)
        last = max(b for b, r in enumerate(rows) if r is not None) + 1
        computed.append((last, sum(ran[2] > 0 for ran in batch_graphs.ran)))
        return out

    batch_graphs._run = counted
    pair = batched(good_pair, batch_graphs)
    rows = prompts(good_pair)
    alone = build(good_pair, "pld")
    refs = [run(alone, ids, 16) for ids in rows]
    method = build(pair, "pld")
    stop = refs[1].output_ids[2]  # row 1's third token ends it there
    method.eos_ids = method.eos_ids | {stop}
    alone.eos_ids = method.eos_ids
    try:
        with no_recompiles():
            got = run_batch(method, rows, 16)
    finally:
        del batch_graphs._run
    for ids, out in zip(rows, got):
        assert out.output_ids == run(alone, ids, 16).output_ids
    assert got[1].output_ids[-1] == stop and len(got[1].output_ids) < len(got[0].output_ids)
    steps = computed[1:]  # after the prefill (row by row, uncompiled)
    assert all(done == (2 if last <= 2 else 3) for last, done in steps)  # the smallest compiled size holding them
    assert steps[0] == (3, 3) and (2, 2) in steps  # all three rows, then two once row 1 stopped
    counts = pair.target.stats()
    assert counts["uncompiled_calls"] == BATCH  # the prefill (40 rows, beyond the largest bucket), once per row
    assert counts["padded_tokens"] > 0
    # Each row's share of the counts: its own target calls and tokens, the batch's padding split, all of it summed.
    for out in got:
        mine = out.counts["target"]
        assert mine["calls"] == len(out.accept_lengths) + 1 and mine["uncompiled_calls"] == 1
    for key in ("calls", "tokens", "flops", "padded_tokens", "padded_flops"):
        assert sum(out.counts["target"][key] for out in got) == pytest.approx(counts[key])


# The compiled batch forward under both releases: the test above; what these two methods swap and skip in it is the
# same code whichever release computed it.
@pytest.mark.newest_only
@pytest.mark.parametrize("name", ["space", "swift"])
def test_a_compiled_batch_swaps_and_skips_per_row(name, good_pair, batch_graphs):
    """Through the compiled batch graphs: SPACE's mask embeddings, swapped in at each row's own slots (inputs of the
    graphs), and SWIFT's layer-skipping draft (the graphs' code run uncompiled on the target's batch cache): every
    row decodes what it decodes alone."""
    batch_graphs.warm()
    pair = batched(good_pair, batch_graphs)
    decode_compiled_rows(build(pair, name), build(good_pair, name), prompts(good_pair))


BATCHED_DRAFTING = [m for m in known_methods() if getattr(get_method(m), "batched_drafting", False)]
# Those whose drafting runs a draft model (SWIFT's: the target with layers skipped); the others' draft layers and heads
# are tested below.
DRAFT_MODELS_BATCHED = [m for m in BATCHED_DRAFTING if get_method(m).drafts or m == "swift"]


def test_the_methods_that_batch_their_drafting():
    assert BATCHED_DRAFTING == ["amphista", "cascade", "eagle", "eagle3", "glide", "gsd", "hydra", "hydra_pp", "medusa",
                                "sd", "spechub", "sprinter", "swift"]  # docs/batching.md lists them


@pytest.mark.parametrize("name,settings", [("sd", {"gamma": 4}), ("sd", {"gamma": 3, "confidence": 0.5}),
                                           *[(m, {}) for m in DRAFT_MODELS_BATCHED if m != "sd"]])
def test_a_batch_drafts_every_row_in_one_draft_forward(good_pair, batch_graphs, draft_graphs, name, settings):
    """A method with batched drafting on the draft's batch cache: each drafting step of every row is ONE draft forward
    (padding the rows that drafted less, or finished: sd's fixed chains, chains that stop early per row, GSD's and
    SpecHub's tree levels, SPRINTER's runs, SWIFT's layer-skipping target on the target's batch cache), and each row
    still decodes what it decodes alone, its draft's forwards counted to it."""
    pair = batched(good_pair, batch_graphs, draft_graphs)
    method, alone = build(pair, name, **settings), build(good_pair, name, **settings)
    drafter = method.draft_lm if name == "swift" else pair.drafts[0]
    got, forwards = decode_counting_rows(method, alone, drafter, batch_graphs, prompts(good_pair))
    for out in got:
        if name == "sd":  # its own draft forwards: the prompt's, then one per drafted token
            assert out.counts["draft"]["calls"] == 1 + sum(out.drafted)
    assert forwards[0] == BATCH  # every row's prompt (swift: its first drafted token) in one forward
    assert len(forwards) < sum(out.counts[drafter.role]["calls"] for out in got)  # batched: fewer than the rows' own
    if settings == {"gamma": 4}:  # rows in step: round t runs as many draft forwards as its longest chain
        rounds = max(len(out.drafted) for out in got)
        longest = [max(out.drafted[t] for out in got if t < len(out.drafted)) for t in range(rounds)]
        assert len(forwards) == 1 + sum(longest)
    assert drafter.stats()["calls"] == sum(out.counts[drafter.role]["calls"] for out in got)


@pytest.mark.parametrize("name,settings", [("eagle", {}), ("eagle", {"draft": "chain"}), ("eagle", {"draft": "static"}),
                                           ("eagle3", {}), ("eagle3", {"draft": "chain"}), ("hydra_pp", {}),
                                           ("samd", {"aux": "eagle", "len_threshold": 99}), ("koala", {"base": "eagle"}),
                                           ("amphista", {})])
def test_a_batch_runs_every_rows_eagle_draft_in_one_forward(good_pair, batch_graphs, name, settings):
    """EAGLE's and EAGLE-3's draft layer, Hydra++'s prefix layer and Amphista's adaptation stages, each on a batch cache
    of its own (``Method.batch_parts``; its input, fc's fused features (EAGLE-3's: beside the token's embedding), the
    target's hidden states or a stage's fc over the stage before, in place of token embeddings): its catch-up, each tree
    level (under each row's tree mask) or chain step runs once for every row, and each row decodes what it decodes
    alone, its draft's forwards counted to it."""
    pair = batched(good_pair, batch_graphs)
    method, alone = build(pair, name, **settings), build(good_pair, name, **settings)
    parts = method.batch_parts()
    for part in parts:
        part.compiled = CompiledLM(part.module, max_len=1024, buckets=(1, 4, 16), role=part.role, rows=BATCH,
                                   compiled=False)
        part.compiled.check()
    draft = parts[0]
    got, forwards = decode_counting_rows(method, alone, draft, batch_graphs, prompts(good_pair))
    for part in parts:
        per_row = [out.counts[part.role] for out in got]
        assert part.stats()["calls"] == sum(c["calls"] for c in per_row)
        # EAGLE-3's fc, Amphista's: counted to the row that ran it.
        assert part.stats()["flops"] == pytest.approx(sum(c["flops"] for c in per_row))
    per_row = [out.counts[draft.role] for out in got]
    assert forwards[0] == BATCH and len(forwards) < sum(c["calls"] for c in per_row)  # the rows' forwards share forwards


@pytest.mark.parametrize("settings", [{}, {"cape": False}, {"cape_bins": [3] * 5 + [2] * 6}, "published"])
def test_a_batch_runs_every_rows_glide_draft_in_one_forward(good_pair, batch_graphs, settings, tmp_path):
    """GliDe's draft on a batch cache of its own, reading the target's batch cache (each row up to its own committed
    length, the late-read positions under training's block rule): every drafting step of every row runs as one
    forward (CaPE's chains, its expanded trees of different sizes per row, plain chains, the authors' published
    draft of two blocks reading two target layers), each row decodes what it decodes alone, and the draft's FLOPs (its
    cross-attention over each row's target keys too) counted to the rows sum to the role's."""
    if settings == "published":
        from tests.methods.glide.test_published import glide_file

        folder, _ = glide_file(tmp_path / "glide", good_pair.target.module, layers=2)
        settings = {"weights": str(folder), "gamma": 6}
    pair = batched(good_pair, batch_graphs)
    method, alone = build(pair, "glide", **settings), build(good_pair, "glide", **settings)
    [draft] = method.batch_parts()
    draft.compiled = CompiledLM(draft.module, max_len=1024, buckets=(1, 4, 16), role=draft.role, rows=BATCH,
                                compiled=False, reads=batch_graphs.cache)
    draft.compiled.check()
    got, forwards = decode_counting_rows(method, alone, draft, batch_graphs, prompts(good_pair))
    per_row = [out.counts[draft.role] for out in got]
    assert forwards[0] == BATCH and len(forwards) < sum(c["calls"] for c in per_row)
    assert draft.stats()["calls"] == sum(c["calls"] for c in per_row)
    assert draft.stats()["flops"] == pytest.approx(sum(c["flops"] for c in per_row))
    assert draft.stats()["padded_flops"] > 0  # the idle rows' and the target's unseen slots' share, counted


@pytest.mark.newest_only  # compiles four graphs (a minute or two here); the eager batch above runs under both releases
def test_a_compiled_glide_draft_reads_the_targets_compiled_batch_cache(good_pair, batch_graphs):
    """The same through compiled graphs on both sides: the target's batch cache's keys and values, and which of them
    each query row sees, are inputs of the draft's graphs (never constants frozen into them), and every row decodes
    what it decodes alone."""
    batch_graphs.warm()
    pair = batched(good_pair, batch_graphs)
    method, alone = build(pair, "glide"), build(good_pair, "glide")
    [draft] = method.batch_parts()
    draft.compiled = CompiledLM(draft.module, max_len=1024, buckets=(1, 4), role=draft.role, rows=BATCH,
                                reads=batch_graphs.cache, batch_sizes=(2,))  # steps of 1 or 2 tokens; prompts eager
    draft.compiled.warm()
    draft.compiled.check()
    decode_compiled_rows(method, alone, prompts(good_pair))
    assert draft.stats()["uncompiled_calls"] == BATCH  # the prompts (beyond the largest bucket) only


@pytest.mark.parametrize("name", ["medusa", "hydra", "amphista"])
def test_a_batch_runs_every_rows_heads_in_one_call(good_pair, batch_graphs, name):
    """Heads (Medusa's, Hydra's per depth, Amphista's) are called once per drafting step for every row: the rows'
    inputs stacked, the output split back; each row decodes what it decodes alone, and the heads' calls counted to
    each row sum to what the heads counted."""
    pair = batched(good_pair, batch_graphs)
    method, alone = build(pair, name), build(good_pair, name)
    got, stacked = decode_counting_rows(method, alone, method.heads, batch_graphs, prompts(good_pair))
    per_row = sum(out.counts["heads"]["calls"] for out in got)
    assert stacked[0] == BATCH and len(stacked) < per_row  # the rows' calls share calls
    assert method.heads.stats()["calls"] == per_row


@pytest.mark.newest_only
def test_a_batch_runs_its_compiled_heads_in_one_padded_call(good_pair, batch_graphs):
    """compile=true compiles Hydra's heads too (one graph per head and bucket of rows): in a batch every row's call at
    a depth is one call through them, padded to the bucket (counted), and each row decodes what it decodes alone."""
    from omegaconf import OmegaConf

    from bench.runner import compile_parts, uncompile_parts

    batch_graphs.warm()
    pair = batched(good_pair, batch_graphs)
    method, alone = build(pair, "hydra"), build(good_pair, "hydra")
    rows = prompts(good_pair)
    refs = [run(alone, ids, 16).output_ids for ids in rows]
    parts = compile_parts(OmegaConf.create({"compile": True}), [method], BATCH)
    try:
        # Depth 1: one parent per row; deeper: the tree's parents at that depth, for every row.
        assert list(parts) == ["heads"] and max(parts["heads"].buckets.values())[-1] >= BATCH
        with no_recompiles():
            got = run_batch(method, rows, 16)
    finally:
        uncompile_parts([method], BATCH)
    assert method.heads.compiled is None and [out.output_ids for out in got] == refs
    heads = method.heads.stats()
    assert heads["calls"] > 0 and heads["uncompiled_calls"] == 0 and heads["padded_tokens"] > 0
    assert sum(out.counts["heads"]["padded_tokens"] for out in got) == pytest.approx(heads["padded_tokens"])


def no_idle_rows_computed(graphs, moves: list, target: bool):
    """Check every uncompiled forward of ``graphs`` after it runs: the rows it computed span its running ones and no
    more (a draft's rows that drafted less this step idle between them as padding); the target's, which every
    unfinished row runs, come first in the cache (a finished row's place taken by a running row). ``moves`` gets each
    move of a row."""
    run_rows, move = graphs._run, graphs.cache.move

    def checked(rows):
        out = run_rows(rows)
        running = [b for b, r in enumerate(rows) if r is not None]
        assert [ran[2] > 0 for ran in graphs.ran] == [running[0] <= b <= running[-1] for b in range(len(rows))]
        assert not target or running == list(range(len(running)))
        return out

    graphs._run = checked
    graphs.cache.move = lambda src, dst: moves.append((src, dst)) or move(src, dst)


@pytest.mark.parametrize("name", ["pld", "sd", "eagle", "glide", "swift"])
def test_a_finished_row_stops_costing_compute(name, good_pair, batch_graphs, draft_graphs):
    """Issue 41: when a row stops (here the first, at EOS, while the others run on), a running row takes its place in
    every batch cache (the target's, a draft model's, EAGLE's and GliDe's drafts; SWIFT drafts on the target's), and
    the eager forwards compute the running rows only; every row still decodes what it decodes alone."""
    pair = batched(good_pair, batch_graphs, draft_graphs if name == "sd" else None)
    method, alone = build(pair, name), build(good_pair, name)
    graphs = [batch_graphs] + ([draft_graphs] if name == "sd" else [])
    for part in method.batch_parts():
        reads = {"reads": batch_graphs.cache} if name == "glide" else {}
        part.compiled = CompiledLM(part.module, max_len=1024, buckets=(1, 4, 16), role=part.role, rows=BATCH,
                                   compiled=False, **reads)
        graphs.append(part.compiled)
    rows = prompts(good_pair)
    stop = run(alone, rows[0], 16).output_ids[1]  # row 0's second token ends it there
    method.eos_ids = alone.eos_ids = method.eos_ids | {stop}
    moves = [[] for _ in graphs]
    for g, moved in zip(graphs, moves):
        no_idle_rows_computed(g, moved, target=g is batch_graphs and name != "swift")  # swift drafts on it too
    try:
        with batch_graphs.eagerly():
            got = run_batch(method, rows, 16)
    finally:
        for g in graphs:
            del g._run, g.cache.move
    for ids, out in zip(rows, got):
        ref = run(alone, ids, 16)
        assert out.output_ids == ref.output_ids and out.accept_lengths == ref.accept_lengths
    assert got[0].output_ids[-1] == stop and len(got[0].output_ids) <= 2 < max(len(out.output_ids) for out in got)
    assert all(moved and moved[0] == (2, 0) for moved in moves)  # the last running row took row 0's place, everywhere


@pytest.mark.parametrize("name", ["sd", "eagle", "lookahead"])  # a draft model's chain, a draft's tree, side rows
def test_a_sampled_row_draws_what_it_draws_alone(name, good_pair, batch_graphs, draft_graphs):
    """Each row draws from its own generator, in its own order: at temperature 1 every row's tokens are those of its
    decode alone with the same seed (whose distribution is the target's: tests/methods/test_methods.py), whatever
    the other rows do."""
    pair = batched(good_pair, batch_graphs, draft_graphs if name == "sd" else None)
    method, alone = build(pair, name), build(good_pair, name)
    rows, seeds = prompts(good_pair), [3, 4, 5]
    with batch_graphs.eagerly():
        got = run_batch(method, rows, 12, temperature=1.0, seeds=seeds)
    for ids, seed, out in zip(rows, seeds, got):
        assert out.output_ids == run(alone, ids, 12, temperature=1.0, seed=seed).output_ids


def test_every_registered_method_decodes_a_batch():
    """No registered method is refused at B > 1 (docs/batching.md); one with a loop of its own would be."""
    assert [m for m in known_methods() if get_method(m).batch_refusal] == []


def test_a_method_that_cannot_batch_is_one_sentence_before_any_model_loads(compose_cfg, good_pair, batch_graphs,
                                                                           monkeypatch):
    """A method with a decode loop of its own (a user's, say) is refused at B > 1 when the run's settings are checked,
    and its decode_batch says the same."""
    from bench.validate import validate
    from methods.base import DraftVerify

    class OwnLoop(DraftVerify):
        name = "own_loop"

        def decode(self, prompt_ids, max_new_tokens, sampling, generator, on_tokens):
            raise AssertionError("not reached")

    assert OwnLoop.batch_refusal and get_method("pld").batch_refusal is None
    with pytest.raises(BenchError, match="batch"):
        run_batch(OwnLoop({}, batched(good_pair, batch_graphs)), prompts(good_pair), 8)
    monkeypatch.setattr(get_method("pld"), "batch_refusal", OwnLoop.batch_refusal)
    with pytest.raises(BenchError, match="method=pld cannot decode a batch yet: it decodes with a loop of its own"):
        validate(compose_cfg("pair=tiny", "method=pld", "batch_size=2"))


def test_a_draft_length_by_batch_size(good_pair, batch_graphs, draft_graphs):
    """method.by_batch (vLLM's num_speculative_tokens_per_batch_size, for any setting): at B = 3 the entry for 2 and
    above drafts every step, and each row decodes what sd with that gamma decodes alone; at B = 1, the base gamma."""
    table = {2: {"gamma": 2}, 8: {"gamma": 1}}
    settings = get_method("sd").check_settings({"gamma": 4, "by_batch": table})
    assert [settings.at_batch(b).gamma for b in (1, 2, 3, 7, 8, 64)] == [4, 2, 2, 2, 1, 1]
    pair = batched(good_pair, batch_graphs, draft_graphs)
    method = get_method("sd")(settings.at_batch(3), pair)
    method.setup()
    rows = prompts(good_pair)
    with batch_graphs.eagerly():
        got = run_batch(method, rows, 16)
    for ids, out in zip(rows, got):
        assert max(out.drafted) == 2
        assert out.output_ids == run(build(good_pair, "sd", gamma=2), ids, 16).output_ids
    assert max(run(build(good_pair, "sd", by_batch=table), rows[0], 16).drafted) == 4


def test_a_run_reads_its_settings_at_its_batch_size(compose_cfg, good_pair):
    """The command line's by_batch, composed by Hydra, reaches the run's method as the entry for the run's B says (its
    records dump these settings); a nested method's own by_batch is refused (only the run's method is read)."""
    from bench.runner import build_methods, method_cfgs
    from bench.validate import validate

    cfg = validate(compose_cfg("pair=tiny", "method=sd", "batch_size=4", "method.by_batch={2:{gamma:3},8:{gamma:1}}"))
    assert cfg.method.gamma == 4
    built = build_methods(cfg, method_cfgs(cfg), good_pair)["sd"]
    assert built.cfg.gamma == 3 and built.cfg.by_batch == {2: {"gamma": 3}, 8: {"gamma": 1}}
    with pytest.raises(BenchError, match=r"method.medusa.by_batch is read from the run's method only"):
        validate(compose_cfg("pair=tiny", "method=koala", "method.medusa.by_batch={2:{top_k:2}}"))


@pytest.mark.parametrize("table, says", [
    ({0: {"gamma": 2}}, "by_batch's keys are batch sizes, integers >= 1"),
    ({2: {"gamma": 0}}, r"method.by_batch.2.gamma=0 is not allowed"),
    ({2: {"gama": 2}}, r"unknown key method.by_batch.2.gama"),
    ({2: {"by_batch": {}}}, r"method.by_batch.2 must map settings of sd"),
    ({2: {"adaptive": True, "gamma_min": 5, "gamma_max": 2}}, r"method.by_batch.2: gamma_min \(5\) must not exceed"),
])
def test_a_bad_settings_by_batch_table_is_one_sentence(table, says):
    with pytest.raises(BenchError, match=says):
        get_method("sd").check_settings({"by_batch": table})
