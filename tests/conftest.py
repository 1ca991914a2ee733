"""Shared fixtures: the array-API backends every core test runs on.

``xp`` runs over numpy, array_api_strict, torch (CPU), jax (x64) and cupy; a
backend that is not installed, or cupy without a GPU, is skipped.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import platform
import tempfile
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Set before any test imports JAX: on a GPU machine each pytest-xdist worker's JAX would otherwise take 75 % of
# the device at start-up, and the second worker's first allocation fails (CUDA out of memory under -n 8 on an
# H100).  Allocating on demand lets the workers share the device; a CPU machine is unaffected.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Set before any test imports torch: its OpenMP workers (libgomp) spin for a while after every parallel region,
# and under pytest-xdist (two workers on two cores) a test's second thread then waits for a core that a spinning
# worker holds (a 2-thread adapter test took 15 s instead of under 1.5 s).  Idle threads that sleep compute the same
# numbers: the wait policy decides only when a waiting thread wakes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags.  XLA compiles for the host's CPU, and JAX's cache key does not
    name it, so a cache directory must never be shared between CPUs with different features."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256((flags or platform.processor() or platform.machine()).encode()).hexdigest()[:12]


# JAX compiles each operation it runs eagerly, and each jitted function, in every process anew (about 30 ms an
# operation on the 2-core CI machine).  A persistent cache in this machine's temporary directory lets the
# pytest-xdist workers, the slow tier and the CPU levels (which force NumPy's, torch's, numba's and OpenBLAS's
# kernels, never XLA's) load what another process compiled: the same executables, so the same numbers.  Measured
# on three JAX-heavy test files: 149 s without the cache, 140 s filling it, 101 s reading it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"adadiag-ref-jax-cache-{getattr(os, 'getuid', lambda: 0)()}-{_cpu_tag()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

settings.register_profile("default", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def _load_backend(name: str) -> Any:
    if name == "numpy":
        return np
    if name == "array_api_strict":
        return pytest.importorskip("array_api_strict")
    if name == "torch":
        torch = pytest.importorskip("torch")
        from array_api_compat import torch as xp_torch

        del torch
        return xp_torch
    if name == "jax":
        jax = pytest.importorskip("jax")
        jax.config.update("jax_enable_x64", True)
        return importlib.import_module("jax.numpy")
    if name == "dask":  # lazy arrays without __dlpack__: every step a graph, computed where a value is read
        pytest.importorskip("dask")
        from array_api_compat.dask import array as xp_dask

        return xp_dask
    if name == "cupy":
        cupy = pytest.importorskip("cupy")
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                pytest.skip("no CUDA device")
        except Exception as exc:  # pragma: no cover - depends on the machine
            pytest.skip(f"no usable CUDA device: {exc}")
        return cupy
    raise ValueError(name)


@pytest.fixture(scope="module")
def jax_x64() -> Any:
    """JAX in float64 for one test module (``pytestmark = pytest.mark.usefixtures("jax_x64")``); the previous
    setting is restored after the module."""
    jax = pytest.importorskip("jax")
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


BACKENDS = ["numpy", "array_api_strict", "torch", "jax", "dask", pytest.param("cupy", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def xp(request: pytest.FixtureRequest) -> Any:
    """An array namespace; tests create arrays with ``xp.asarray(numpy_array)``."""
    return _load_backend(request.param)


def to_np(x: Any) -> np.ndarray:
    from adadiag_ref._xp import to_numpy

    return to_numpy(x)


@pytest.fixture(autouse=True)
def _registry_restored() -> Any:
    """Whatever a test (or a docs snippet, ``docs/extending.md``) registers is gone after it: the optimizer and
    family tables are the library's own again, so later tests in the same worker see the eight optimizers."""
    from adadiag_ref.config import OPTIMIZERS
    from adadiag_ref.optim.families import FAMILIES

    saved = dict(OPTIMIZERS), dict(FAMILIES)
    yield
    for table, contents in zip((OPTIMIZERS, FAMILIES), saved, strict=True):
        table.clear()
        table.update(contents)  # type: ignore[attr-defined]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``adadiag-ref argv`` in this process: ``(exit code, stdout, stderr)`` (argparse's exits included)."""
    from adadiag_ref.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors exit through SystemExit
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> str:
    """Exit code 2 and exactly one stderr line ``adadiag-ref: error: ...`` holding every fragment (no traceback);
    returns the line."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adadiag-ref: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def routed_step(state: Any, g: Any, cfg: Any, w: Any, k: int, count: int | None) -> tuple[Any, Any]:
    """Step ``k + 1`` (``k`` steps taken) by the engine's per-parameter step: the refresh when due, then
    ``routed_update`` (the families' routes, which the reference never takes); ``count`` its host counter (``None``:
    the state's).  Returns ``(W_{k+1}, state)``."""
    import adadiag_ref as ar
    from adadiag_ref.optim import namespace
    from adadiag_ref.optim.engine import routed_update

    refreshed = ar.refresh_due(k, cfg)
    if refreshed:
        state = ar.refresh_basis(state, g, cfg)
    delta, state = routed_update(state, g, cfg, w, None, refreshed, count, namespace(g, w))
    return w + delta, state


def routed_replay(name: str, w0: Any, grads: Any, **kw: Any) -> np.ndarray:
    """``ar.replay``'s trajectory through the engine's per-parameter step (:func:`routed_step`), as one NumPy
    array."""
    import adadiag_ref as ar

    cfg = ar.make_config(name, **kw)
    state, w, out = ar.init(w0, cfg), w0, []
    for k, g in enumerate(grads):
        w, state = routed_step(state, g, cfg, w, k, k)
        out.append(w)
    return np.stack(out)
