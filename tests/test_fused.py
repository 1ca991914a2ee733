"""The fused Adam-family route of ``update`` (adadiag_ref.optim.fused) against the generic code.

Both compute the same formulas with the same operation order and the same BLAS
calls, so the results must be equal bit for bit (``array_equal``), in float64
and float32, on every layout (wide, tall = transposed work frame, vector,
conv, scalar), with and without weight decay, on refresh steps (the refresh-step structure)
and in between.  The generic reference is the pure NumPy code
(``kernels="reference"``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import adadiag_ref as ar
from adadiag_ref import _kernels
from adadiag_ref.optim import core
from adadiag_ref.optim.families import FAMILIES
from adadiag_ref.optim.families.adam import numba_route as fused

pytestmark = pytest.mark.skipif(not _kernels.AVAILABLE, reason="numba is not installed")

SHAPES = [(6, 9), (9, 6), (7,), (2, 3, 4), ()]


def _replay(name: str, fast: bool, w0: np.ndarray, grads: np.ndarray, **kw: object) -> np.ndarray:
    return np.asarray(ar.replay(name, w0, grads, kernels="auto" if fast else "reference", **kw))


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_fused_route_is_bit_identical(name: str, shape: tuple[int, ...], dtype: type, weight_decay: float) -> None:
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal(shape).astype(dtype)
    grads = rng.standard_normal((9, *shape)).astype(dtype)
    grads[4] = 0.0
    kw = dict(lr=3e-2, betas=(0.9, 0.99), weight_decay=weight_decay, update_freq=4)
    np.testing.assert_array_equal(_replay(name, True, w0, grads, **kw), _replay(name, False, w0, grads, **kw))


def _step_inputs(name: str, shape: tuple[int, ...], dtype: type = np.float64) -> tuple:
    rng = np.random.default_rng(8)
    cfg = ar.make_config(name, lr=1e-2, weight_decay=0.1, update_freq=None)
    w = rng.standard_normal(shape).astype(dtype)
    state = ar.init(w, cfg)
    state = ar.refresh_basis(state, rng.standard_normal(shape).astype(dtype), cfg)
    _, state = ar.update(state, rng.standard_normal(shape).astype(dtype), cfg, w)  # non-zero moments
    return state, rng.standard_normal(shape).astype(dtype), cfg, w


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
@pytest.mark.parametrize("shape", [(6, 9), (9, 6)])
def test_fused_route_is_taken_and_leaves_inputs_untouched(name: str, shape: tuple[int, ...]) -> None:
    state, grad, cfg, w = _step_inputs(name, shape)
    step_in = core.prepare_step(state, grad, cfg, w, False, np)
    taken = fused.update(state, step_in.layout, step_in.t, step_in.g_rot, step_in.w, cfg, cfg.lr,
                              core.unrotate, np)  # fmt: skip
    assert taken is not None  # otherwise the bit-identity test above compares the generic code with itself
    before = [np.copy(a) for a in (grad, w, *state[1:]) if a is not None]
    delta, new = ar.update(state, grad, cfg, w)
    after = [a for a in (grad, w, *state[1:]) if a is not None]
    for old, now in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, now)
    assert all(np.shares_memory(delta, a) is False for a in after)
    assert not np.shares_memory(new.M, state.M) and not np.shares_memory(new.V, state.V)


def test_fused_route_keeps_the_state_memory_order() -> None:
    # a tall parameter's moments are stored in the parameter's order (transposes of n x m arrays), as init makes them
    state, grad, cfg, w = _step_inputs("adadiag", (9, 6))
    _, new = ar.update(state, grad, cfg, w)
    assert new.M.flags.f_contiguous and new.V.flags.f_contiguous


@pytest.mark.parametrize("name", ["adamw", "adadiag"])
def test_parallel_kernels_are_bit_identical(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernels, "pool_does_not_spin", lambda: True)  # whatever layer this process has
    shape = (512, _kernels.PARALLEL_MIN_SIZE // 512 + 3)  # above the threshold: numba's thread pool
    state, grad, cfg, w = _step_inputs(name, shape, np.float32)
    fast = ar.update(state, grad, cfg, w)
    slow = ar.update(state, grad, dataclasses.replace(cfg, kernels="reference"), w)
    np.testing.assert_array_equal(fast[0], slow[0])
    np.testing.assert_array_equal(fast[1].M, slow[1].M)
    np.testing.assert_array_equal(fast[1].V, slow[1].V)


def test_array_lr_takes_the_generic_code() -> None:
    # an array eta (scheduled, traced) enters the generic arithmetic with its own dtype: not this route's business
    state, grad, cfg, w = _step_inputs("adadiag", (6, 9))
    step_in = core.prepare_step(state, grad, cfg, w, False, np)
    lr = np.asarray(1e-2)
    assert fused.update(state, step_in.layout, step_in.t, step_in.g_rot, step_in.w, cfg, lr,
                             core.unrotate, np) is None  # fmt: skip


# ----------------------------------------------------------------------------- replay's owned-state route


def _spy_owned(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    taken: list[int | None] = []  # per call: None (route declined) or the count of non-finite G~ entries
    real = fused.step_owned

    def spy(*args: object, **kwargs: object) -> int | None:
        taken.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return taken[-1]

    spec = FAMILIES["adam"]
    monkeypatch.setitem(FAMILIES, "adam", dataclasses.replace(spec, routes=spec.routes._replace(step_owned=(spy,))))
    return taken


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
@pytest.mark.parametrize("shape", [(6, 9), (9, 6), (2, 3, 4)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_replay_takes_the_owned_route_and_matches_step(
    name: str, shape: tuple[int, ...], dtype: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    # replay owns its state: moments in place, W_{t+1} written into the trajectory; the same bits as a step loop
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal(shape).astype(dtype)
    grads = rng.standard_normal((7, *shape)).astype(dtype)
    kw = dict(lr=3e-2, betas=(0.9, 0.99), weight_decay=0.05, update_freq=3)
    w0_copy, grads_copy = w0.copy(), grads.copy()
    taken = _spy_owned(monkeypatch)
    got = ar.replay(name, w0, grads, **kw)
    assert taken == [0] * len(grads)  # taken at every step, every G~ finite
    np.testing.assert_array_equal(w0, w0_copy)  # the inputs are never written
    np.testing.assert_array_equal(grads, grads_copy)
    cfg = ar.make_config(name, **kw)  # type: ignore[arg-type]
    state, w = ar.init(w0, cfg), w0
    for k, g in enumerate(grads):
        w, state = ar.step(state, g, cfg, w)
        np.testing.assert_array_equal(got[k], w)


def test_owned_route_is_bit_identical_on_the_thread_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernels, "pool_does_not_spin", lambda: True)  # whatever layer this process has
    taken = _spy_owned(monkeypatch)
    rng = np.random.default_rng(12)
    shape = (40, _kernels.PARALLEL_MIN_SIZE // 40 + 3)  # above the threshold: numba's thread pool
    w0 = rng.standard_normal(shape, dtype=np.float32)
    grads = rng.standard_normal((3, *shape), dtype=np.float32)
    kw = dict(lr=1e-2, weight_decay=0.1, update_freq=None)
    fast = ar.replay("adadiag", w0, grads, **kw)
    slow = ar.replay("adadiag", w0, grads, kernels="reference", **kw)
    assert taken == [0] * 3
    np.testing.assert_array_equal(fast, slow)


def test_step_with_out_updates_the_moments_in_place() -> None:
    state, grad, cfg, w = _step_inputs("adadiag", (6, 9))
    M, V = state.M, state.V
    want_w, want = ar.step(state, grad, cfg, w)  # before: step(out=) overwrites M and V
    out = np.empty_like(w)
    got, new = ar.step(state, grad, cfg, w, out=out)
    assert got is out
    assert new.M is M and new.V is V and int(new.count) == int(want.count)
    np.testing.assert_array_equal(out, want_w)
    np.testing.assert_array_equal(new.M, want.M)
    np.testing.assert_array_equal(new.V, want.V)


@pytest.mark.parametrize("name", ["adamw", "adafacdiag", "hfacdiag"])
def test_step_with_out_elsewhere_is_step(name: str) -> None:
    # unrotated parameters and the other families: step's own route, delta added into out
    state, grad, cfg, w = _step_inputs(name, (6, 9))
    want_w, want = ar.step(state, grad, cfg, w)
    out = np.empty_like(w)
    _, new = ar.step(state, grad, cfg, w, out=out)
    np.testing.assert_array_equal(out, want_w)
    for a, b in zip(new[1:], want[1:], strict=True):
        if a is not None:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["strided", "fortran"])
def test_replay_from_a_differently_laid_out_parameter_matches_step(layout: str) -> None:
    # W_0 a strided view or Fortran-ordered: the owned route does not apply to the first step (W_0 and the
    # trajectory are laid out differently), which then takes step's route; later steps read W_t from the result
    rng = np.random.default_rng(13)
    base = rng.standard_normal((6, 18))
    w0 = base[:, ::2] if layout == "strided" else np.asfortranarray(base[:, :9])
    grads = rng.standard_normal((4, 6, 9))
    got = ar.replay("adadiag", w0, grads, lr=1e-2, update_freq=2)
    cfg = ar.make_config("adadiag", lr=1e-2, update_freq=2)
    state, w = ar.init(w0, cfg), w0
    for k, g in enumerate(grads):
        w, state = ar.step(state, g, cfg, w)
        np.testing.assert_array_equal(got[k], w)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(list(ar.OPTIMIZERS)),
    shape=st.sampled_from([(1, 4), (3, 5), (5, 3), (4, 4), (2, 3, 2), (6,)]),
    dtype=st.sampled_from([np.float32, np.float64]),
    T=st.sampled_from([1, 2, None]),
    wd=st.sampled_from([0.0, 0.05]),
    seed=st.integers(0, 2**31 - 1),
)
def test_replay_equals_a_step_loop_bit_for_bit(name, shape, dtype, T, wd, seed) -> None:
    # whichever route replay takes per step (owned, or step's), its trajectory is the step loop's, bit for bit
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(shape).astype(dtype)
    grads = rng.standard_normal((5, *shape)).astype(dtype)
    got = ar.replay(name, w0, grads, lr=1e-2, weight_decay=wd, update_freq=T)
    cfg = ar.make_config(name, lr=1e-2, weight_decay=wd, update_freq=T)
    state, w = ar.init(w0, cfg), w0
    for k, g in enumerate(grads):
        w, state = ar.step(state, g, cfg, w)
        np.testing.assert_array_equal(got[k], w)


def _count_scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record every scan of a gradient by step's check (``core.count_nonfinite``)."""
    scans: list[int] = []
    real = core.count_nonfinite

    def spy(x: object, xp: object) -> int:
        scans.append(1)
        return real(x, xp)

    monkeypatch.setattr(core, "count_nonfinite", spy)
    return scans


def test_replay_counts_nonfinite_g_in_the_moments_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # A step without refresh needs no scan of G of its own: the owned route's moments pass counts G~'s NaN/Inf
    # (a non-finite G always leaves one in G~); only the refresh steps scan G first, before LAPACK
    rng = np.random.default_rng(13)
    w0, grads = rng.standard_normal((6, 9)), rng.standard_normal((8, 6, 9))
    scans = _count_scans(monkeypatch)
    ar.replay("adadiag", w0, grads, lr=1e-2, update_freq=3)
    assert len(scans) == 3  # steps 1, 4 and 7 refresh


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_replay_raises_steps_error_for_a_nonfinite_gradient_between_refreshes(name: str, value: float) -> None:
    rng = np.random.default_rng(14)
    w0, grads = rng.standard_normal((6, 9)), rng.standard_normal((6, 6, 9))
    grads[4, 2, 3] = value  # step 5: no refresh with T = 3
    cfg = ar.make_config(name, lr=1e-2, update_freq=3)
    state, w = ar.init(w0, cfg), w0
    for g in grads[:4]:
        w, state = ar.step(state, g, cfg, w)
    with pytest.raises(ValueError) as want:
        ar.step(state, grads[4], cfg, w)
    with pytest.raises(ValueError) as got:
        ar.replay(name, w0, grads, lr=1e-2, update_freq=3)
    assert str(got.value) == str(want.value) and "1 NaN or Inf entry" in str(got.value)


def test_replay_continues_like_step_when_a_finite_gradient_overflows_in_the_rotation() -> None:
    # G finite, G~ = P^T G beyond float32's range: the moments pass counts Inf, the exact check of G passes, and
    # the step goes on as step's would (Inf and NaN flowing into the moments, bit for bit)
    rng = np.random.default_rng(15)
    w0 = rng.standard_normal((6, 9)).astype(np.float32)
    grads = rng.standard_normal((3, 6, 9)).astype(np.float32)
    grads[1, :, 0] = 3e38  # every row of column 0 near float32's maximum: P^T sums them
    cfg = ar.make_config("adadiag", lr=1e-2, update_freq=None)
    state = ar.refresh_basis(ar.init(w0, cfg), grads[0], cfg)
    with np.errstate(over="ignore", invalid="ignore"):  # NumPy flags the overflow of its matmul, in both runs
        assert not np.all(np.isfinite(core.rotate(grads[1], state.P, None, np)))  # the case is what it claims
        got = ar.replay("adadiag", w0, grads, lr=1e-2, update_freq=None)
        state, w, want = ar.init(w0, cfg), w0, []
        for g in grads:
            w, state = ar.step(state, g, cfg, w)
            want.append(w)
    np.testing.assert_array_equal(got, np.stack(want))
