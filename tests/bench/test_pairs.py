"""Spec-Bench's pairs as configs: each pair-and-method file (``configs/pair_method/<pair>_<method>.yaml``) composes
into its method's settings when both are chosen, and nowhere else."""

import pytest
import yaml

from methods.registry import get_method, known_methods
from tests.helpers import ROOT

PAIRS = sorted(p.stem for p in (ROOT / "configs" / "pair").glob("*.yaml"))
FILES = sorted((ROOT / "configs" / "pair_method").glob("*.yaml"))


def split(stem: str) -> tuple[str, str]:
    """``vicuna7b_hydra_pp`` -> (``vicuna7b``, ``hydra_pp``): the pair is a pair config, the rest a method."""
    found = [(p, stem[len(p) + 1:]) for p in PAIRS if stem.startswith(p + "_") and stem[len(p) + 1:] in known_methods()]
    assert len(found) == 1, f"{stem}: not <pair>_<method> for exactly one pair and method"
    return found[0]


@pytest.mark.parametrize("file", FILES, ids=lambda f: f.stem)
def test_each_pair_method_file_sets_its_methods_settings(file, compose_cfg):
    pair, method = split(file.stem)
    cfg = compose_cfg(f"pair={pair}", f"method={method}")
    settings = get_method(method).check_settings(cfg.method)
    for key, value in yaml.safe_load(file.read_text()).items():
        assert getattr(settings, key) == value, (file.name, key)
    assert cfg.pair.name == pair


def test_spec_bench_runs_compose_with_the_published_drafters(compose_cfg):
    weights = {}
    for method in ("ar", "sd", "pld", "medusa", "hydra_pp", "eagle", "recycling", "hydra"):
        cfg = compose_cfg("pair=vicuna7b", f"method={method}", "dataset=spec_bench", "max_new_tokens=1024",
                          "dtype=float16")
        weights[method] = cfg.method.get("weights")
    assert weights == {"ar": None, "sd": None, "pld": None, "medusa": "FasterDecoding/medusa-vicuna-7b-v1.3",
                       "hydra_pp": "ankner/hydra-vicuna-7b-v1.3", "eagle": "yuhuili/EAGLE-Vicuna-7B-v1.3",
                       "recycling": None, "hydra": None}
    # Another pair takes none of them: the default pair's medusa trains its own heads.
    assert compose_cfg("method=medusa").method.get("weights") is None
    assert compose_cfg("pair=vicuna13b", "method=medusa").method.weights == "FasterDecoding/medusa-vicuna-13b-v1.3"
