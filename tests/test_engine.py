"""The in-place engine of ``adadiag-ref bench`` (adadiag_ref.perf.engine) against the functional reference.

The engine keeps AdaDiag's state in preallocated float32 buffers and runs its
elementwise passes as numba kernels; the reference is ``ar.update`` on the same
``P``, ``G`` and ``W``.  Same formulas, same order, same BLAS calls, so the
parameters must agree bit for bit after several steps.
"""

from __future__ import annotations

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref import _kernels
from adadiag_ref.memory import ParamSpec
from adadiag_ref.optim.families.adam import AdamState

pytestmark = pytest.mark.skipif(not _kernels.AVAILABLE, reason="numba is not installed")
pytest.importorskip("threadpoolctl")  # the bench extra: the engine sets BLAS threads for its GEMM phases


@pytest.mark.parametrize("parallel", [False, True])
def test_adadiag_engine_equals_functional_update(parallel: bool) -> None:
    from adadiag_ref.perf.engine import AdaDiagEngine

    specs = [ParamSpec("blocks.0.q", (24, 40), "block"), ParamSpec("blocks.0.down", (40, 24), "block")]
    eng = AdaDiagEngine(specs, lr=1e-2, parallel_elementwise=parallel)
    cfg = ar.make_config("adadiag", lr=1e-2, update_freq=None)
    reference = []
    for it in eng.items:
        m, n = it["W"].shape
        state = AdamState(count=np.zeros((), np.int32), P=it["P"].copy(), Q=None,
                          M=np.zeros((m, n), np.float32), V=np.zeros((m, n), np.float32))  # fmt: skip
        reference.append([state, it["G"].copy(), it["W"].copy()])
    for _ in range(3):
        eng.step()
        for item in reference:
            delta, item[0] = ar.update(item[0], item[1], cfg, item[2])
            item[2] = item[2] + delta
    for it, (state, _, w) in zip(eng.items, reference, strict=True):
        np.testing.assert_array_equal(it["W"], w)
        np.testing.assert_array_equal(it["M"], state.M)
        np.testing.assert_array_equal(it["V"], state.V)


def _mixed_specs() -> list[ParamSpec]:
    shapes = [(24, 40), (40, 24), (16, 16), (16, 48), (8, 30)]
    return [ParamSpec(f"blocks.{i}.w", shape, "block") for i, shape in enumerate(shapes)]


def test_engine_gemms_run_single_threaded_on_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenBLAS's workers spin ~0.1 s after a multi-threaded call and take a core from the numba pass that follows;
    # the engine splits each GEMM phase over Python threads that call BLAS with one thread each.  The groups must be
    # in flight together: the first GEMM of each group waits at a barrier for the other group's, so an engine that
    # ran them in sequence (or on one thread) breaks the barrier, and the two threads are there whatever the load
    # (without it a worker could finish its group before the pool started a second thread).
    import threading

    from threadpoolctl import threadpool_info

    from adadiag_ref.perf.engine import AdaDiagEngine

    def blas_threads() -> set[int]:
        return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

    warm = AdaDiagEngine(_mixed_specs(), gemm_threads=1)
    warm.step()  # compiles the numba passes, which loads scipy's BLAS: the engine below then limits it too
    warm.close()  # (the GEMMs call numpy's BLAS only; without this the check depended on the tests run before)
    eng = AdaDiagEngine(_mixed_specs(), gemm_threads=2)
    assert len(eng.gemm_groups) == 2
    group_starts = {id(group[0][out]) for group in eng.gemm_groups for out in ("Gt", "D")}  # first GEMM, each phase
    both_groups_running = threading.Barrier(2, timeout=30.0)  # only an engine that serialises the groups waits it out
    calls: list[tuple[int, set[int]]] = []
    real = np.matmul

    def spy(*args: object, out: np.ndarray, **kwargs: object) -> object:
        if id(out) in group_starts:
            both_groups_running.wait()
        calls.append((threading.get_ident(), blas_threads()))
        return real(*args, out=out, **kwargs)

    before = blas_threads()
    monkeypatch.setattr(np, "matmul", spy)
    try:
        eng.step()
    finally:
        monkeypatch.setattr(np, "matmul", real)
        eng.close()
    assert len(calls) == 2 * len(_mixed_specs())
    assert len({ident for ident, _ in calls}) == 2 and threading.get_ident() not in {i for i, _ in calls}
    assert all(threads == {1} for _, threads in calls)
    assert blas_threads() == before  # restored after the step


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_engine_result_does_not_depend_on_gemm_threads(threads: int) -> None:
    from adadiag_ref.perf.engine import AdaDiagEngine

    one, many = AdaDiagEngine(_mixed_specs(), gemm_threads=1), AdaDiagEngine(_mixed_specs(), gemm_threads=threads)
    for _ in range(3):
        one.step()
        many.step()
    for a, b in zip(one.items, many.items, strict=True):
        for key in ("W", "M", "V", "D"):
            np.testing.assert_array_equal(a[key], b[key])
    one.close()
    many.close()


def test_balanced_groups_share_the_gemm_work() -> None:
    from adadiag_ref.perf.engine import AdaDiagEngine, balanced_groups

    eng = AdaDiagEngine(_mixed_specs(), gemm_threads=1)
    work = {id(it): it["P"].shape[0] ** 2 * it["G"].shape[1] for it in eng.items}
    for k in (1, 2, 3, 7):
        groups = balanced_groups(eng.items, k)
        assert sorted(id(it) for g in groups for it in g) == sorted(work)  # every matrix exactly once
        assert len(groups) == min(k, len(eng.items))
        loads = [sum(work[id(it)] for it in g) for g in groups]
        assert max(loads) - min(loads) <= max(work.values())  # largest-first greedy: within one matrix
    eng.close()
