"""The numba fast path (adadiag_ref._kernels), which the engine runs, against the reference NumPy path.

The engine's routes are selected through the config option ``kernels`` (``"numba"``, ``"auto"`` and
``"reference"``), the only switch the library has; the reference (``ar.update``, ``ar.step``) never takes one.

Both paths compute the same formulas in the same order; only the positive sums
``sum(G~^2 + eps)`` and ``sum(U^2)`` are accumulated sequentially by the kernels
instead of pairwise by NumPy, which changes the result by O(n eps) relative.
Over 12 steps in float64 that stays far below rtol = 1e-12 (4 orders of
magnitude of margin at n <= 64).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import routed_replay
from hypothesis import given, settings
from hypothesis import strategies as st

import adadiag_ref as ar
from adadiag_ref import _kernels
from adadiag_ref.optim.core import prepare_step
from adadiag_ref.optim.engine import routed_direction, routed_update
from adadiag_ref.optim.families.adafactor import numba_route as adafactor_kernels
from adadiag_ref.optim.families.adam import group_route
from adadiag_ref.optim.families.adam import numba_route as adam_kernels
from adadiag_ref.optim.families.hfac import numba_route as hfac_kernels

pytestmark = pytest.mark.skipif(not _kernels.AVAILABLE, reason="numba is not installed")

RTOL = 1e-12


def _replay(name: str, fast: bool, w0: np.ndarray, grads: np.ndarray, **kw: object) -> np.ndarray:
    """The trajectory by the numba routes (the engine's per-parameter step) or by the reference (``ar.replay``)."""
    if fast:
        return routed_replay(name, w0, grads, kernels="numba", **kw)
    return np.asarray(ar.replay(name, w0, grads, **kw))


@pytest.mark.parametrize("name", list(ar.OPTIMIZERS))
@pytest.mark.parametrize("shape", [(6, 9), (9, 6), (7,), (2, 3, 4)])
def test_fast_path_equals_generic_float64(name: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(shape)
    grads = rng.standard_normal((12, *shape))
    grads[5] = 0.0
    kw = dict(lr=3e-2, betas=(0.9, 0.99), weight_decay=0.05, update_freq=4)
    fast = _replay(name, True, w0, grads, **kw)
    slow = _replay(name, False, w0, grads, **kw)
    scale = float(np.max(np.abs(slow)))
    np.testing.assert_allclose(fast, slow, rtol=RTOL, atol=RTOL * scale)


@pytest.mark.parametrize("options", [dict(momentum=False), dict(clip_threshold=None), dict(beta2_schedule="adafactor")])
def test_fast_path_adafactor_options(options: dict) -> None:
    rng = np.random.default_rng(4)
    w0 = rng.standard_normal((5, 8))
    grads = rng.standard_normal((6, 5, 8))
    for name in ("adafactor", "adafacdiag"):
        fast = _replay(name, True, w0, grads, lr=1e-2, **options)
        slow = _replay(name, False, w0, grads, lr=1e-2, **options)
        np.testing.assert_allclose(fast, slow, rtol=RTOL, atol=RTOL * float(np.max(np.abs(slow))))


def test_fast_path_float32_close() -> None:
    # float32: same formulas, rounding differs by a few ulps per step; rtol 1e-5 as everywhere in float32.
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal((16, 24)).astype(np.float32)
    grads = rng.standard_normal((8, 16, 24)).astype(np.float32)
    for name in ("adamw", "adadiag", "adafacdiag", "hfacdiag"):
        fast = _replay(name, True, w0, grads, lr=1e-3)
        slow = _replay(name, False, w0, grads, lr=1e-3)
        assert fast.dtype == np.float32
        np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-6)


KERNEL_FUNCTIONS = (
    (adam_kernels, "adam_direction"),
    (adafactor_kernels, "adafactor_direction"),
    (hfac_kernels, "hfac_direction"),
    (adam_kernels, "adam_moments_inplace"),
    # the fused Adam route of ``update`` (optim/families/adam/numba_route.py)
    (adam_kernels, "adam_delta_flat"),
    (adam_kernels, "adam_delta_flat_parallel"),
    (adam_kernels, "adam_moments_over_flat"),
    (adam_kernels, "adam_moments_over_flat_parallel"),
)


def _spy_on_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every call of a family kernel (the real kernel still runs)."""
    calls: list[str] = []
    for module, fname in KERNEL_FUNCTIONS:
        real = getattr(module, fname)

        def spy(*args: object, _real=real, _name=fname) -> object:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(module, fname, spy)
    return calls


@pytest.mark.parametrize("name", list(ar.OPTIMIZERS))
@pytest.mark.parametrize("path", ["update", "update_in_place", "engine"])
def test_kernels_option_selects_the_code_that_runs(name: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the reference (update, update_in_place) never enters a numba kernel; the engine's step does unless
    # kernels="reference" ("numba" and "auto", numba installed)
    calls = _spy_on_kernels(monkeypatch)
    rng = np.random.default_rng(9)
    w0, g = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    for kernels in ("reference", "numba", "auto"):
        calls.clear()
        cfg = ar.make_config(name, kernels=kernels)
        state, w = ar.init(w0, cfg), w0.copy()
        state = ar.refresh_basis(state, g, cfg)
        if path == "update_in_place":
            ar.update_in_place(state, g, cfg, w, refreshed=True)
        elif path == "update":
            ar.update(state, g, cfg, w, refreshed=True)
        else:
            routed_update(state, g, cfg, w, None, True, 0, np)
        assert bool(calls) == (path == "engine" and kernels != "reference"), (kernels, calls)


def test_kernels_option_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="kernels must be one of 'auto', 'numba', 'reference', got 'numpy'"):
        ar.make_config("adadiag", kernels="numpy")
    monkeypatch.setattr("adadiag_ref.config.numba_available", lambda: False)
    with pytest.raises(ValueError, match=r'kernels="numba" needs numba, which is not installed'):
        ar.make_config("adadiag", kernels="numba")
    assert ar.make_config("adadiag", kernels="auto").kernels == "auto"  # auto falls back, never raises


def test_usable_needs_one_float_numpy_dtype() -> None:
    assert _kernels.usable(np, np.zeros((2, 2)), None, np.zeros(2))
    assert not _kernels.usable(np, np.zeros((2, 2), dtype=np.float16))
    assert not _kernels.usable(np, np.zeros((2, 2)), np.zeros(2, dtype=np.float32))


def test_adam_kernel_allocates_only_its_outputs() -> None:
    # Peak extra memory of the fused direction: the three outputs M, V, U and nothing else
    # (the unfused NumPy expression allocates ~4 more temporaries of the same size).
    m, n = 256, 512
    rng = np.random.default_rng(6)
    g, M0, V0 = (rng.standard_normal((m, n)).astype(np.float32) for _ in range(3))
    V0 = np.abs(V0)
    adam_kernels.adam_direction(M0, V0, g, 0.9, 0.999, 1e-8)  # compile outside the measurement
    tracemalloc.start()
    outs = adam_kernels.adam_direction(M0, V0, g, 0.9, 0.999, 1e-8)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    matrix = g.nbytes
    assert peak <= 3 * matrix + 64 * 1024
    del outs


def test_bench_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    # Not a timed test: only checks that the benchmark runs end to end on tiny shapes.
    from adadiag_ref.perf.cli import main

    assert main(["bench", "--quick", "--reps", "1", "--no-torch", "--no-refresh"]) == 0
    out = capsys.readouterr().out
    assert "roofline" in out and "AdaDiag" in out


def test_bench_call_log_notes_a_dominant_first_call_and_a_wide_spread() -> None:
    # Not timed: the recorded seconds are set by hand, the note is what the table prints under a row.
    from adadiag_ref.perf.bench import CallLog

    log = CallLog(lambda: None, warmup=1)
    log.seconds = [0.1657, 0.0010, 0.0011, 0.0012]  # the first call 150x the median (issue 26's fused row)
    note = log.note(0.0011)
    assert note is not None and "first call 165.7 ms, 151x the median" in note and "not in the median" in note
    log.seconds = [0.0012, 0.0010, 0.0050]  # a steady first call, timed calls 5x apart
    assert log.note(0.003) == "timed calls from 1.0 to 5.0 ms (the machine was not steady: rerun on an idle one)"
    log.seconds = [0.0012, 0.0010, 0.0011]
    assert log.note(0.00105) is None
    assert CallLog(lambda: 7, warmup=0)() == 7


def test_bench_rows_are_warmed_up_and_their_notes_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not timed: with FIRST_CALL_FACTOR = 0 every logged row is "dominated" by its first call, so each must
    # carry a mark and a note; the logs show the warm-up calls that came before the timed ones.
    pytest.importorskip("threadpoolctl")
    from adadiag_ref.perf import bench

    monkeypatch.setattr(bench, "FIRST_CALL_FACTOR", 0.0)
    lines: list[str] = []
    res = bench.run(quick=True, reps=2, use_torch=False, refresh=False, functional=False, out=lines.append)
    calls = {key: len(seconds) for key, seconds in res["calls_s"].items()}
    assert calls == {"adamw_engine": 1 + 2, "adadiag_engine": 2 + 2}  # warm-up calls + timed calls
    text = "\n".join(lines)
    for row in ("AdamW ar.Engine (what a NumPy loop runs)", "AdaDiag ar.Engine (what a NumPy loop runs)"):
        (line,) = [x for x in lines if x.startswith(row)]
        mark = line.rsplit("  ", 1)[-1]
        assert re.fullmatch(r"\[\d\]", mark), line
        assert f"  {mark} {row}: first call " in text


def test_bench_torch_adapter_row_runs_from_the_repository_root() -> None:
    # The adapter row was missing because `adadiag_ref.adapters` did not resolve from a checkout;
    # the bench registers it from `adapters/` (tests run from the repository root).
    pytest.importorskip("torch")
    from adadiag_ref.memory import llama_parameters
    from adadiag_ref.perf import bench

    assert hasattr(bench.import_torch_adapter(), "AdaDiag")
    steps = bench.torch_adapter_steps(llama_parameters(bench.QUICK))
    assert bench.median_time(steps["adapter"], 1) > 0 and bench.median_time(steps["core"], 1) > 0


def test_bench_torch_adapter_ratio_is_a_median_of_per_round_ratios() -> None:
    # Not timed: checks the bookkeeping of the interleaved measurement (one ratio per round, their median).
    pytest.importorskip("torch")
    import statistics

    from adadiag_ref.memory import llama_parameters
    from adadiag_ref.perf import bench

    res = bench.torch_adapter_ratio(llama_parameters(bench.QUICK), reps=3, warmup=1, pause=0.0)
    assert len(res["ratios"]) == 3 and res["ratio"] == statistics.median(res["ratios"])
    assert res["adapter"] > 0 and res["direct"] > 0


def test_bench_paper_rule_rotates_only_block_matrices() -> None:
    from adadiag_ref.memory import llama_parameters
    from adadiag_ref.perf.params import is_rotated

    specs = llama_parameters("llama-60m")
    rotated = [s for s in specs if is_rotated(s, "paper")]
    assert len(rotated) == 8 * 7 and all(s.role == "block" for s in rotated)
    assert sum(is_rotated(s, "all") for s in specs) == 8 * 7 + 2  # plus embedding and LM head


def test_parallel_inplace_kernels_equal_serial() -> None:
    # Same elementwise formulas, only the rows are split over threads: results must be identical.
    rng = np.random.default_rng(10)
    g = rng.standard_normal((33, 70)).astype(np.float32)
    outs = []
    for moments, update in (
        (adam_kernels.adam_moments_inplace, _kernels.scale_direction_flat),
        (adam_kernels.adam_moments_inplace_parallel, _kernels.scale_direction_flat_parallel),
    ):
        M = np.full_like(g, 0.1)
        V = np.full_like(g, 0.2)
        U = np.empty_like(g)
        W = np.empty_like(g)
        f = np.float32
        moments(M, V, g, f(0.9), f(0.1), f(0.99), f(0.01), f(1e-8), M, V, U)
        W[...] = U
        update(W.reshape(-1), np.ones_like(g).reshape(-1), f(-1e-2), f(0.1), True)
        outs.append((M, V, U, W))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


PARALLEL_PAIRS = [
    (module, name[: -len("_parallel")], name)
    for module in (_kernels, adam_kernels, group_route)
    for name in sorted(dir(module))
    if name.endswith("_parallel") and hasattr(module, name[: -len("_parallel")])
]


def test_serial_and_parallel_kernels_are_distinct_functions_to_numba() -> None:
    """numba names cache entries after ``__qualname__`` and ignores compile options in their key (numba issue
    6845): one function compiled serial and parallel must be two functions, or both load one compile."""
    assert len(PARALLEL_PAIRS) >= 6
    for module, serial_name, parallel_name in PARALLEL_PAIRS:
        serial, parallel = getattr(module, serial_name), getattr(module, parallel_name)
        assert serial.targetoptions["parallel"] is False and parallel.targetoptions["parallel"] is True
        assert serial.py_func.__qualname__ != parallel.py_func.__qualname__, serial_name
        assert serial.py_func.__code__ is parallel.py_func.__code__  # the same loop, compiled twice


def test_serial_kernel_never_loads_the_parallel_compile(tmp_path: Path) -> None:
    """Process 1 compiles (and caches) only the parallel AdamW kernel; process 2 calls the serial one, which
    must compile afresh rather than hit process 1's cache entry (it did before the fix: 11 ms per call on 64
    entries instead of ~2 us)."""
    setup = (
        "import numpy as np; from adadiag_ref.optim.families.adam import numba_route as k; "
        "a = np.ones(64, np.float32); "
        "f = np.float32; "
        "args = (a, a, a, a, f(.9), f(.1), f(.999), f(.001), f(1e-8), f(-1e-3), f(0), False, "
        "a.copy(), a.copy(), a.copy()); "
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    run = [sys.executable, "-c"]
    subprocess.run([*run, setup + "k.adam_delta_flat_parallel(*args)"], env=env, check=True)
    out = subprocess.run(
        [*run, setup + "k.adam_delta_flat(*args); s = k.adam_delta_flat.stats; "
         "print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))"],
        env=env, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert out == ["0", "1"]


# ----------------------------------------------------------------------------- the input checks' finiteness scan

_NONFINITE = (np.nan, np.inf, -np.inf)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from([np.float32, np.float64]),
    order=st.sampled_from(["C", "F"]),
    poison=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(_NONFINITE)), max_size=6),
)
def test_nonfinite_count_equals_isfinite(shape: tuple[int, ...], dtype: type, order: str, poison: list) -> None:
    """The kernel counts exactly the entries ``isfinite`` rejects, for any shape, memory order and NaN/Inf mix."""
    from adadiag_ref._xp import count_nonfinite

    a = np.asarray(np.random.default_rng(len(poison)).standard_normal(shape), dtype=dtype, order=order)
    for position, value in poison:
        if a.size:
            a.reshape(-1, order=order)[position % a.size] = value  # a view: the array is contiguous in `order`
    want = int(np.sum(~np.isfinite(a)))
    assert _kernels.nonfinite_count(a) == want
    assert count_nonfinite(a, np) == want


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nonfinite_scan_finds_one_bad_entry_in_every_stream_and_in_the_remainder(dtype: type) -> None:
    """The scan reads four quarters side by side and then the remainder: one NaN, Inf or -Inf anywhere, in arrays
    of every length mod 4, is counted once, and the finite array counts zero."""
    for size in range(0, 43):
        a = np.linspace(-1.0, 1.0, size).astype(dtype)
        assert _kernels.nonfinite_count(a) == 0
        for position in range(size):
            for value in _NONFINITE:
                b = a.copy()
                b[position] = value
                assert _kernels.nonfinite_count(b) == 1, (size, position, value)
        if size >= 2:
            b = a.copy()
            b[[0, -1]] = np.nan, np.inf
            assert _kernels.nonfinite_count(b) == 2


def test_nonfinite_count_declines_what_it_cannot_scan_and_the_generic_count_takes_over() -> None:
    from adadiag_ref._xp import count_nonfinite

    a = np.arange(24.0).reshape(4, 6)
    a[1, 2], a[3, 4] = np.nan, -np.inf
    for other in (a[:, ::2], a.astype(np.float16), a.astype(np.float32)[::2]):  # strided, or not float32/64
        assert _kernels.nonfinite_count(other) is None
        assert count_nonfinite(other, np) == int(np.sum(~np.isfinite(other)))
    assert count_nonfinite(a[:, ::2], np) == 2  # columns 2 and 4 survive the stride


def test_finiteness_check_writes_no_gradient_sized_temporary() -> None:
    """``step``'s input check only reads ``G`` (``all(isfinite(G))`` wrote a boolean array of G's size per call)."""
    from adadiag_ref._xp import count_nonfinite

    g = np.ones(1 << 20, dtype=np.float32)
    count_nonfinite(g, np)  # compiled (or loaded from the cache) outside the traced window
    tracemalloc.start()
    assert count_nonfinite(g, np) == 0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024  # a boolean G would be 1 MiB


def test_check_message_counts_every_nonfinite_entry() -> None:
    w = np.zeros((6, 9))
    cfg = ar.make_config("adadiag")
    state = ar.init(w, cfg)
    g = np.ones((6, 9))
    g[0, 0], g[2, 5], g[5, 8] = np.nan, np.inf, -np.inf
    with pytest.raises(ValueError, match=r"non-finite gradient: 3 NaN or Inf entries"):
        ar.step(state, g, cfg, w)
    g[2, 5] = g[5, 8] = 1.0
    with pytest.raises(ValueError, match=r"non-finite gradient: 1 NaN or Inf entry in"):
        ar.step(state, g, cfg, w)


# ----------------------------------------------------------------------------- row kernels walk memory in order


def test_rows_in_memory_order_transposes_only_when_every_operand_is_fortran_ordered() -> None:
    c = np.zeros((3, 5))
    f = np.asfortranarray(c)
    assert all(v.flags.c_contiguous and v.shape == (5, 3) for v in _kernels.rows_in_memory_order(f, f.copy(order="F")))
    mixed = _kernels.rows_in_memory_order(f, c)
    assert mixed[0] is f and mixed[1] is c
    row = np.zeros((1, 4), order="F")  # both C- and F-contiguous: already walks in order
    assert _kernels.rows_in_memory_order(row)[0] is row


def test_adam_direction_keeps_the_memory_order_of_its_input() -> None:
    rng = np.random.default_rng(12)
    M0, V0, g = (np.asfortranarray(rng.random((30, 7))) for _ in range(3))
    outs = adam_kernels.adam_direction(M0, V0, g, 0.9, 0.999, 1e-8)
    c_outs = adam_kernels.adam_direction(*(np.ascontiguousarray(a) for a in (M0, V0, g)), 0.9, 0.999, 1e-8)
    for a, b in zip(outs, c_outs):
        assert a.flags.f_contiguous and not a.flags.c_contiguous
        np.testing.assert_array_equal(a, b)


ROW_KERNELS = (
    (adafactor_kernels, "_square_sums"),
    (adafactor_kernels, "_normalise"),
    (adafactor_kernels, "_clip"),
    (adafactor_kernels, "_clip_momentum"),
    (hfac_kernels, "_hfac_combine"),
    (adam_kernels, "adam_moments_inplace"),
    (adam_kernels, "adam_direction_flat"),  # flat views of arrays alike in memory: memory order by construction
    (adam_kernels, "adam_direction_flat_parallel"),
)


def _routed_step_result(state: object, g: np.ndarray, cfg: object, w: np.ndarray) -> np.ndarray:
    """The engine's result for one step: the Adam family's direction ``U~`` alone (its update takes the flat fused
    route, families/adam/numba_route.py; its direction the row kernel), another family's ``delta``."""
    if cfg.family == "adam":  # type: ignore[attr-defined]
        step_in = prepare_step(state, g, cfg, w, False, np)  # type: ignore[arg-type]
        return routed_direction(state, step_in.g_rot, step_in.t, cfg, np)[0]  # type: ignore[arg-type]
    return routed_update(state, g, cfg, w, None, False, None, np)[0]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "options"),
    [("adafactor", {}), ("adafactor", {"momentum": False}), ("adafacdiag", {}), ("hfac", {}), ("hfacdiag", {}),
     ("adamw", {}), ("adadiag_pp", {})],
)  # fmt: skip
def test_functional_kernels_walk_a_tall_parameter_in_memory_order(name: str, options: dict, monkeypatch) -> None:
    """Every row kernel of the functional route gets row-contiguous matrices for a tall parameter (its work frame
    is Fortran-ordered), and the result equals the generic path's."""
    rng = np.random.default_rng(13)
    w, g = rng.standard_normal((40, 6)), rng.standard_normal((40, 6))
    cfg = ar.make_config(name, lr=1e-2, kernels="numba", **options)
    state = ar.refresh_basis(ar.init(w, cfg), g, cfg)
    seen: list[str] = []
    for module, kernel in ROW_KERNELS:
        original = getattr(module, kernel)

        def spy(*args: object, _original: object = original, _name: str = kernel) -> object:
            matrices = [a for a in args if isinstance(a, np.ndarray) and a.ndim == 2]
            assert all(a.flags.c_contiguous for a in matrices), f"{_name} walks a matrix against its memory order"
            flats = [a for a in args if isinstance(a, np.ndarray) and a.ndim == 1]
            assert all(a.flags.c_contiguous for a in flats), f"{_name} walks a strided flat view"
            seen.append(_name)
            return _original(*args)  # type: ignore[operator]

        monkeypatch.setattr(module, kernel, spy)
    got = _routed_step_result(state, g, cfg, w)
    monkeypatch.undo()
    assert seen  # the route ran kernels
    want = _routed_step_result(state, g, ar.make_config(name, lr=1e-2, kernels="reference", **options), w)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.max(np.abs(want))))


# ----------------------------------------------------------------------------- issue 31: the torch route's kernels


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_route_kernels_equal_the_reference_formulas(dtype: type, decay: bool) -> None:
    """The one-pass kernels of the engine's group kernels and fused route (the unrotated step in place; the rotated
    moments in place, or into new arrays, with ``U~`` over ``G~``) equal the reference's formulas with the correctly
    rounded root, bit for bit."""
    rng = np.random.default_rng(1)
    n = 101
    W, g, M = (rng.standard_normal(n).astype(dtype) for _ in range(3))
    V = np.abs(rng.standard_normal(n)).astype(dtype)
    b1, c1, b2, c2 = _kernels.ema_coefficients(0.85, 0.995, dtype)
    eps, neg_lr, wd = (_kernels.scalar(x, dtype) for x in (1e-8, -1e-2, 0.1 if decay else 0.0))
    v = b2 * V + c2 * (g * g)
    m = b1 * M + c1 * g
    u = m / (np.sqrt(v) + eps)
    w = W + neg_lr * (u + wd * W if decay else u)

    W1, M1, V1 = W.copy(), M.copy(), V.copy()
    adam_kernels._adam_step_span(W1, g, M1, V1, b1, c1, b2, c2, eps, neg_lr, wd, decay)  # group_route.engine_step's
    for got, want in ((V1, v), (M1, m), (W1, w)):
        assert np.array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))
    M2, V2, GU2 = M.copy(), V.copy(), g.copy()
    adam_kernels.adam_moments_own_flat(M2, V2, GU2, b1, c1, b2, c2, eps)  # group_route.engine_moments's
    for got, want in ((V2, v), (M2, m), (GU2, u)):
        assert np.array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))
    newM, newV, GU = np.empty_like(M), np.empty_like(V), g.copy()
    adam_kernels.adam_moments_over_flat(M, V, GU, b1, c1, b2, c2, eps, newM, newV)
    for got, want in ((newV, v), (newM, m), (GU, u)):
        assert np.array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))
