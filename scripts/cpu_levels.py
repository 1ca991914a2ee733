"""Rerun the bit-asserting tests and ``adadiag-ref golden verify`` under every CPU level one machine can force.

CI runs on whatever x86-64 machine submits, so a claim of "the same bits" must not depend on the SIMD level that
NumPy, torch, numba or OpenBLAS dispatch to (docs/spec.md, "Bits across processors").  Each level below is a set of
environment variables read at import time by one library:

==========  ======================  ==================================  ================  ==================
level       ``ATEN_CPU_CAPABILITY``  ``NPY_DISABLE_CPU_FEATURES``         ``NUMBA_CPU_NAME``  ``OPENBLAS_CORETYPE``
==========  ======================  ==================================  ================  ==================
native      (the machine's)         (none)                              (the machine's)   unset: the machine's
avx2        ``avx2``                the AVX-512 groups                  ``haswell``       ``Haswell``
baseline    ``default``             AVX2 and the AVX-512 groups         ``generic``       ``Sandybridge``
==========  ======================  ==================================  ================  ==================

A level only forces kernels down, never up (code for a feature the CPU lacks is SIGILL): ``avx2`` runs on CPUs
with AVX2 and FMA only.

Usage: ``python scripts/cpu_levels.py [--levels native avx2 baseline] [--forced] [--json out.json] [pytest args...]``.
Exit status 0 when every level passes.  ``.ci/run`` runs it with ``--forced`` after the main test pass, which is
the native level already (every test, and ``golden verify``, under the machine's own dispatch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

# the tests that assert bits across routes, backends and counters (the rest assert tolerances)
BIT_TESTS = (
    "tests/test_step_coefficients.py",
    "tests/test_sqrt.py",
    "tests/test_device_traffic.py",
    "tests/test_device_canonical.py",
    "tests/test_kernels.py",
    "tests/test_inplace.py",
    "tests/test_fused.py",
    "tests/test_engine.py",
    "tests/test_optim_engine.py",
    "tests/test_adapter_torch.py",
    "tests/test_adapter_torch_routes.py",
    "tests/test_golden.py",
)

_AVX512_GROUPS = ("X86_V4", "AVX512_ICL", "AVX512_SPR", "AVX512F", "AVX512_SKX", "AVX512_CLX", "AVX512_CNL")


def _multiarray() -> Any:
    """NumPy's C module, which reports the build's SIMD dispatch list and the CPU's features."""
    try:
        from numpy._core import _multiarray_umath
    except ImportError:  # NumPy 1.x
        from numpy.core import _multiarray_umath  # type: ignore[no-redef]
    return _multiarray_umath


def _numpy_dispatch() -> list[str]:
    """The SIMD groups this NumPy build can dispatch to (names NPY_DISABLE_CPU_FEATURES accepts)."""
    return list(_multiarray().__cpu_dispatch__)


def _has_avx2() -> bool:
    """Whether this CPU runs AVX2 and FMA code (a level may only force kernels down, never up: up is SIGILL)."""
    features = _multiarray().__cpu_features__
    return bool(features.get("AVX2") and features.get("FMA3"))


def level_environments() -> dict[str, dict[str, str | None]]:
    """Each level's environment overrides (``None``: unset the variable); ``avx2`` only on a CPU that has it."""
    dispatch = _numpy_dispatch()
    avx512 = " ".join(g for g in dispatch if g in _AVX512_GROUPS or g.startswith("AVX512"))
    below_avx2 = " ".join(g for g in dispatch if g in ("X86_V3", "AVX2", "FMA3") or g in avx512.split())
    levels: dict[str, dict[str, str | None]] = {
        "native": {"OPENBLAS_CORETYPE": None, "OPENBLAS_L2_SIZE": None},
        "avx2": {
            "ATEN_CPU_CAPABILITY": "avx2",
            "NPY_DISABLE_CPU_FEATURES": avx512,
            "NUMBA_CPU_NAME": "haswell",
            "OPENBLAS_CORETYPE": "Haswell",
        },
        "baseline": {
            "ATEN_CPU_CAPABILITY": "default",
            "NPY_DISABLE_CPU_FEATURES": below_avx2,
            "NUMBA_CPU_NAME": "generic",
            "OPENBLAS_CORETYPE": "Sandybridge",
        },
    }
    if not _has_avx2():
        del levels["avx2"]
    return levels


def environment(overrides: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with a level's overrides applied (``None``: the variable unset)."""
    env = dict(os.environ)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_level(name: str, overrides: dict[str, str | None], pytest_args: list[str]) -> dict[str, object]:
    """The bit-asserting tests and the golden verification under one level; returns the outcome."""
    env = environment(overrides)
    started = time.perf_counter()
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", *BIT_TESTS, *pytest_args],
        env=env,
    )
    golden = subprocess.run([sys.executable, "-m", "adadiag_ref.cli", "golden", "verify"], env=env)
    return {
        "level": name,
        "environment": overrides,
        "tests_rc": tests.returncode,
        "golden_rc": golden.returncode,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", nargs="+", choices=list(level_environments()), default=list(level_environments()))
    parser.add_argument(
        "--forced", action="store_true", help="only the levels that force kernels down (native: a pass run already)"
    )
    parser.add_argument("--json", help="write the outcomes to this file")
    args, pytest_args = parser.parse_known_args(argv)
    environments = level_environments()
    outcomes = []
    for name in [level for level in args.levels if not (args.forced and level == "native")]:
        print(f"== cpu level {name}: {environments[name]}", flush=True)
        outcomes.append(run_level(name, environments[name], pytest_args))
    print("\nlevel     tests  golden  seconds")
    for o in outcomes:
        verdicts = ["ok" if o[key] == 0 else f"rc {o[key]}" for key in ("tests_rc", "golden_rc")]
        print(f"{o['level']:<9} {verdicts[0]:<6} {verdicts[1]:<7} {o['seconds']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(outcomes, f, indent=2)
    return 0 if all(o["tests_rc"] == 0 and o["golden_rc"] == 0 for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
