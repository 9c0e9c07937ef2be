#!/usr/bin/env bash
# The device check on a lent GPU machine, as it is: its own python3 with torch and transformers, our missing wheels
# carried in .whl/ (scripts/gpu_wheels.sh, run here first), the checkout on PYTHONPATH. Through the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Results land in /tmp/gpu-check, copied to $OUT (the tool brings them back). Extra arguments go to scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
# The device tool brings back at most 8 files from $OUT, two folders down: the check writes to /tmp, and $OUT gets its
# summary files and one archive of the run folders (the model cache left out).
work=/tmp/gpu-check
rc=0
python3 scripts/gpu_check.py --out "$work" "$@" || rc=$?
if [ -n "${OUT:-}" ]; then
  for f in summary.md check.json synthetic.csv synthetic.png walk.log gqa.csv; do [ -f "$work/$f" ] && cp "$work/$f" "$OUT/"; done
  tar czf "$OUT/runs.tgz" --exclude=cache -C "$work" . || true
fi
exit $rc
