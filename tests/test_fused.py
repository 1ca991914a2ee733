"""The fused Adam-family route (``optim/families/adam/numba_route.py``, run by the engine's per-parameter step
``routed_update``) against the reference ``ar.update``.

Both compute the same formulas with the same operation order and the same BLAS
calls, so the results must be equal bit for bit (``array_equal``), in float64
and float32, on every layout (wide, tall = transposed work frame, vector,
conv, scalar), with and without weight decay, on refresh steps (the refresh-step structure)
and in between.  The reference never takes the route (``ar.update``, ``ar.step``, ``ar.replay``).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import routed_replay
from hypothesis import given, settings
from hypothesis import strategies as st

import adadiag_ref as ar
from adadiag_ref import _kernels
from adadiag_ref.optim import core
from adadiag_ref.optim.engine import routed_update
from adadiag_ref.optim.families.adam import numba_route as fused

pytestmark = pytest.mark.skipif(not _kernels.AVAILABLE, reason="numba is not installed")

SHAPES = [(6, 9), (9, 6), (7,), (2, 3, 4), ()]


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
    np.testing.assert_array_equal(routed_replay(name, w0, grads, **kw), np.asarray(ar.replay(name, w0, grads, **kw)))


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
    delta, new = routed_update(state, grad, cfg, w, None, False, None, np)
    after = [a for a in (grad, w, *state[1:]) if a is not None]
    for old, now in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, now)
    assert all(np.shares_memory(delta, a) is False for a in after)
    assert not np.shares_memory(new.M, state.M) and not np.shares_memory(new.V, state.V)


def test_fused_route_keeps_the_state_memory_order() -> None:
    # a tall parameter's moments are stored in the parameter's order (transposes of n x m arrays), as init makes them
    state, grad, cfg, w = _step_inputs("adadiag", (9, 6))
    _, new = routed_update(state, grad, cfg, w, None, False, None, np)
    assert new.M.flags.f_contiguous and new.V.flags.f_contiguous


@pytest.mark.parametrize("name", ["adamw", "adadiag"])
def test_parallel_kernels_are_bit_identical(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernels, "pool_does_not_spin", lambda: True)  # whatever layer this process has
    shape = (512, _kernels.PARALLEL_MIN_SIZE // 512 + 3)  # above the threshold: numba's thread pool
    state, grad, cfg, w = _step_inputs(name, shape, np.float32)
    fast = routed_update(state, grad, cfg, w, None, False, None, np)
    slow = ar.update(state, grad, cfg, w)
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


# ----------------------------------------------------------------------------- replay: the reference's step loop


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


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(list(ar.OPTIMIZERS)),
    shape=st.sampled_from([(1, 4), (3, 5), (5, 3), (4, 4), (2, 3, 2), (6,), ()]),
    dtype=st.sampled_from([np.float32, np.float64]),
    T=st.sampled_from([1, 2, None]),
    wd=st.sampled_from([0.0, 0.05]),
    betas=st.sampled_from([(0.9, 0.999), (0.0, 0.99), (0.5, 0.9)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_engines_step_equals_the_reference_for_any_shape_and_hyperparameters(
    name: str, shape: tuple[int, ...], dtype: type, T: int | None, wd: float, betas: tuple[float, float], seed: int
) -> None:
    # the routes run only in the engine: its per-parameter step against the reference, bit for bit for the Adam
    # family (the same formulas in the same order), to rounding for Adafactor and Hfac (their kernels sum the
    # factored statistics in another order; rtol as everywhere: 1e-12 in float64, 1e-5 in float32)
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(shape).astype(dtype)
    grads = rng.standard_normal((5, *shape)).astype(dtype)
    kw = dict(lr=1e-2, weight_decay=wd, update_freq=T, betas=betas)
    got = routed_replay(name, w0, grads, **kw)
    want = np.asarray(ar.replay(name, w0, grads, **kw))
    assert got.dtype == want.dtype == dtype
    if ar.make_config(name).family == "adam":
        np.testing.assert_array_equal(got, want)
    else:
        rtol = 1e-12 if dtype == np.float64 else 1e-5
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.max(np.abs(want), initial=1.0)))
