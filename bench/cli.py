"""``run``, ``train`` and ``show``: Hydra-driven entry points (config groups: method, pair, dataset).

Every command composes its config with Hydra and checks it (:func:`bench.validate.validate`) before
anything else happens: ``run`` checks every job of a sweep before Hydra creates any run directory.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from bench.models import switch_sources
from bench.validate import GROUPS
from core.errors import BenchError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
log = logging.getLogger("bench")

# ``${bench.first:a,b}``: the first of its arguments that is set; configs/config.yaml uses it so that
# ``resume=DIR`` also names the run (or sweep) directory.
if not OmegaConf.has_resolver("bench.first"):
    OmegaConf.register_new_resolver("bench.first", lambda *args: next((a for a in args if a not in (None, "")), None))


_STORED: set[str] = set()  # ConfigStore entries made so far (methods by name, and "settings")


def register_configs() -> None:
    """The top-level defaults, every method's settings and the training recipes, from their declarations into
    Hydra's ConfigStore (``settings``, ``method/<name>``, ``recipe/<name>``), so no YAML repeats them. Called before every composition, so a
    method registered after import (a plug-in, a test) is an option too; each entry is stored once."""
    from hydra.core.config_store import ConfigStore

    from bench.validate import RunSettings
    from methods.registry import get_method, known_methods
    from training.recipes import RECIPES

    store = ConfigStore.instance()
    for name in ["settings", *(f"recipe/{r}" for r in RECIPES), *known_methods()]:
        if name in _STORED:
            continue
        if name == "settings":
            store.store(name="settings", node=RunSettings().model_dump(mode="json"))
        elif name.startswith("recipe/"):
            recipe = RECIPES[name.removeprefix("recipe/")]
            store.store(group="recipe", name=recipe.name, node=recipe.model_dump(mode="json"))
        else:
            store.store(group="method", name=name, node=get_method(name).Config(name=name).model_dump(mode="json"))
        _STORED.add(name)


def choices(group: str) -> list[str]:
    """The options of a config group: the registered methods, or the YAML files of ``configs/<group>/``."""
    from hydra.core.config_store import ConfigStore

    register_configs()
    stored = ConfigStore.instance().repo.get(group, {})
    return sorted({p.stem for p in (CONFIG_DIR / group).glob("*.yaml")} | {n.removesuffix(".yaml") for n in stored})


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
        switch_sources(cfg, list(HydraConfig.get().overrides.task))  # as compose() does for the checks before
        run(cfg, run_dir)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)  # SystemExit passes through Hydra's handler: one sentence, no traceback
    print_summary(run_dir, cfg.get("baseline"))


MULTIRUN = ("-m", "--multirun")


def run_main(args: list[str]) -> int:
    """``run [-m] [overrides]``: every job's config is checked before Hydra starts (and creates directories)."""
    overrides = [a for a in args if not a.startswith("-")]
    if all(a in MULTIRUN for a in args if a.startswith("-")):  # --cfg, --help, --info ...: Hydra answers those
        from bench.validate import validate

        added = set()  # keys composed as +key (a switched model's new keys): Hydra's own composition needs them so
        for job in sweep_jobs(overrides) if any(a in MULTIRUN for a in args) else [overrides]:
            cfg, used = composed(job)
            validate(cfg)
            added |= {a[1:].partition("=")[0] for a in used if a.startswith("+") and not a.startswith("++")}
        args = [f"+{a}" if a.partition("=")[0] in added else a for a in args]
    register_configs()  # Hydra's own composition (with --cfg, --info ... too) reads the stored settings
    sys.argv = ["python -m bench run", *args]
    _hydra_run()
    return 0


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Each job's overrides in a ``-m`` sweep: the product of every swept value, as Hydra's basic sweeper
    makes them (``a=1,2 b=x,y`` -> four jobs; ``range(..)`` and ``choice(..)`` expand too)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    check_choices(overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise BenchError(hydra_sentence(err)) from None
    values = []
    for o in parsed:
        key = o.get_key_element()
        if not o.is_sweep_override():
            values.append([o.input_line])
        elif o.value_type == ValueType.GLOB_CHOICE_SWEEP:  # glob(*) over a group's options, as Hydra expands it
            values.append([f"{key}={v}" for v in o.value().filter(choices(key.lstrip("+~")))])
        elif o.value_type == ValueType.INTERVAL_SWEEP:
            raise BenchError(f"'{o.input_line}' is an interval, which only a search sweeper (e.g. Optuna) samples; "
                             "the basic sweeper needs values: a,b,c, range(..) or choice(..).")
        else:
            values.append([f"{key}={v}" for v in o.sweep_string_iterator()])
    return [list(job) for job in itertools.product(*values)]


def hydra_sentence(err: Exception) -> str:
    """Hydra's own message about an override, as one sentence (with its cause, which says why)."""
    first = str(err).strip().splitlines()[0].rstrip(".")
    if getattr(err, "override", None):  # a parse error: say which override
        first = f"cannot parse the override '{err.override}' ({first})"
    cause = str(err.__cause__ or "").strip().splitlines()
    if cause and cause[0] not in first:
        first += f" ({cause[0].rstrip('.')})"
    if first.startswith("Ambiguous value"):
        first += " (add -m to sweep over the values, or write key=[a,b] for a list)"
    return f"{first}; see https://hydra.cc/docs/advanced/override_grammar/basic."


def compose(args: list[str], hydra: bool = False) -> DictConfig:
    """The config ``run`` would see for these overrides, without starting a run (for ``train``, tests);
    ``hydra=True`` keeps the ``hydra`` node (launcher, sweeper, directories).

    ``key=value`` for a key the config does not have is composed as ``+key=value``, so the schema's check
    answers it, naming the keys that node has (Hydra alone would only say the key is not in struct): a model's
    new source's keys (``pair.drafts.0.id`` for a draft switched to ``source=hub``) are added so too.
    """
    return composed(args, hydra)[0]


def composed(args: list[str], hydra: bool = False) -> tuple[DictConfig, list[str]]:
    """:func:`compose`, and the overrides as composed (``+`` before each key the config did not have)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import ConfigCompositionException, HydraException

    register_configs()
    check_choices(args)
    if any(a.partition("=")[0].lstrip("+~") == "method.name" for a in args):
        raise BenchError("method.name is chosen with method=NAME, not set (python -m bench show lists the methods).")
    args = list(args)
    while True:
        try:
            with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
                cfg = hydra_compose(config_name="config", overrides=args, return_hydra_config=hydra)
            switch_sources(cfg, args)
            return cfg, args
        except ConfigCompositionException as err:
            key = re.sub(r"\[(\d+)\]", r".\1", getattr(err.__cause__, "full_key", None) or "")  # drafts[0] -> drafts.0
            unknown = [i for i, a in enumerate(args) if key and a.partition("=")[0] == key]
            if "not in struct" not in str(err.__cause__) or not unknown:
                raise BenchError(hydra_sentence(err)) from None
            args[unknown[0]] = "+" + args[unknown[0]]
        except HydraException as err:
            raise BenchError(hydra_sentence(err)) from None


def train_main(args: list[str]) -> int:
    """``train store|draft|method|all [overrides]``: build and cache now what ``run`` would build first: the
    teacher stores, the pair's distilled drafts, everything ``method=<name>`` uses (its drafts, heads, verifier,
    tables), or everything every registered method (``all methods=a,b``: the named ones) uses, under the run's
    ``recipe=``."""
    what = ["store", "draft", "method", "all"]
    if not args or args[0] not in what:
        raise BenchError(f"say what to train: one of {', '.join(what)} (e.g. 'python -m bench train store tokens=200000', "
                         "'python -m bench train draft pair=smollm2', 'python -m bench train method method=medusa' or "
                         "'python -m bench train all recipe=full').")
    if args[0] == "store":
        return train_store(args[1:])
    from bench.models import draft_reports, load_pair, train_drafts, use_threads
    from bench.validate import validate_run
    from methods.registry import get_method, known_methods

    picked, args = methods_arg(args) if args[0] == "all" else (None, args)
    cfg, checked = validate_run(compose([*args[1:], "train_if_missing=true"]))  # train: build what is missing
    refuse_synthetic(cfg, args[0])
    use_threads(cfg)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # ``train draft`` and ``train all`` distil every draft of the pair; ``train method`` and ``train all
    # methods=...`` only the drafts those methods use.
    names = [cfg.method.name] if args[0] == "method" else picked or known_methods()
    every_draft = args[0] == "draft" or (args[0] == "all" and not picked)
    n_drafts = None if every_draft else max(get_method(n).drafts for n in names)
    if args[0] == "draft":
        for report in train_drafts(cfg, n_drafts, checked):
            print(json.dumps(report, indent=2))
        return 0
    start = time.perf_counter()
    pair = load_pair(cfg, n_drafts, checked)  # distils the drafts that are missing, from the target it loads
    reports = {"pair (stores and drafts)": {"seconds": round(time.perf_counter() - start, 1),
                                            "drafts": draft_reports(pair)}}
    for name in names:
        method_cls = get_method(name)
        if method_cls.drafts and not pair.drafts:  # as Method.check_pair says: a drafting method needs a draft
            log.info("%s: skipped (pair=%s has no draft)", name, pair.name)
            continue
        # ``train all``: every method with its shipped settings, one job per variant it trains (koala: both bases).
        variants = [(name, cfg.method)] if name == cfg.method.name else method_cls.variants()
        for label, settings in variants:
            method = method_cls(settings, pair)
            start = time.perf_counter()
            method.setup(train_if_missing=True)
            reports[label] = {"seconds": round(time.perf_counter() - start, 1), **getattr(method, "report", {})}
    print(json.dumps(reports if args[0] == "all" else reports.get(cfg.method.name, {}), indent=2, default=str))
    return 0


def refuse_synthetic(cfg, what: str) -> None:
    """``train`` on a synthetic pair: one sentence (random weights teach nothing; its runs use parts untrained)."""
    if cfg.pair.get("acceptance") is not None:
        raise BenchError(f"pair={cfg.pair.name} has random weights, which teach nothing: 'train {what}' trains "
                         "nothing there (a synthetic run uses its methods' parts untrained).")


def methods_arg(args: list[str]) -> tuple[list[str] | None, list[str]]:
    """``train all``'s own ``methods=a,b,...`` (the methods to train, default every registered one) and the
    other arguments, for Hydra."""
    from methods.registry import known_methods

    given = [a.partition("=")[2] for a in args if a.startswith("methods=")]
    rest = [a for a in args if not a.startswith("methods=")]
    if not given:
        return None, rest
    names = list(dict.fromkeys(n.strip() for n in given[-1].split(",") if n.strip()))
    unknown = [n for n in names if n not in known_methods()]
    if unknown or not names:
        raise BenchError(f"methods= takes method names separated by commas (e.g. 'methods=sd,medusa'); "
                         f"{'unknown: ' + ', '.join(unknown) if unknown else 'none given'}; known: "
                         f"{', '.join(known_methods())}.")
    return names, rest


def train_store(args: list[str]) -> int:
    """``train store [tokens=N] [recipe=NAME] [recipe.store.KEY=V ...] [overrides]``: build (or grow, or resume)
    the pair's teacher stores under the recipe (``training/store.py``): the train split to ``recipe.tokens``
    and the held-out split to ``recipe.eval_tokens``; prints what they hold and what labelling cost."""
    from bench.models import load_pair, use_threads
    from bench.validate import validate_run

    # ``tokens=N`` is short for ``recipe.tokens=N``; the target is labelled unpacked, as the trainers read it.
    args = [f"recipe.{a}" if a.partition("=")[0] in ("tokens", "eval_tokens") else a for a in args]
    cfg, checked = validate_run(compose([*args, "packed_linear=false", "train_if_missing=true"]))
    refuse_synthetic(cfg, "store")
    use_threads(cfg)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pair = load_pair(cfg, 0, checked)  # no draft is loaded: only the store is built
    reports = {split: pair.teacher.store(pair.target.module, pair.tokenizer, split).report() for split in ("train", "test")}
    print(json.dumps(reports, indent=2))
    return 0


def show_main(args: list[str]) -> int:
    """``show [method=NAME] [pair=NAME] [dataset=NAME] [recipe=NAME] [overrides]``: every setting of the named groups (none
    named: the top-level settings) with its type, value and meaning, printed from the schema."""
    from tabulate import tabulate

    from bench.validate import checked
    from core.schema import rows
    from methods.registry import get_method

    nodes = checked(compose(args))
    named = [g for g in GROUPS if any(a.partition("=")[0].lstrip("+~") == g for a in args)] or [""]
    for group in named:
        node = nodes[group]
        title = f"{group}={node.name}" if group else "top-level settings"
        owner = get_method(node.name) if group == "method" else type(node)
        doc = (sys.modules[owner.__module__].__doc__ if group == "method" else owner.__doc__ or "").replace("``", "")
        doc = doc.strip().splitlines()
        print(f"\n{title}" + (f": {doc[0]}" if doc else ""))
        prefix = f"{group}." if group else ""
        table = [[prefix + r["key"], r["type"], _value(r["value"]), r["meaning"]] for r in rows(node) if r["key"] != "name"]
        print(tabulate(table, headers=["key", "type", "value", "meaning"], tablefmt="github"))
    if named == [""]:
        print("\ngroups: " + "; ".join(f"{g}: {', '.join(choices(g))}" for g in GROUPS))
    return 0


def _value(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
