"""The same inputs give the same trajectory on every backend."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import to_np

import adadiag_ref as ar

NAMES = list(ar.OPTIMIZERS)


@pytest.mark.parametrize("name", NAMES)
def test_trajectory_is_backend_independent(xp, name: str) -> None:
    rng = np.random.default_rng(21)
    for shape in [(3, 5), (5, 3), (2, 2, 3)]:
        w0 = rng.standard_normal(shape)
        grads = rng.standard_normal((7, *shape))
        grads[3] = 0.0  # zero gradient on a refresh step (t = 4, T = 3)
        ref = ar.replay(name, w0, grads, lr=1e-2, update_freq=3, weight_decay=0.01)
        got = ar.replay(name, xp.asarray(w0), xp.asarray(grads), lr=1e-2, update_freq=3, weight_decay=0.01)
        assert type(got) is type(xp.asarray(w0))  # the result comes back on the same backend
        assert tuple(got.shape) == (7, *shape)
        # float64 on all backends; differences come from each backend's own LAPACK
        # and summation order, amplified by the normalisation: 1e-12 relative.
        np.testing.assert_allclose(to_np(got), ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize("name", NAMES)
def test_float32_trajectory_is_backend_independent(xp, name: str) -> None:
    rng = np.random.default_rng(22)
    w0 = rng.standard_normal((3, 5)).astype(np.float32)
    grads = rng.standard_normal((5, 3, 5)).astype(np.float32)
    ref = ar.replay(name, w0, grads, lr=1e-2, update_freq=2)
    got = ar.replay(name, xp.asarray(w0), xp.asarray(grads), lr=1e-2, update_freq=2)
    assert to_np(got).dtype == np.float32
    # float32 rounding (eps 1.2e-7) through a few normalised steps: 1e-5 relative
    np.testing.assert_allclose(to_np(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_update_traces_under_jax_jit() -> None:
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    rng = np.random.default_rng(23)
    w = rng.standard_normal((3, 4))
    g = rng.standard_normal((3, 4))
    for name in NAMES:
        cfg = ar.make_config(name, lr=1e-2)
        eager_state = ar.refresh_basis(ar.init(w, cfg), g, cfg)
        eager = ar.update(eager_state, g, cfg, w, refreshed=True)[0]
        state = ar.refresh_basis(ar.init(jnp.asarray(w), cfg), jnp.asarray(g), cfg)
        jitted = jax.jit(lambda s, g, w, r, cfg=cfg: ar.update(s, g, cfg, w, refreshed=r))
        delta, new_state = jitted(state, jnp.asarray(g), jnp.asarray(w), jnp.asarray(True))
        np.testing.assert_allclose(np.asarray(delta), eager, rtol=1e-12, atol=1e-15)
        assert int(new_state.count) == 1


def test_jax_allocates_gpu_memory_on_demand_under_pytest() -> None:
    # every xdist worker imports JAX; preallocation (75 % of the device each) made the second one run out of memory
    import os

    assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
    jax = pytest.importorskip("jax")
    del jax
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # JAX reads it at import; nothing reset it
