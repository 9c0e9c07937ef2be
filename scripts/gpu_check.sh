#!/usr/bin/env bash
# The device check on a lent GPU machine, as it is: its own python3 with torch and transformers, our missing wheels
# carried in .whl/ (scripts/gpu_wheels.sh, run here first), the checkout on PYTHONPATH. Through the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Results land in $OUT (the tool brings them back) or results/gpu-check. Extra arguments go to scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
exec python3 scripts/gpu_check.py "$@"
