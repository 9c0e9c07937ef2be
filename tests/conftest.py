import logging
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"

torch.set_grad_enabled(True)

# Under pytest-xdist (CI runs `-n auto`) the workers share the cores: each gets its part of torch's threads, so that
# two workers' OpenMP pools do not spin against each other on 2 cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns the groups into nodeid suffixes
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` the tests on the real pair run on one worker: its draft is distilled once (the
    session fixture ``real_pair``, minutes on 2 cores), and its target converted once. Needs pytest < 9.2
    (pyproject.toml: 9.2 drops the suffixes, pytest-xdist issue 1386) and this hook first (checked 2026-11-28 with a
    two-group example: without ``tryfirst`` the groups added here were ignored). So do the tests on the tiny target's
    compiled forwards (the session's ``compiled_lm``) and those on ``tests/methods/test_batch.py``'s batch graphs: each
    worker that ran any of them compiled its own graphs (half a minute to a minute each time)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        for group, needs in (("real_pair", {"real_pair", "real_target"}), ("compiled_lm", {"compiled_lm"}),
                             ("batch_graphs", {"batch_graphs"})):
            if needs & fixtures:
                item.add_marker(pytest.mark.xdist_group(group))
                break


class _Deprecations(logging.Handler):
    """Collects what a library logs about deprecated use (transformers says some of it through its logger, once
    per process, not through ``warnings``)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record):
        if "deprecat" in record.getMessage().lower():
            self.seen.append(record.getMessage())


@pytest.fixture(autouse=True)
def no_library_deprecations():
    """A test whose calls make transformers log a deprecation fails (pyproject's ``filterwarnings`` does the same
    for deprecation warnings)."""
    handler = _Deprecations()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield
    logger.removeHandler(handler)
    assert not handler.seen, f"transformers logged a deprecation: {handler.seen[0]}"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """Converted models and trained parts for tests: $BENCH_CACHE when set (CI reuses it), else a temp dir."""
    return os.environ.get("BENCH_CACHE") or str(tmp_path_factory.mktemp("bench-cache"))


@pytest.fixture(scope="session")
def compose_cfg(cache_dir):
    from bench.cli import compose

    def _compose(*overrides):
        # Trainers read the smoke recipe (seconds on the tiny pair) unless a test names another.
        smoke = [] if any(o.startswith("recipe=") for o in overrides) else ["recipe=smoke"]
        return compose([f"cache_dir={cache_dir}", *smoke, *overrides])

    return _compose


@pytest.fixture(scope="session")
def tiny_pair(compose_cfg):
    from bench.models import load_pair

    return load_pair(compose_cfg("pair=tiny"))


@pytest.fixture(scope="session")
def real_target(compose_cfg):
    """The default target (SmolLM2-135M) alone, its pair's draft not loaded (nor distilled): for the real-model
    tests that run no draft model, which CI's oldest leg keeps."""
    from tests.helpers import trained_pair

    return trained_pair(compose_cfg("pair=smollm2", "device=cpu", "recipe=smoke"), n_drafts=0)


@pytest.fixture(scope="session")
def real_pair(compose_cfg):
    """The default target (SmolLM2-135M) with a draft distilled by the shipped code under the smoke recipe (about
    a minute on 2 cores): the real-pair tests check greedy equality, which holds whatever the draft's quality;
    the quick and full recipes' figures come from the README's measurements."""
    from tests.helpers import trained_pair

    return trained_pair(compose_cfg("pair=smollm2", "device=cpu", "recipe=smoke"))


@pytest.fixture(scope="session")
def looping_prompt(tiny_pair):
    """A prompt that repeats itself, then ar's own continuation of it: drafters of every kind get tokens right."""
    from tests.helpers import decode, repeating_prompt

    ids = repeating_prompt(tiny_pair)
    return ids + decode(tiny_pair, "ar", ids, max_new=30).output_ids


@pytest.fixture(scope="session")
def compiled_lm(tiny_pair):
    """The tiny target's forwards compiled per bucket of rows (core.compiled), every bucket compiled once for the
    session (half a minute on 2 cores; again after a run's ``torch._dynamo.reset()``); its cache holds the longest
    builtin prompt plus a budget."""
    from core.compiled import CompiledLM

    # Four buckets (a run's default is seven) keep the compile short; every path is still taken: padded and exact
    # buckets, and forwards beyond the largest.
    target = CompiledLM(tiny_pair.target.module, max_len=1024, buckets=(1, 4, 16, 64))
    target.warm()
    return target


@pytest.fixture(scope="session")
def compiled_drafts():
    """The draft models' compiled forwards, made the first time a test's pair has that draft: ``{id(module):
    CompiledLM}`` (each holds its module, so no id is reused)."""
    return {}


@pytest.fixture
def compiled(compiled_lm, compiled_drafts):
    """``compiled(pair)``: ``pair`` whose target (the tiny one) and draft models run through compiled forwards (the
    session's), with a role table of its own; the caches are given back after the test, whatever happened."""
    import dataclasses

    from core.compiled import CompiledLM
    from core.counting import CountedLM

    compiled_lm.warm()  # instant while its graphs live; compiles them again after a run's torch._dynamo.reset()
    used = [compiled_lm]

    def _counted(lm: CountedLM, graphs: CompiledLM) -> CountedLM:
        counted = CountedLM(lm.module, lm.role)
        counted.compiled = graphs
        return counted

    def _compiled(pair):
        assert pair.target.module is compiled_lm.module
        drafts = []
        for draft in pair.drafts:
            # A draft's forwards: one-token steps, small trees and cascade's feeds within 8 rows; prompts beyond.
            if id(draft.module) not in compiled_drafts:
                compiled_drafts[id(draft.module)] = CompiledLM(draft.module, 1024, (1, 8), role=draft.role)
            graphs = compiled_drafts[id(draft.module)]
            graphs.warm()  # as the target's above
            used.append(graphs)
            drafts.append(_counted(draft, graphs))
        return dataclasses.replace(pair, target=_counted(pair.target, compiled_lm), drafts=drafts, roles={})

    yield _compiled
    for graphs in used:
        graphs.release()
