"""The config schema, walked: every key of every registered method (and the top level, the pair and the
dataset) gets a wrong type, an out-of-range value and NaN through the real command line (in-process); each
must end in exit status 2 with one sentence naming the key, before any model loads or any file is written.
A method added later is walked with no new test."""

import typing

import pytest

from bench.__main__ import main
from bench.cli import compose, show_main, sweep_jobs
from bench.validate import RunSettings, checked
from core.schema import Settings, bounds, describe_type, rows
from methods.base import MethodSettings
from methods.registry import get_method, known_methods
from tests.helpers import ROOT

# Settings are checked before any model loads: nothing here differs under another transformers (CI's oldest leg skips it).
pytestmark = pytest.mark.newest_only

TINY = ["pair=tiny", "dataset.n_prompts=1", "max_new_tokens=2"]


def owned_leaves(node: Settings, prefix: str):
    """``(dotted key, field declaration, value, declaring class)`` of every leaf of a validated node; the declaring
    class is the one whose annotations hold the field (a training recipe's common fields: ``TrainRecipe``)."""
    for name, field in type(node).model_fields.items():
        value = getattr(node, name)
        if isinstance(value, Settings):
            yield from owned_leaves(value, f"{prefix}{name}.")
        elif isinstance(value, list) and value and isinstance(value[0], Settings):
            for i, item in enumerate(value):
                yield from owned_leaves(item, f"{prefix}{name}.{i}.")
        elif name not in ("name", "source"):  # a group option's own name / kind: chosen, not set
            declaring = next(c for c in type(node).__mro__ if name in getattr(c, "__annotations__", {}))
            yield f"{prefix}{name}", field, value, declaring


def leaves(node: Settings, prefix: str):
    """``(dotted key, field declaration, value)`` of every leaf of a validated node."""
    return ((key, field, value) for key, field, value, _ in owned_leaves(node, prefix))


def base_type(field):
    """The annotation without ``| None``."""
    args = typing.get_args(field.annotation)
    rest = [a for a in args if a is not type(None)]
    return rest[0] if type(None) in args and len(rest) == 1 else field.annotation


def bad_values(field) -> dict[str, str]:
    """Override strings each of which the declaration must refuse: ``{why: value}``."""
    kind = base_type(field)
    out = {"wrong type": "[1,2]" if kind is str else "abc"}
    b = bounds(field.metadata)
    step = 1 if kind is int else 0.5
    if "ge" in b:
        out["below range"] = str(b["ge"] - step)
    if "gt" in b:
        out["at the open bound"] = str(b["gt"])
    if "le" in b:
        out["above range"] = str(b["le"] + step)
    if any(getattr(m, "min_length", None) for m in field.metadata):
        out["too short"] = "[]"
    if kind is float:
        out["nan"], out["infinity"] = "nan", "inf"
    return out


def cases():
    """Every (group args, key, why, value) the walk tries, for every registered method and the other nodes. A field
    a settings class declares that another method's walk already tried (``TrainRecipe``'s, EAGLE's settings nested in
    KOALA's and SAMD's) is tried once more per method only, its first bad value: the path through the nesting method is
    checked, the class's own rules once (the CLI round trip costs a second each on 2 cores)."""
    tried: set[tuple] = set()
    for name in known_methods():
        node = get_method(name).check_settings({})
        nested: set[type] = set()  # classes this method reached the walk's tried fields through
        for key, field, _, owner in owned_leaves(node, "method."):
            for why, value in bad_values(field).items():
                case = (owner, key.rsplit(".", 1)[-1], why)
                if case not in tried:
                    tried.add(case)
                elif owner in nested or owner is MethodSettings:  # every method's own (by_batch): one path
                    continue
                else:
                    nested.add(owner)
                yield pytest.param([f"method={name}"], key, value, id=f"{name}:{key}:{why}")
    nodes = checked(compose(TINY))
    for group in ("", "pair", "dataset", "recipe"):
        for key, field, _ in leaves(nodes[group], f"{group}." if group else ""):
            if key.startswith("pair.target.config") or key.endswith(".config"):
                continue  # a mapping of the family config's arguments: tested below
            for why, value in bad_values(field).items():
                yield pytest.param([], key, value, id=f"{group or 'top'}:{key}:{why}")


@pytest.mark.parametrize("group,key,value", list(cases()))
def test_every_key_refuses_bad_values_in_one_sentence(group, key, value, tmp_path, capsys):
    code = main(["run", *TINY, *group, f"{key}={value}", f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"{key}={value} was accepted"
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert key.rsplit(".", 1)[-1] in err, err  # the sentence names the key
    assert not (tmp_path / "run").exists()  # nothing written: not even the run directory


def test_the_walk_covers_every_method_and_declares_every_number():
    """Every numeric setting declares a range and every setting a meaning: the walk above has something to
    try and ``show`` something to say."""
    with_settings = {m for m in known_methods()  # settings of their own, beside every method's (by_batch)
                     if any(owner is not MethodSettings for *_, owner in owned_leaves(get_method(m).check_settings({}), ""))}
    assert with_settings >= set(known_methods()) - {"ar"}  # ar has nothing to set
    assert {c.values[0][0].removeprefix("method=") for c in cases() if c.values[0]} == with_settings
    nodes = [get_method(n).check_settings({}) for n in known_methods()] + list(checked(compose(TINY)).values())
    for node in nodes:
        for key, field, _ in leaves(node, ""):
            assert field.description, f"{type(node).__name__}.{key} has no meaning"
            if base_type(field) in (int, float):
                assert bounds(field.metadata), f"{type(node).__name__}.{key} declares no range"


@pytest.mark.parametrize("override,needle", [
    ("method.recipe.num_heads=2", "tree is 4 deep but there are only 2 heads"),
    ("method.tree=[[0],[1,0]]", "tree path [1, 0] has no parent [1]"),
])
def test_cross_key_rules_are_named_validators(override, needle, capsys):
    assert main(["run", *TINY, "method=medusa", override]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["method=pld", "method.min_ngram=4"], "method=pld: min_ngram (4) must not exceed max_ngram (3)."),
    (["method=cascade", "method.k_matrix=[[1]]"], "method.k_matrix has 1 rows but pair=tiny gives 2 reviewing levels"),
    (["method=cascade", "method.k_matrix=[[4,1],[3,3]]"], "k_matrix must be a triangle of rows"),
    (["method=sd", "pair.drafts=[]"], "method=sd runs a draft model but pair=tiny has none."),
    (["method=sd", "method.adaptive=true", "method.gamma_min=5", "method.gamma_max=2"], "gamma_min (5) must not exceed"),
    (["method.unknown=1"], "unknown key method.unknown; method=sd has: name, gamma, confidence,"),
    (["+method.recipe.depth=1", "method=hydra"], "unknown key method.recipe.depth; method.recipe has: batch_size, lr, seed, epochs, num_heads,"),
    (["pair.target.config.hidden_sizes=3"], "config has keys LlamaConfig does not know: hidden_sizes"),
    (["pair.target.source=hf"], "pair.target.source='hf' is not allowed; it takes one of: hub, gguf_package, random, synthetic."),
    (["dataset.template='Q: {question}'"], "template 'Q: {question}' cannot be filled"),
    (["max_new_tokens=\"a"], "cannot parse the override 'max_new_tokens=\"a'"),
    (["dataset.source=web"], "dataset.source='web' is not allowed; it takes one of:"),
    (["baseline=nope"], "unknown method 'nope'"),
    (["method=ar", "pair.drafts=[]", "baseline=sd"], "baseline=sd: method=sd runs a draft model but pair=tiny has none."),
    (["method=hierarchy", "method.databases=[context,context]"], "databases lists one twice"),
    (["method.name=medusa"], "method.name is chosen with method=NAME"),
    (["pair.drafts.0.bogus=1"], "unknown key pair.drafts.0.bogus; pair.drafts.0 has: source, seed, family, config."),
    (["pair.target.config.num_attention_heads=3"], "LlamaConfig refuses config: The hidden size (64) is not a multiple"),
    (["resume=/etc/passwd"], "resume: '/etc/passwd' is a file"),
    (["device=cuda:7"], "device 'cuda:7' was asked for but this machine has"),
    (["-m", "method.gamma=interval(0,1)"], "is an interval, which only a search sweeper"),
    (["method=ar,sd"], "add -m to sweep over the values"),
])
def test_cross_node_and_structural_errors(args, needle, capsys):
    assert main(["run", *TINY, *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_a_category_no_prompt_has_is_refused():
    from bench.data import load_prompts
    from core.errors import BenchError

    cfg = compose(["dataset.categories=[qa,nosuch]"]).dataset
    with pytest.raises(BenchError, match="dataset.categories names 'nosuch', which no prompt has; this dataset's "
                                         "categories: conversation, math_reasoning, qa, rag, summarization, translation."):
        load_prompts(cfg, 0)


def test_valid_values_pass_and_are_typed():
    """The other side: good values pass, come back typed, and max_new_tokens falls back to the dataset's."""
    cfg = checked(compose(["pair=tiny", "method=sprinter", "method.threshold=1", "temperature=1", "top_p=0.5"]))
    assert cfg["method"].threshold == 1.0 and isinstance(cfg["method"].threshold, float)
    assert checked(compose(["dataset=gsm8k"]))[""].max_new_tokens == 256
    assert checked(compose(["dataset=gsm8k", "max_new_tokens=9"]))[""].max_new_tokens == 9
    assert checked(compose(["resume=2024"]))[""].resume == "2024"  # a folder named by a number is still text
    starting_with_s = [[f"method={m}"] for m in sorted(known_methods()) if m.startswith("s")]
    assert len(starting_with_s) >= 2 and sweep_jobs(["method=glob(s*)"]) == starting_with_s  # as Hydra expands it


@pytest.mark.parametrize("group", [*(f"method={m}" for m in known_methods()), "pair=tiny", "dataset=default", None])
def test_show_prints_every_setting_from_the_schema(group, capsys):
    assert show_main([group] if group else []) == 0
    out = capsys.readouterr().out
    if group is None:
        node, prefix = RunSettings(), ""
    else:
        g, name = group.split("=")
        node, prefix = checked(compose([group]))[g], f"{g}."
    for row in rows(node):
        if row["key"] not in ("name",):
            assert f"| {prefix}{row['key']} " in out and row["meaning"].split()[0] in out


def test_show_lists_no_methods_name_nested_in_anothers_settings(capsys):
    """A method nested in another's settings (SAM-Decoding's auxiliary pld and eagle) has its name set by the
    enclosing method: show does not offer it as a setting; the nested settings themselves are listed."""
    assert show_main(["method=samd"]) == 0
    out = capsys.readouterr().out
    assert "| method.pld.max_ngram " in out and "| method.eagle.depth " in out
    assert ".name " not in out


def test_describe_type_reads_the_declaration():
    fields = get_method("sd").Config.model_fields
    assert describe_type(fields["gamma"]) == "an integer >= 1"
    assert describe_type(fields["confidence"]) == "a number in [0, 1]"
    assert describe_type(RunSettings.model_fields["top_p"]) == "a number in (0, 1]"
    assert describe_type(RunSettings.model_fields["threads"]) == "an integer >= 1 or null"


def test_the_readme_names_every_method():
    """The README's method table has a row for every shipped method, and so does the ``method`` row of the config
    groups in docs/configuration.md (both are written by hand; methods registered from elsewhere, like the docs'
    own example, are not shipped)."""

    from methods.registry import get_method, known_methods

    root = ROOT
    table = (root / "README.md").read_text().split("\n## Methods\n", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| `")}
    groups = (root / "docs" / "configuration.md").read_text()
    row = next(line for line in groups.splitlines() if line.startswith("| `method` |"))
    shipped = [name for name in known_methods() if get_method(name).__module__.startswith("methods.")]
    assert len(shipped) >= 13 and [name for name in shipped if f"`{name}`" not in rows] == []
    assert [name for name in shipped if f"`{name}`" not in row] == []


def test_the_settings_table_in_the_docs_is_shows_output(capsys):
    """The table of top-level settings in docs/configuration.md is what ``python -m bench show`` prints: it cannot
    drift."""

    page = (ROOT / "docs" / "configuration.md").read_text()
    table = page.split("<!-- python -m bench show -->\n", 1)[1].split("\n<!-- end show -->", 1)[0]
    show_main([])
    assert table.strip() in capsys.readouterr().out
