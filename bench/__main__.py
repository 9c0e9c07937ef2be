"""Command line: ``python -m bench COMMAND [hydra overrides]``.

Commands: ``run`` (decode and measure), ``train store|draft|method|all`` (build and cache the teacher
store and trained parts; ``train all methods=sd,medusa``: only what those methods use), ``show``
(every setting with its type, default and meaning), ``table``, ``plot`` and ``report`` over saved results,
``export-specbench`` / ``import-specbench`` (Spec-Bench answer files from a run, and a run from them).
"""

from __future__ import annotations

import importlib
import logging
import sys

from core.errors import BenchError

COMMANDS = {
    "run": "bench.cli:run_main",
    "train": "bench.cli:train_main",
    "show": "bench.cli:show_main",
    "table": "bench.report_cli:table_main",
    "plot": "bench.report_cli:plot_main",
    "report": "bench.report_cli:report_main",
    "export-specbench": "bench.specbench_io:export_main",
    "import-specbench": "bench.specbench_io:import_main",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nexamples:\n  python -m bench run method=sd\n  python -m bench run -m method=ar,sd max_new_tokens=64")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"error: unknown command '{cmd}'; choose one of: {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    module, func = COMMANDS[cmd].split(":")
    try:
        fn = getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as err:
        print(f"error: command '{cmd}' is not available in this version ({err.name} is missing).", file=sys.stderr)
        return 2
    try:
        return int(fn(rest) or 0)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; finished records were kept, nothing half-written was published.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
