"""The runner on the tiny pair: the baseline's own config, and what each record carries."""

import json

from bench.results import read_records


def test_baseline_gets_its_own_full_method_config(compose_cfg, tmp_path):
    """``baseline=sd method=pld``: the baseline is built from configs/method/sd.yaml (gamma and all), not
    from its name alone, and the method's speedups are paired against it."""
    from bench.runner import run

    cfg = compose_cfg("pair=tiny", "method=pld", "baseline=sd", "max_new_tokens=8", "dataset.n_prompts=2", "warmup=0")
    run(cfg, tmp_path)
    records = read_records(tmp_path / "records.jsonl")
    assert sorted(r["method"] for r in records) == ["pld", "pld", "sd", "sd"]
    sd = [r for r in records if r["method"] == "sd"]
    assert all(r["method_cfg"]["gamma"] == 4 and "confidence" in r["method_cfg"] for r in sd)
    assert all(r["draft_calls"] > 0 for r in sd)  # the baseline really drafted
    assert all(r["matches_baseline"] for r in records if r["method"] == "pld")  # both lossless, greedy


def test_baseline_config_keeps_its_defaults_list():
    """hydra_pp.yaml extends hydra.yaml through a defaults list: composing it, not loading the file, gets both."""
    from bench.cli import group_option

    hpp = group_option("method", "hydra_pp")
    assert hpp.name == "hydra_pp" and hpp.recipe.loss == "teacher" and hpp.recipe.prefix_layer
    assert len(hpp.tree) == 19 and hpp.recipe.num_heads == 4  # from hydra.yaml
    assert json.loads(json.dumps(dict(group_option("method", "ar")))) == {"name": "ar"}
