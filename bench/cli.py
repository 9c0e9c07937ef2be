"""``run`` and ``train``: Hydra-driven entry points (config groups: method, pair, dataset)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from bench.errors import BenchError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
GROUPS = ("method", "pair", "dataset")
log = logging.getLogger("bench")

# ``${bench.first:a,b}``: the first of its arguments that is set; configs/config.yaml uses it so that
# ``resume=DIR`` also names the run (or sweep) directory.
if not OmegaConf.has_resolver("bench.first"):
    OmegaConf.register_new_resolver("bench.first", lambda *args: next((a for a in args if a not in (None, "")), None))


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def check_choices(overrides: list[str]) -> None:
    """Unknown group options get one sentence listing the valid names, before Hydra or any model starts."""
    for ov in overrides:
        key, sep, value = ov.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in GROUPS or "(" in value:
            continue
        for name in value.split(","):
            if name not in choices(key):
                raise BenchError(f"unknown {key} '{name}'; choose one of: {', '.join(choices(key))}.")


def print_summary(run_dir: Path, baseline: str | None) -> None:
    """The run's summary as ``python -m bench table RUN_DIR`` prints it: the same code, on the records just written."""
    from bench import summary

    print(f"\n{summary.legend()}\n")
    print(summary.markdown(summary.run_summary(run_dir, baseline)))
    print(f"\nresults: {run_dir}")


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def _hydra_run(cfg: DictConfig) -> None:
    from bench.runner import run

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run(cfg, run_dir)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)  # SystemExit passes through Hydra's handler: one sentence, no traceback
    print_summary(run_dir, cfg.get("baseline"))


def run_main(args: list[str]) -> int:
    check_choices(args)
    sys.argv = ["python -m bench run", *args]
    _hydra_run()
    return 0


def compose(args: list[str], hydra: bool = False) -> DictConfig:
    """The config ``run`` would see for these overrides, without starting a run (for ``train``, tests);
    ``hydra=True`` keeps the ``hydra`` node (launcher, sweeper, directories)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    check_choices(args)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=args, return_hydra_config=hydra)


def group_option(group: str, name: str) -> DictConfig:
    """``configs/<group>/<name>.yaml`` as Hydra composes it for ``group=name``, its own ``defaults`` list
    included (``method/hydra_pp`` extends ``method/hydra``), e.g. the baseline's full method config.

    Inside the ``@hydra.main`` app the running Hydra composes it; elsewhere (tests calling ``bench.runner.run``
    with a composed config, scripts) Hydra is initialised on ``CONFIG_DIR`` for this one call.
    """
    from hydra import compose as hydra_compose
    from hydra.core.global_hydra import GlobalHydra

    overrides = [f"{group}={name}"]
    if not GlobalHydra.instance().is_initialized():
        return compose(overrides)[group]
    check_choices(overrides)
    return hydra_compose(config_name="config", overrides=overrides)[group]


def train_main(args: list[str]) -> int:
    """``train draft|method [overrides]``: build and cache now what ``run`` would build first: the pair's
    distilled drafts, or everything ``method=<name>`` uses (its drafts, heads, verifier, tables)."""
    what = ["draft", "method"]
    if not args or args[0] not in what:
        raise BenchError(f"say what to train: one of {', '.join(what)} (e.g. 'python -m bench train draft pair=smollm2' "
                         "or 'python -m bench train method method=medusa').")
    cfg = compose(args[1:])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from bench.models import load_pair
    from bench.validate import validate

    validate(cfg)
    from bench.registry import get_method

    # ``train draft`` loads (and so distils) every draft of the pair; ``train method`` only the drafts that
    # method uses. load_pair honours threads= as run does: training shares the machine too.
    pair = load_pair(cfg, train_if_missing=True, n_drafts=None if args[0] == "draft" else get_method(cfg.method.name).drafts)
    if args[0] == "draft":
        from decoding.distill import draft_report

        for spec in cfg.pair.get("drafts") or []:
            if spec.source == "distilled":
                print(json.dumps(draft_report(pair.target.module, spec.recipe, pair.cache), indent=2))
        return 0
    method = get_method(cfg.method.name)(cfg.method, pair)
    method.setup(train_if_missing=True)
    print(json.dumps(getattr(method, "report", {}), indent=2, default=str))
    return 0
