"""Refresh the settings block of every method's docs page (docs/methods/<name>.md) from what
``python -m bench show method=<name>`` prints now; tests/test_docs.py fails while a page differs.

    .venv/bin/python scripts/docs_settings.py
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cli import show_main  # noqa: E402
from methods.registry import known_methods  # noqa: E402


def shown(name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert show_main([f"method={name}"]) == 0
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def main() -> int:
    changed = []
    for name in known_methods():
        page = ROOT / "docs" / "methods" / f"{name}.md"
        if not page.is_file():
            continue
        text = page.read_text()
        # The fenced block right after the line that names the command.
        pattern = re.compile(rf"(`python -m bench show method={re.escape(name)}`[^\n]*\n\n```text\n)(.*?)(\n```)", re.S)
        new, n = pattern.subn(lambda m: m.group(1) + shown(name) + m.group(3), text, count=1)
        if n == 0:
            print(f"{page}: no settings block after the line naming 'python -m bench show method={name}'", file=sys.stderr)
            return 2
        if new != text:
            page.write_text(new)
            changed.append(name)
    print(f"refreshed: {', '.join(changed) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
