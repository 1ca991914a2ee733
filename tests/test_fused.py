"""The fused Adam-family route of ``update`` (adadiag_ref.optim.fused) against the generic code.

Both compute the same formulas with the same operation order and the same BLAS
calls, so the results must be equal bit for bit (``array_equal``), in float64
and float32, on every layout (wide, tall = transposed work frame, vector,
conv, scalar), with and without weight decay, on refresh steps (noise floor)
and in between.  The generic reference is the pure NumPy code
(``kernels="reference"``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref import _kernels
from adadiag_ref.optim import core, fused

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
    taken = fused.adam_update(state, step_in.layout, step_in.t, step_in.g_rot, step_in.w, cfg, cfg.lr,
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
    shape = (512, fused.PARALLEL_MIN_SIZE // 512 + 3)  # above the threshold: numba's thread pool
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
    assert fused.adam_update(state, step_in.layout, step_in.t, step_in.g_rot, step_in.w, cfg, lr,
                             core.unrotate, np) is None  # fmt: skip
