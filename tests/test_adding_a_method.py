"""The "Adding a method" page's example (docs/adding-a-method.md), run exactly as written: its one Python block is
saved as a module and imported (registering the method with its settings), and it goes through the same checks
the registry walk and the schema walk apply to every shipped method."""

import importlib.util
import re
import sys

import pytest
from omegaconf import OmegaConf

from methods.registry import get_method
from tests.helpers import (
    ROOT,
    assert_greedy_equal_to_ar,
    assert_sampling_is_the_targets,
    decode,
    prompts_for,
    repeating_prompt,
)

PAGE = ROOT / "docs" / "adding-a-method.md"


def blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    (code,) = blocks("python")
    assert not blocks("yaml")  # one file: the settings are declared in it
    path = tmp_path_factory.mktemp("example") / "bigram.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("readme_bigram", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # its @register line adds the method
    return code, OmegaConf.create({"name": "bigram"})


def build(pair, cfg):
    method = get_method(cfg.name)(cfg, pair)  # its settings are checked and filled in from its Config
    method.setup()
    return method


def test_the_example_is_a_small_file_that_touches_nothing_in_bench(example):
    code, cfg = example
    assert len(code.splitlines()) <= 150
    assert not re.search(r"^class .*\(.*\bMethod\)|def decode\(", code, flags=re.M)  # the base owns the loop
    assert get_method(cfg.name).lossless


def test_the_example_is_lossless_greedy_and_sampled(example, tiny_pair):
    _, cfg = example
    method = build(tiny_pair, cfg)
    assert_greedy_equal_to_ar(method, prompts_for(tiny_pair, 3))
    ids = repeating_prompt(tiny_pair)
    ids = ids + decode(tiny_pair, "ar", ids, max_new=30).output_ids
    assert_sampling_is_the_targets(method, ids)


@pytest.mark.parametrize("override,needle", [
    ("method.draft_len=0", "method.draft_len=0 is not allowed; it takes an integer >= 1"),
    ("method.corpus=web", "method.corpus='web' is not allowed; it takes one of: lee, wiki, lee+wiki"),
    ("method.gamma=2", "unknown key method.gamma; method=bigram has: name, draft_len, corpus, by_batch."),
])
def test_the_example_settings_are_checked_on_the_command_line(example, override, needle, capsys):
    from bench.__main__ import main

    assert main(["run", "pair=tiny", "method=bigram", override]) == 2
    assert needle in capsys.readouterr().err


def test_the_example_is_shown(example, capsys):
    from bench.cli import show_main

    assert show_main(["method=bigram"]) == 0
    out = capsys.readouterr().out
    assert "| method.draft_len " in out and "tokens proposed per target call" in out
