"""The one summary (bench/summary.py): speedups two ways, acceptance by position, the analytic speedup,
near-tie counts, and the same table from `run`, `table`, the figures and the report."""

import json
import math

import pandas as pd
import pytest

from bench.saved import load
from bench.summary import display_table, summary_table
from core import metrics
from tests.bench.test_study import _record, _write_run


# Release-independent (no transformers model is loaded or called here): CI's oldest-transformers leg skips it.
pytestmark = pytest.mark.newest_only


def _rows(path, **kw):
    df, _ = load([str(path)], **kw)
    return summary_table(df).set_index("label")


def test_speedup_median_pooled_and_spread(tmp_path):
    """Per-prompt speedups 2, 2, 1, 4: median 2, quartiles 1.75 and 2.5; pooled (Spec-Bench) is total tokens
    over total seconds, 40 / 3 s against the baseline's 40 / 7 s = 7/3, on paired prompts only."""
    recs = []
    for i, (base_wall, wall) in enumerate([(1, 0.5), (1, 0.5), (1, 1), (4, 1)]):
        recs += [_record("ar", f"p{i}", "qa", base_wall), _record("sd", f"p{i}", "qa", wall)]
    recs.append(_record("sd", "lonely", "qa", 0.01))  # no baseline record for this prompt: not paired, not pooled
    _write_run(tmp_path / "run", recs)
    sd = _rows(tmp_path / "run").loc["sd"]
    assert sd["speedup_median"] == pytest.approx(2.0)
    assert (sd["speedup_q25"], sd["speedup_q75"]) == (pytest.approx(1.75), pytest.approx(2.5))
    assert sd["speedup_pooled"] == pytest.approx((40 / 3) / (40 / 7))
    assert sd["speedup_lo"] <= 2.0 <= sd["speedup_hi"]
    shown = display_table(_rows(tmp_path / "run").reset_index()).set_index("label").loc["sd"]
    assert shown["speedup_median"].startswith("2.00 [") and shown["speedup_iqr"] == "1.75–2.50"


def test_the_decode_phase_speedup_leaves_the_prefill_out(tmp_path):
    """A long prefill the same on both sides (9 s) and a decode twice as fast (9 new tokens after the first in 0.5 s
    against 1 s): end to end 10 / 9.5, the decode phase 2; NaN for a record without a time to its first token."""
    recs = []
    for i in range(3):
        base, fast = _record("ar", f"p{i}", "qa", 10.0), _record("sd", f"p{i}", "qa", 9.5)
        base["ttft_s"] = fast["ttft_s"] = 9.0
        recs += [base, fast]
    _write_run(tmp_path / "run", recs)
    t = _rows(tmp_path / "run")
    assert t.loc["sd", "speedup_median"] == pytest.approx(10 / 9.5)
    assert t.loc["sd", "speedup_decode"] == pytest.approx(2.0) and t.loc["ar", "speedup_decode"] == pytest.approx(1.0)
    assert t.loc["sd", "tpot_ms"] == pytest.approx(500 / 9) and t.loc["ar", "tpot_ms"] == pytest.approx(1000 / 9)
    for r in recs:
        r["ttft_s"] = None
    _write_run(tmp_path / "bare", recs)
    bare = _rows(tmp_path / "bare").loc["sd"]
    assert math.isnan(bare["speedup_decode"]) and math.isnan(bare["tpot_ms"])


def test_pooled_differs_from_median_when_lengths_differ(tmp_path):
    """A method twice as fast on two short answers and half as fast on a long one: the median says 2, tokens
    per second pooled over the run (0.57) says it is slower than the baseline."""
    recs = [_record("ar", "short", "qa", 1.0, new_tokens=10), _record("sd", "short", "qa", 0.5, new_tokens=10),
            _record("ar", "long", "qa", 10.0, new_tokens=100), _record("sd", "long", "qa", 20.0, new_tokens=100),
            _record("ar", "mid", "qa", 1.0, new_tokens=10), _record("sd", "mid", "qa", 0.5, new_tokens=10)]
    _write_run(tmp_path / "run", recs)
    sd = _rows(tmp_path / "run").loc["sd"]
    assert sd["speedup_median"] == pytest.approx(2.0)
    assert sd["speedup_pooled"] == pytest.approx((120 / 21) / (120 / 12))


def test_pairing_follows_each_runs_own_baseline(tmp_path):
    """A run made with baseline=sd is paired against sd by default (its run.json says so), as the run's own
    printed summary was; --baseline overrides it."""
    recs = []
    for i in range(3):
        recs += [_record("sd", f"p{i}", "qa", 2.0, drafted=[2] * 9, gamma=4), _record("pld", f"p{i}", "qa", 1.0)]
    _write_run(tmp_path / "run", recs)
    prov = json.loads((tmp_path / "run" / "run.json").read_text())
    prov["config"]["baseline"] = "sd"
    (tmp_path / "run" / "run.json").write_text(json.dumps(prov))
    t = _rows(tmp_path / "run")
    assert list(t.index) == ["sd", "pld"]  # the baseline first
    assert t.loc["pld", "speedup_median"] == pytest.approx(2.0) and t.loc["sd", "speedup_median"] == 1.0
    assert math.isnan(_rows(tmp_path / "run", baseline="ar").loc["pld", "speedup_median"])


def test_acceptance_by_position_is_pooled_over_prompts(tmp_path):
    acc = [[3, 1, 5], [2, 2, 1, 7]]
    dr = [[4, 4, 6], [4, 2, 3, 6]]
    recs = [_record("ar", "p0", "qa", 1.0), _record("ar", "p1", "qa", 1.0)]
    recs += [_record("sd", f"p{i}", "qa", 0.5, new_tokens=1 + sum(a), accept=a, drafted=d)
             for i, (a, d) in enumerate(zip(acc, dr))]
    _write_run(tmp_path / "run", recs)
    t = _rows(tmp_path / "run")
    want = metrics.acceptance_by_position(acc[0] + acc[1], dr[0] + dr[1])
    assert len(want) == 6 and t.loc["sd", "accept_by_position"] == pytest.approx(want)
    assert t.loc["ar", "accept_by_position"] == []
    shown = display_table(t.reset_index()).set_index("label")["accept_by_position"]
    assert shown["sd"] == " ".join(f"{v:.2f}" for v in want[:5]) + " …" and shown["ar"] is None


def test_analytic_speedup_comes_from_the_method_and_the_records_c(tmp_path):
    """sd: Leviathan's Thm 3.8 with the pooled alpha, mean drafted per call and the records' c; pld states no
    model; a method name no longer registered gives NaN, not a crash; no c in the records: NaN."""
    recs = []
    for i in range(2):
        recs += [_record("ar", f"p{i}", "qa", 1.0), _record("sd", f"p{i}", "qa", 0.5, accept=[3, 1, 5], drafted=[4, 2, 4]),
                 _record("pld", f"p{i}", "qa", 0.5, accept=[3, 1], drafted=[4, 2]),
                 _record("retired", f"p{i}", "qa", 0.5, accept=[3, 1], drafted=[4, 2])]
    _write_run(tmp_path / "a", recs)
    t = _rows(tmp_path / "a")
    alpha = metrics.alpha_estimate([3, 1, 5] * 2, [4, 2, 4] * 2)
    assert t.loc["sd", "mean_drafted"] == pytest.approx(10 / 3) and t.loc["sd", "cost_ratio_c"] == 0.1
    assert t.loc["sd", "analytic_speedup"] == pytest.approx(metrics.analytic_speedup(alpha, 10 / 3, 0.1))
    assert math.isnan(t.loc["pld", "analytic_speedup"]) and math.isnan(t.loc["retired", "analytic_speedup"])
    assert not math.isnan(t.loc["retired", "alpha"])
    for r in recs:
        del r["cost_ratio_c"]
    _write_run(tmp_path / "b", recs)
    assert math.isnan(_rows(tmp_path / "b").loc["sd", "analytic_speedup"])


def test_run_prints_and_stores_the_table_summary(compose_cfg, tmp_path, capsys):
    """`run`'s summary (returned and in run.json) is `bench table`'s, row for row; records carry
    accept_by_position and the run's c."""
    from bench.cli import print_summary
    from bench.report_cli import table_main
    from bench.results import clean_nan, read_records
    from bench.runner import run
    from bench.summary import as_rows, markdown

    cfg = compose_cfg("pair=tiny", "method=sd", "method.gamma=3", "max_new_tokens=10", "dataset.n_prompts=3", "warmup=0")
    rows = run(cfg, tmp_path)
    prov = json.loads((tmp_path / "run.json").read_text())
    assert rows == prov["summary"]
    df, _ = load([str(tmp_path)])
    table = summary_table(df)
    assert rows == as_rows(table)
    assert [r["label"] for r in rows] == ["ar", "sd"] and rows[1]["speedup_median"] > 0
    assert rows[1]["speedup_pooled"] > 0 and rows[1]["speedup_q25"] <= rows[1]["speedup_q75"]
    assert len(rows[1]["accept_by_position"]) == 3 and rows[1]["analytic_speedup"] > 0

    table_main([str(tmp_path), "--out", str(tmp_path / "t")])
    csv = pd.read_csv(tmp_path / "t" / "summary.csv").set_index("label")
    assert csv.loc["sd", "speedup_median"] == pytest.approx(rows[1]["speedup_median"])
    assert json.loads(csv.loc["sd", "accept_by_position"]) == pytest.approx(rows[1]["accept_by_position"], nan_ok=True)
    printed_by_table = capsys.readouterr().out
    print_summary(tmp_path, "ar")
    printed_by_run = capsys.readouterr().out
    assert markdown(table) in printed_by_run and markdown(table) in printed_by_table

    for r in read_records(tmp_path / "records.jsonl"):
        assert r["cost_ratio_c"] == pytest.approx(prov["cost_ratio_c"])
        if r["method"] == "ar":
            assert r["accept_by_position"] == []
        else:
            # Positions never reached are NaN, written as null.
            assert r["accept_by_position"] == clean_nan(metrics.acceptance_by_position(r["accept_lengths"], r["drafted"]))


def test_tie_flips_and_mismatches_are_counted_apart(tmp_path):
    """Five greedy prompts: two equal to ar, one parting at a near-tie, one at a clear margin, one from an
    older run without divergence (counted as a mismatch: not shown to be a tie). Sampled runs count nothing."""
    recs = []
    divs = [None, None, {"position": 3, "margin": 2e-4, "tie": True, "eps": 1e-3},
            {"position": 0, "margin": 1.5, "tie": False, "eps": 1e-3}, "absent"]
    for i, div in enumerate(divs):
        recs.append({**_record("ar", f"p{i}", "qa", 1.0), "matches_baseline": True, "divergence": None})
        r = {**_record("sd", f"p{i}", "qa", 0.5), "matches_baseline": div is None}
        if div != "absent":
            r["divergence"] = div
        recs.append(r)
    _write_run(tmp_path / "greedy", recs)
    t = _rows(tmp_path / "greedy")
    assert t.loc["sd", "matches_baseline"] == pytest.approx(0.4)
    assert (t.loc["sd", "tie_flips"], t.loc["sd", "mismatches"]) == (1, 2)
    assert math.isnan(t.loc["ar", "tie_flips"]) and math.isnan(t.loc["ar", "mismatches"])
    shown = display_table(t.reset_index()).set_index("label")
    assert (shown.loc["sd", "tie_flips"], shown.loc["sd", "mismatches"]) == (1, 2)

    sampled = [{**r, "matches_baseline": None, "divergence": None} for r in recs]
    _write_run(tmp_path / "sampled", sampled)
    t = _rows(tmp_path / "sampled")
    assert math.isnan(t.loc["sd", "tie_flips"]) and math.isnan(t.loc["sd", "matches_baseline"])
    assert "tie_flips" not in display_table(t.reset_index()).columns  # all-empty columns are dropped


def test_speedup_against_the_reference_is_paired_per_prompt_from_the_files(tmp_path):
    """A run with the optimised reference (ar_compiled): each record's speedup_vs_ref is the reference's seconds per
    token on the same prompt over its own, re-paired from the files (not read from them), its median in the table
    beside the speedup against ar; the reference's row follows the baseline's; a run without one has none."""
    recs = []
    for i, (ar, ref, sd) in enumerate([(2.0, 1.0, 0.5), (2.0, 1.0, 2.0), (3.0, 1.5, 1.0)]):
        recs += [_record("ar", f"p{i}", "qa", ar), _record("ar_compiled", f"p{i}", "qa", ref),
                 {**_record("sd", f"p{i}", "qa", sd), "speedup_vs_ref": 99.0}]  # a stale figure in the file: ignored
    _write_run(tmp_path / "run", recs)
    t = _rows(tmp_path / "run")
    assert list(t.index) == ["ar", "ar_compiled", "sd"]
    assert t.loc["sd", "speedup_vs_ref"] == pytest.approx(1.5)  # per prompt: 2, 0.5, 1.5
    assert t.loc["sd", "speedup_median"] == pytest.approx(3.0)  # against ar: 4, 1, 3
    assert t.loc["ar", "speedup_vs_ref"] == pytest.approx(0.5) and t.loc["ar_compiled", "speedup_median"] == 2.0
    _write_run(tmp_path / "plain", [_record("ar", "p0", "qa", 1.0), _record("sd", "p0", "qa", 0.5)])
    assert math.isnan(_rows(tmp_path / "plain").loc["sd", "speedup_vs_ref"])
    assert "speedup_vs_ref" not in display_table(_rows(tmp_path / "plain").reset_index())


def test_memory_columns_take_the_largest_prompt_and_show_mib(tmp_path):
    """peak_mem_bytes and peak_decode_bytes: the largest over prompts; method_param_bytes: the method's parts; shown
    in MiB; a column no record measured (peak_decode_bytes on the CPU) is left out of the display."""
    mib = 2**20
    recs = [{**_record("ar", "p0", "qa", 1.0), "peak_mem_bytes": 500 * mib, "method_param_bytes": 0,
             "peak_decode_bytes": None},
            {**_record("sd", "p0", "qa", 0.5), "peak_mem_bytes": 520 * mib, "method_param_bytes": mib // 4,
             "peak_decode_bytes": None},
            {**_record("ar", "p1", "qa", 1.0), "peak_mem_bytes": 510 * mib, "method_param_bytes": 0,
             "peak_decode_bytes": None},
            {**_record("sd", "p1", "qa", 0.5), "peak_mem_bytes": 530 * mib, "method_param_bytes": mib // 4,
             "peak_decode_bytes": None}]
    _write_run(tmp_path / "cpu", recs)
    t = _rows(tmp_path / "cpu")
    assert t.loc["sd", "peak_mem_bytes"] == 530 * mib and t.loc["sd", "method_param_bytes"] == mib // 4
    assert math.isnan(t.loc["sd", "peak_decode_bytes"])
    shown = display_table(t.reset_index()).set_index("label")
    assert shown.loc["sd", "peak_mem_mib"] == "530" and shown.loc["sd", "method_param_mib"] == "0.25"
    assert shown.loc["ar", "method_param_mib"] == "0" and "peak_decode_mib" not in shown
    gpu = [{**r, "peak_decode_bytes": (3 + i) * mib} for i, r in enumerate(recs)]
    _write_run(tmp_path / "gpu", gpu)
    assert _rows(tmp_path / "gpu").loc["sd", "peak_decode_bytes"] == 6 * mib  # prompt p1's
    assert display_table(_rows(tmp_path / "gpu").reset_index()).set_index("label").loc["sd", "peak_decode_mib"] == "6"


def test_a_batch_row_is_checked_against_ar_alone():
    """matches_ar1: a greedy row decoded in a batch whose tokens differ from ar's for its prompt alone is 0, the same
    tokens 1; a prompt with no ar record at B = 1 loaded, a sampled row, and rows at B = 1 are not judged (NaN)."""
    from bench.saved import matches_alone, output_sha

    base = {"pair": "tiny", "dataset": "default", "max_new_tokens": 8, "temperature": 0.0}
    rows = [("ar", 1, "p0", [1, 2]), ("sd", 4, "p0", [1, 2]), ("pld", 4, "p0", [1, 3]), ("sd", 4, "p1", [5]),
            ("sd", 1, "p0", [1, 2])]
    df = pd.DataFrame([{**base, "method": m, "batch_size": b, "prompt_id": p, "output_sha": output_sha(ids)}
                       for m, b, p, ids in rows] + [{**base, "method": "sd", "batch_size": 4, "prompt_id": "p0",
                                                     "temperature": 0.7, "output_sha": output_sha([9])}])
    got = matches_alone(df).tolist()
    assert got[1:3] == [1.0, 0.0] and all(math.isnan(v) for v in (got[0], got[3], got[4], got[5]))


def test_a_batchs_rows_are_resampled_together():
    """The speedup's interval resamples a batch's rows as one (they share one clock): 8 rows in one batch give no
    interval however they spread, two batches of 4 one from the medians of whole batches drawn (the first twice, both,
    the second twice), and records decoded alone the prompt bootstrap as before."""
    from bench.summary import batch_groups, bootstrap_ci

    values = [1.0, 1.1, 1.2, 1.3, 2.0, 2.1, 2.2, 2.3]
    one = pd.DataFrame({"batch": [{"size": 8, "wall_s": 3.0, "new_tokens": 64}] * 8})
    two = pd.DataFrame({"batch": [{"size": 4, "wall_s": s, "new_tokens": 32} for s in (1.0, 2.0) for _ in range(4)]})
    alone = pd.DataFrame({"batch": [None] * 8})
    assert all(math.isnan(v) for v in bootstrap_ci(values, groups=batch_groups(one)))
    lo2, hi2 = bootstrap_ci(values, groups=batch_groups(two))
    lo, hi = bootstrap_ci(values, groups=batch_groups(alone))
    assert (lo2, hi2) == (pytest.approx(1.15), pytest.approx(2.15)) and (lo, hi) == bootstrap_ci(values) != (lo2, hi2)
