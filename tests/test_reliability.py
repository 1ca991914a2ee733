"""Non-finite gradients, decomposition failures and atomicity (docs/reliability.md).

Each failure listed in issue 10 is a test here; the new names are imported
inside the tests so that each test fails on its own against older code.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref import _kernels, linalg
from adadiag_ref.optim import core, inplace, rotation, tail
from adadiag_ref.optim.families.adam import reference as adam_reference

ROTATED = ("adadiag", "adadiag_pp", "adafacdiag", "adafacdiag_pp", "hfacdiag")
BAD_VALUES = (np.nan, np.inf, -np.inf)


def _snapshot(state: Any, *arrays: np.ndarray) -> list[bytes | None]:
    """Bytes of every array of a state (and of extra arrays): equal snapshots = bit-identical."""
    return [None if a is None else np.asarray(a).tobytes() for a in (*state, *arrays)]


def _poisoned(shape: tuple[int, ...], value: float, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed).standard_normal(shape)
    g[0, -1] = value
    return g


def _warmed(name: str, shape: tuple[int, int] = (6, 9), steps: int = 2, **options: Any) -> tuple[Any, Any, np.ndarray]:
    """A config, a state after ``steps`` good steps (non-identity bases) and the parameter."""
    cfg = ar.make_config(name, lr=1e-2, update_freq=2, **options)
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape)
    state = ar.init(w, cfg)
    for _ in range(steps):
        w, state = ar.step(state, rng.standard_normal(shape), cfg, w)
    return cfg, state, w


# ----------------------------------------------------------------------------- item 1: non-finite policy


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("method", ["svd", "gram", "auto"])
def test_no_decomposition_ever_sees_a_non_finite_matrix(value: float, method: str, monkeypatch) -> None:
    from adadiag_ref.linalg import NonFiniteInputError

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("LAPACK was called on a non-finite matrix")

    monkeypatch.setattr(np.linalg, "svd", forbidden)
    monkeypatch.setattr(np.linalg, "eigh", forbidden)
    for dtype in (np.float32, np.float64):
        G = _poisoned((5, 8), value).astype(dtype)
        with pytest.raises(NonFiniteInputError, match=r"NaN or Inf"):
            linalg.canonical_svd(G, compute_q=False, method=method)
        with pytest.raises(NonFiniteInputError):
            linalg.canonical_svd(G)


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("name", ROTATED)
def test_validated_step_names_cause_parameter_and_step_and_changes_nothing(name: str, value: float) -> None:
    cfg, state, w = _warmed(name)
    before = _snapshot(state, w)
    g = _poisoned(w.shape, value)
    with pytest.raises(ValueError, match=r"non-finite gradient.*'fc\.weight' \(shape \(6, 9\)\) at step 3"):
        ar.step(state, g, cfg, w, name="fc.weight")
    assert _snapshot(state, w) == before


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("name", ROTATED)
def test_unvalidated_refresh_keeps_the_previous_basis_and_warns(name: str, value: float) -> None:
    from adadiag_ref.optim.core import NonFiniteGradientWarning

    cfg, state, w = _warmed(name)  # the next step (t = 3) refreshes
    assert not np.array_equal(state.P, np.eye(state.P.shape[0]))
    before = _snapshot(state, w)
    g = _poisoned(w.shape, value)
    with pytest.warns(NonFiniteGradientWarning, match=r"'fc\.weight' \(shape \(6, 9\)\) at step 3"):
        kept = ar.refresh_basis(state, g, cfg, name="fc.weight")
    assert kept.P is state.P and kept.Q is state.Q  # the previous basis, never a silent identity
    with pytest.warns(NonFiniteGradientWarning):
        w_new, new = ar.step(state, g, cfg, w, check=False)
    assert np.array_equal(new.P, state.P)
    assert (new.Q is None and state.Q is None) or np.array_equal(new.Q, state.Q)
    # the values propagate as in Adam: the step is taken, the bad entries show up in the parameter
    assert int(new.count) == 3 and not np.all(np.isfinite(w_new))
    assert _snapshot(state, w) == before


def test_refresh_basis_can_raise_instead_and_the_first_step_warns_too() -> None:
    from adadiag_ref.optim.core import NonFiniteGradientWarning

    cfg = ar.make_config("adadiag_pp")
    w = np.ones((4, 6))
    state = ar.init(w, cfg)
    g = _poisoned(w.shape, np.inf)
    with pytest.raises(ValueError, match="NaN or Inf"):
        ar.refresh_basis(state, g, cfg, on_nonfinite="raise")
    with pytest.warns(NonFiniteGradientWarning, match="kept the previous basis"):  # P = I, but never silently
        ar.refresh_basis(state, g, cfg)


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
def test_update_and_update_in_place_propagate_non_finite_values_alike(name: str, value: float) -> None:
    """No validation in ``update``/``update_in_place``: NaN and Inf flow into M, V and W as in Adam, identically."""
    cfg, state, w = _warmed(name)
    g = _poisoned(w.shape, value)
    delta, new = ar.update(state, g, cfg, w)
    w2 = w.copy()
    state2 = type(state)(*(a.copy() if a is not None else None for a in state))
    new2 = ar.update_in_place(state2, g, cfg, w2)
    np.testing.assert_array_equal(w + delta, w2)  # NaN positions equal too
    for a, b in zip(new[1:], new2[1:]):
        if a is not None:
            np.testing.assert_array_equal(a, b)
    assert not np.all(np.isfinite(new.V))


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("name", ["adadiag", "adafacdiag", "hfacdiag"])
def test_numba_kernels_follow_the_generic_path_on_non_finite_input(name: str, value: float) -> None:

    if not _kernels.AVAILABLE:
        pytest.skip("numba not installed")
    cfg, state, w = _warmed(name)
    g = _poisoned(w.shape, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's own invalid-value warnings
        fast = ar.update(state, g, cfg.replace(kernels="numba"), w)
        slow = ar.update(state, g, cfg.replace(kernels="reference"), w)
    np.testing.assert_array_equal(np.isfinite(fast[0]), np.isfinite(slow[0]))
    for a, b in zip(fast[1][1:], slow[1][1:]):
        if a is not None:
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))


# ----------------------------------------------------------------------------- item 2: decomposition failures


def _failing_rung(kind: str, release: threading.Event | None = None) -> Any:
    def rung(G: Any, xp: Any) -> Any:
        if kind == "raise":
            raise np.linalg.LinAlgError("SVD did not converge (injected)")
        if kind == "nan":
            U, S, Vh = np.linalg.svd(np.asarray(G), full_matrices=False)
            return U * np.nan, S, Vh
        assert release is not None  # "hang": never returns within any budget the test sets
        release.wait(30.0)
        raise np.linalg.LinAlgError("released")

    return rung


@pytest.fixture
def ladder(monkeypatch):
    """The decomposition ladder, restored after the test."""
    monkeypatch.setattr(linalg, "DECOMPOSITION_LADDER", list(linalg.DECOMPOSITION_LADDER))
    previous = linalg.decomposition_budget()
    yield linalg.DECOMPOSITION_LADDER
    linalg.set_decomposition_budget(previous)


@pytest.mark.parametrize("kind", ["raise", "nan", "hang"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_failing_rung_falls_back_with_a_warning_naming_shape_and_rung(ladder, kind: str, dtype: type) -> None:
    G = np.random.default_rng(0).standard_normal((5, 7)).astype(dtype)
    ref = linalg.canonical_svd(G.astype(np.float64))
    release = threading.Event()
    ladder[0] = ("native", _failing_rung(kind, release))
    if kind == "hang":
        linalg.set_decomposition_budget(0.2)
    start = time.perf_counter()
    reason = {"raise": "did not converge", "nan": "NaN or Inf", "hang": "TimeoutError"}[kind]
    pattern = rf"'w' \(matrix shape \(5, 7\)\) failed with native \(.*{reason}.*retrying with float64-gesdd"
    try:
        with pytest.warns(linalg.DecompositionWarning, match=pattern):
            got = linalg.canonical_svd(G, label="gradient of 'w'")
    finally:
        release.set()
    assert time.perf_counter() - start < 10.0  # the budget bounds the wait: no hang
    tol = 1e-12 if dtype == np.float64 else 1e-4  # float64 rung cast to float32: float32 rounding
    assert got.P.dtype == dtype and got.Q.dtype == dtype
    np.testing.assert_allclose(got.P, ref.P, rtol=0, atol=tol)
    np.testing.assert_allclose(got.Q, ref.Q, rtol=0, atol=tol)


def test_every_rung_failing_is_a_clear_error_or_a_kept_basis(ladder) -> None:
    for i, (rung_name, _) in enumerate(list(ladder)):
        ladder[i] = (rung_name, _failing_rung("raise" if i % 2 == 0 else "nan"))
    G = np.random.default_rng(0).standard_normal((4, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", linalg.DecompositionWarning)
        with pytest.raises(linalg.DecompositionError, match=r"shape \(4, 6\) failed on every rung: native"):
            linalg.canonical_svd(G)
    cfg, state, w = _warmed("adadiag_pp", (4, 6), steps=0)
    with pytest.warns(linalg.DecompositionWarning, match=r"parameter 'emb' \(shape \(4, 6\)\) at step 1.*kept"):
        kept = ar.refresh_basis(state, G, cfg, name="emb")
    assert kept.P is state.P
    before = _snapshot(state, w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", linalg.DecompositionWarning)
        with pytest.raises(linalg.DecompositionError):
            ar.refresh_basis(state, G, cfg, on_failure="raise")
        w_new, new = ar.step(state, G, cfg, w)  # the step goes on with the previous basis
    assert _snapshot(state, w) == before
    assert np.array_equal(new.P, state.P) and int(new.count) == 1 and np.all(np.isfinite(w_new))


def test_the_ladder_is_not_entered_when_nothing_fails(ladder) -> None:
    """The reference path is the plain native SVD: bit-identical to calling it directly."""
    G = np.random.default_rng(3).standard_normal((6, 9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = linalg.canonical_svd(G)
    U, S, Vh = np.linalg.svd(G, full_matrices=False)
    want = linalg.canonicalize_svd(U, S, Vh, G.shape)
    assert np.array_equal(got.P, want.P) and np.array_equal(got.Q, want.Q)


def test_the_budget_is_validated() -> None:
    for bad in (0, -1.0, float("inf"), float("nan"), "1"):
        with pytest.raises(ValueError, match="budget"):
            linalg.set_decomposition_budget(bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- item 3: atomicity


class _Boom(RuntimeError):
    pass


def _raiser(*args: Any, **kwargs: Any) -> Any:
    raise _Boom("injected")


IN_PLACE_POINTS = [
    (inplace, "prepare_step"),
    (adam_reference, "beta_hats"),
    (adam_reference, "sqrt"),  # the library's root (adadiag_ref._xp.sqrt)
    (rotation, "unrotate"),
    (tail, "from_work"),
    (rotation, "rotate"),  # core calls it as rotation.rotate (ar.rotate is the public wrapper)
    (core, "refresh_step_structure"),
]
"""Points on ``update_in_place``'s way (the reference's arithmetic) where a failure is injected."""


@pytest.mark.parametrize("point", IN_PLACE_POINTS, ids=lambda p: f"{p[0].__name__}.{p[1]}")
@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
def test_update_in_place_is_all_or_nothing(name: str, point: tuple[Any, str], monkeypatch) -> None:
    where, attr = point
    cfg, state, w = _warmed(name, kernels="auto")  # update_in_place is the reference whatever kernels says
    g = np.random.default_rng(5).standard_normal(w.shape)
    monkeypatch.setattr(where, attr, _raiser)
    before = _snapshot(state, w, g)
    try:
        inplace.update_in_place(state, g, cfg, w, refreshed=True)
    except _Boom:
        pass
    else:  # the patched point is not on this optimizer's path (e.g. no rotation for adamw)
        assert attr in ("rotate", "refresh_step_structure", "unrotate") and name == "adamw"
        return
    assert _snapshot(state, w, g) == before


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adafacdiag", "hfacdiag"])
def test_update_in_place_refuses_a_read_only_parameter_and_changes_nothing(name: str) -> None:
    cfg, state, w = _warmed(name)
    w.flags.writeable = False
    g = np.random.default_rng(5).standard_normal(w.shape)
    before = _snapshot(state, w)
    with pytest.raises(ValueError, match="read-only"):
        ar.update_in_place(state, g, cfg, w)
    assert _snapshot(state, w) == before


STEP_POINTS = [
    (core, "check_inputs"),
    (core, "refresh_basis"),
    (core, "canonical_svd"),
    (core, "prepare_step"),
    (rotation, "rotate"),  # core calls it as rotation.rotate (ar.rotate is the public wrapper)
    (rotation, "unrotate"),
    (tail, "from_work"),  # the shared tail's, on every path of the reference
    (linalg, "canonicalize_svd"),
]


@pytest.mark.parametrize("point", STEP_POINTS, ids=lambda p: f"{p[0].__name__}.{p[1]}")
@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp", "adafacdiag", "hfacdiag"])
def test_step_failing_at_any_point_changes_nothing(name: str, point: tuple[Any, str], monkeypatch) -> None:
    cfg, state, w = _warmed(name)
    g = np.random.default_rng(5).standard_normal(w.shape)
    monkeypatch.setattr(*point, _raiser)
    before = _snapshot(state, w, g)
    with pytest.raises(_Boom):
        ar.step(state, g, cfg, w)
    assert _snapshot(state, w, g) == before


# ----------------------------------------------------------------------------- item 4: validation


@pytest.mark.parametrize("name", list(ar.OPTIMIZERS))
def test_eps_must_be_positive_in_every_family(name: str) -> None:
    for bad in (0.0, -1e-8, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            ar.make_config(name, eps=bad)
    assert ar.make_config(name, eps=1e-300).eps == 1e-300


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("weight_decay", -1e-3),
        ("betas", (1.0, 0.999)),
        ("betas", (0.9, 1.0)),
        ("betas", (-0.1, 0.999)),
        ("update_freq", 0),
        ("update_freq", 2.5),
        ("update_freq", True),
    ],
)
@pytest.mark.parametrize("name", list(ar.OPTIMIZERS))
def test_hyperparameter_ranges_are_enforced(name: str, field: str, value: Any) -> None:
    with pytest.raises(ValueError):
        ar.make_config(name, **{field: value})
