#!/usr/bin/env bash
# The GPU checks of one device session, as one prepared script (run on a CUDA machine, from the repo root):
#   1. `adadiag-ref bench --gpu --json` (LLaMA-60M, float32): the tables of docs/performance.md's GPU section;
#   2. benchmarks/gpu_refresh_profile.py: where one batched refresh spends its time (cProfile);
#   3. the tests marked `gpu`: first everything but the CuPy kernel battery, then the battery.
# Each stage has its own time limit (seconds, from the environment), so one that hangs leaves the others
# their time.  Logs and the JSON go to $OUT (default ./device-out).
#
# The device image has no array-api-compat or array-api-strict and not this project: `bash
# scripts/device-check.sh --prepare`, here, puts their wheels and this checkout's in .whl/ (git-ignored through
# .git/info/exclude); the device call then carries .whl and this script installs them into /tmp/site first:
#   run(command="bash scripts/device-check.sh", carry=[".whl"], timeout_s=590)  (stages: 280 + 60 + 90 + 90 s at most)
# The test logs are verbose (one line per test, as it finishes): a stage stopped at its limit still says what ran.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
    set -e
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
    rm -rf .whl && mkdir .whl
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d .whl "array-api-compat==$(python -c 'import array_api_compat as m; print(m.__version__)')" \
        "array-api-strict==$(python -c 'import array_api_strict as m; print(m.__version__)')"
    python -m pip wheel -q --no-deps --no-build-isolation . -w .whl
    ls .whl
    exit 0
fi
OUT=${OUT:-device-out}
mkdir -p "$OUT"
BENCH_S=${BENCH_S:-280}
TESTS_S=${TESTS_S:-90}
KERNELS_S=${KERNELS_S:-90}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PY" -c 'import adadiag_ref, cupy, torch, jax, numpy; print("adadiag_ref", adadiag_ref.__version__, adadiag_ref.__file__);
print("cupy", cupy.__version__, "torch", torch.__version__, "jax", jax.__version__, jax.devices(), "numpy", numpy.__version__)'
} 2>&1 | tee "$OUT/env.txt"

echo "== bench --gpu (limit ${BENCH_S}s; about 4 minutes on an H100)"
# `adadiag-ref bench --gpu --json`, with its progress bar on (it is off where stderr is no terminal), so a
# stopped run still says which row it was in; the bench starts JAX first and lets it preallocate, as documented
XLA_PYTHON_CLIENT_PREALLOCATE=true timeout "$BENCH_S" "$PY" -P -c 'import sys; from adadiag_ref.perf import gpu
gpu.run("llama-60m", json_path=sys.argv[1], progress=True)' "$OUT/gpu.json" >"$OUT/bench.txt" 2>&1
echo "bench rc $?"; tr '\r' '\n' <"$OUT/bench.txt" | grep -v '^ *$' >"$OUT/bench-lines.txt"
grep '^bench --gpu:' "$OUT/bench-lines.txt" | tail -n 1; grep -v '^bench --gpu:' "$OUT/bench-lines.txt" | tail -n 40

PROFILE_S=${PROFILE_S:-60}
echo "== where the batched refresh spends its time (limit ${PROFILE_S}s)"
timeout "$PROFILE_S" "$PY" -P benchmarks/gpu_refresh_profile.py --xp cupy --top 30 >"$OUT/refresh-profile.txt" 2>&1
echo "profile rc $?"; head -n 45 "$OUT/refresh-profile.txt"

PER_TEST=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo --timeout=100)  # a hung test fails alone
# -P: the installed package (with its adapters and pytest plugin), not the source folder
echo "== pytest -m gpu, all but the kernel battery (limit ${TESTS_S}s)"
timeout "$TESTS_S" "$PY" -P -m pytest -m gpu -v --tb=short -n 4 -p no:cacheprovider -rfE $PER_TEST \
    --junitxml="$OUT/gpu-tests.xml" --ignore=tests/test_cupy_kernels.py tests >"$OUT/tests.txt" 2>&1
echo "tests rc $?"; grep -c PASSED "$OUT/tests.txt"; tail -n 30 "$OUT/tests.txt"

echo "== pytest -m gpu tests/test_cupy_kernels.py (limit ${KERNELS_S}s)"
timeout "$KERNELS_S" "$PY" -P -m pytest -m gpu -v --tb=short -n 8 -p no:cacheprovider -rfE $PER_TEST \
    --junitxml="$OUT/gpu-kernels.xml" tests/test_cupy_kernels.py >"$OUT/kernels.txt" 2>&1
echo "kernels rc $?"; grep -c PASSED "$OUT/kernels.txt"; tail -n 30 "$OUT/kernels.txt"
date -u
