#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv with every extra that runs on a CPU machine.
# torch is pinned first: an unpinned "torch" would pull the newest CUDA build (several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${FRESH_VENV:-0}" = "1" ]; then rm -rf .venv; fi
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test,torch,jax,numba,plot,reproduce]"
