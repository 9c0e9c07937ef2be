"""The documentation: the site under docs/ builds with mkdocs in strict mode (a broken link, an anchor that does not
exist or a page left out of the nav fails it), every shipped method has its page and its row in the README's method
table, the README's relative links point at files that exist (and at headings that exist), and the README stays
short."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from tests.helpers import ROOT

from methods.registry import get_method, known_methods

# Release-independent (no transformers model is loaded or called here): CI's oldest-transformers leg skips it.
pytestmark = pytest.mark.newest_only

README = ROOT / "README.md"
MAX_README_LINES = 220


def shipped_methods() -> list[str]:
    """Registered methods that live in ``methods/`` (not those a test registers, like the docs' own example)."""
    return [name for name in known_methods() if get_method(name).__module__.startswith("methods.")]


def readme_method_rows() -> dict[str, str]:
    """``{method name: its row}`` of the table under the README's "## Methods" heading."""
    section = README.read_text().split("\n## Methods\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if match := re.match(r"\| `(\w+)` \|", line):
            rows[match.group(1)] = line
    return rows


def anchors(page: Path) -> set[str]:
    """The ids mkdocs gives the headings of a Markdown page (its toc extension's default slugify)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M)
    return {slugify(re.sub(r"[`*]", "", heading), "-") for heading in headings}


def test_the_site_builds_in_strict_mode(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "index.html").is_file()


def test_every_method_has_a_page_and_a_readme_row():
    shipped = shipped_methods()
    rows = readme_method_rows()
    assert len(shipped) >= 18
    assert [name for name in shipped if not (ROOT / "docs" / "methods" / f"{name}.md").is_file()] == []
    assert [name for name in shipped if name not in rows] == []
    # Each row links its own page, and the table lists nothing that is not registered.
    assert [name for name, row in rows.items() if f"(docs/methods/{name}.md)" not in row] == []
    assert sorted(rows) == sorted(shipped)


def test_every_method_page_shows_its_settings(capsys):
    """Each method's page carries what ``python -m bench show method=NAME`` prints, row for row: it cannot drift."""
    from bench.cli import show_main

    stale = []
    for name in shipped_methods():
        page = (ROOT / "docs" / "methods" / f"{name}.md").read_text()
        assert show_main([f"method={name}"]) == 0
        shown = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
        if [line for line in shown if line not in page.splitlines()]:
            stale.append(name)
    assert stale == [], "refresh the pages: .venv/bin/python scripts/docs_settings.py"


def test_readme_relative_links_resolve():
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    relative = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert relative, "the README links its docs pages"
    broken = []
    for link in relative:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        if not target.is_file():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(link)
    assert broken == []


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
