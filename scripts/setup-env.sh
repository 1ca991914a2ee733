#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv with every extra that runs on a CPU machine.
# torch is pinned first: an unpinned "torch" would pull the newest CUDA build (several GB).
# pip's output goes to a log that is shown only when an install fails, so a working set-up prints one line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${FRESH_VENV:-0}" = "1" ]; then rm -rf .venv; fi
if [ ! -x .venv/bin/python ]; then
    echo "setup-env: creating .venv (the first time downloads torch, jax and numba: a few minutes)" >&2
    "$PY" -m venv .venv
fi
. .venv/bin/activate
log=$(mktemp)
trap 'rm -f "$log"' EXIT
quiet_pip() {
    if ! python -m pip install --quiet --disable-pip-version-check "$@" >"$log" 2>&1; then
        cat "$log" >&2
        echo "setup-env: pip install $* failed (output above)" >&2
        exit 1
    fi
}
# skip pip when this pyproject.toml was already installed into this .venv (the editable install follows the sources)
stamp=.venv/.adadiag-ref-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! python -c "import adadiag_ref" 2>/dev/null; then
    python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    echo "setup-env: installing torch 2.13.0 (CPU build)" >&2
    quiet_pip "torch==2.13.0"
    echo "setup-env: installing adadiag-ref (editable) with the extras test, torch, jax, numba, bench, plot, reproduce, gpucheck" >&2
    quiet_pip -e ".[test,torch,jax,numba,bench,plot,reproduce,gpucheck]"
    # the conform-peers extra without its dependencies (pyproject.toml says why): the conformance kit's CI ports
    echo "setup-env: installing galore-torch and pytorch-optimizer (--no-deps: the conformance kit's real ports)" >&2
    quiet_pip --no-deps "galore-torch>=1.0" "pytorch-optimizer>=3.5"
    echo "$want" >"$stamp"
fi
echo "setup-env: .venv ready ($(python -c 'import adadiag_ref; print("adadiag-ref", adadiag_ref.__version__)'))" >&2
