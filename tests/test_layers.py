"""The layers of the code, checked from its own imports (every import, lazy ones inside functions included):

    core  <-  decoding, training  <-  methods  <-  bench

A package imports only the layers below it; ``decoding`` and ``training`` are siblings that do not import each
other; no module imports itself back through others (no cycle). docs/architecture.md draws the same picture."""

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT


# Release-independent (no transformers model is loaded or called here): CI's oldest-transformers leg skips it.
pytestmark = pytest.mark.newest_only

LAYER = {"core": 0, "decoding": 1, "training": 1, "methods": 2, "bench": 3}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every project module ``path`` names in an import statement, at any depth of the file."""
    found = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # ``from pkg import mod`` names a module when pkg/mod.py exists; otherwise a name inside pkg.
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return {name for name in found if name.split(".")[0] in LAYER}


def graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (names that are not modules are cut to their module)."""
    modules = {module_name(p): p for pkg in LAYER for p in (ROOT / pkg).rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "scripts"}
    assert packages == set(LAYER), f"a package without a layer (add it to LAYER and the docs): {packages ^ set(LAYER)}"


def test_no_import_points_up_or_sideways():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            a, b = module.split(".")[0], target.split(".")[0]
            if a != b and LAYER[b] >= LAYER[a]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that point up, or between siblings: " + ", ".join(sorted(wrong))


def test_no_cycles():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(cycles)


@pytest.mark.parametrize("upward", ["from bench.runner import run", "import methods.base"])
def test_the_walk_sees_an_upward_import(tmp_path, monkeypatch, upward):
    """The check is not blind: a core module that imports the harness, at the top or inside a function, fails."""
    bad = ROOT / "core" / "_layer_probe.py"
    bad.write_text(f"def f():\n    {upward}\n")
    try:
        with pytest.raises(AssertionError, match="_layer_probe"):
            test_no_import_points_up_or_sideways()
    finally:
        bad.unlink()
