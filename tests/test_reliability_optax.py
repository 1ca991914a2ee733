"""The optax adapter under ``jax.jit`` follows the core's keep-the-previous-basis rule (docs/reliability.md).

A refresh on a NaN/Inf gradient, or one whose decomposition fails on every rung,
must return ``P_{t-1}, Q_{t-1}`` bit for bit (as the eager ``step(check=False)``
and ``refresh_basis`` do), never the identity of a fresh state.
"""

from __future__ import annotations

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from adadiag_ref.adapters import optax as ao  # noqa: E402

from adadiag_ref import linalg  # noqa: E402
from adadiag_ref.optim.core import NonFiniteGradientWarning  # noqa: E402

SHAPE = (5, 7)
FREQ = 2  # refreshes at t = 1, 3, 5: the Inf gradient lands on the refresh step t = 3


pytestmark = pytest.mark.usefixtures("jax_x64")  # float64 for this module


def _two_finite_steps(name: str):
    """A jitted optax update and its state after a finite refresh (t = 1) and one more step (t = 2)."""
    tx = getattr(ao, name)(learning_rate=1e-2, update_freq=FREQ)
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE))}
    state = tx.init(params)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(1)
    for _ in range(2):
        grads = {"w": jnp.asarray(rng.standard_normal(SHAPE))}
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return update, state, params


def _bases(state) -> list[np.ndarray]:
    leaf = state[0].states["w"]
    return [np.asarray(b) for b in (leaf.P, leaf.Q) if b is not None]


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp", "adafacdiag_pp", "hfacdiag"])
@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_jitted_refresh_on_a_non_finite_gradient_keeps_the_previous_basis(name: str, value: float) -> None:
    update, state, params = _two_finite_steps(name)
    before = _bases(state)
    assert not any(np.array_equal(b, np.eye(b.shape[0])) for b in before)  # a real basis, not I
    g = np.random.default_rng(2).standard_normal(SHAPE)
    g[1, 2] = value
    with pytest.warns(NonFiniteGradientWarning):  # the host callback warns, as the eager path
        _, new_state = update({"w": jnp.asarray(g)}, state, params)
        jax.block_until_ready(new_state)
    assert int(new_state[0].states["w"].count) == 3  # the refresh step ran
    after = _bases(new_state)
    assert [b.tobytes() for b in after] == [b.tobytes() for b in before]
    assert not any(np.array_equal(b, np.eye(b.shape[0])) for b in after)


@pytest.mark.parametrize("name", ["adadiag", "adadiag_pp"])
def test_jitted_refresh_whose_decomposition_fails_keeps_the_previous_basis(name: str, monkeypatch) -> None:
    update, state, params = _two_finite_steps(name)
    before = _bases(state)

    def broken(*args, **kwargs):
        raise np.linalg.LinAlgError("injected: SVD did not converge")

    # every rung of the ladder fails: refresh_basis(on_failure="keep") must return P_{t-1}, Q_{t-1}
    monkeypatch.setattr(linalg, "DECOMPOSITION_LADDER", [(rung, broken) for rung, _ in linalg.DECOMPOSITION_LADDER])
    g = jnp.asarray(np.random.default_rng(2).standard_normal(SHAPE))
    with pytest.warns(linalg.DecompositionWarning):
        _, new_state = update({"w": g}, state, params)
        jax.block_until_ready(new_state)
    assert [b.tobytes() for b in _bases(new_state)] == [b.tobytes() for b in before]


@pytest.mark.parametrize("name", ["adamw", "adadiag", "adafacdiag_pp", "hfacdiag"])
def test_the_state_of_a_transposed_parameter_is_refused_under_jit(name: str) -> None:
    """(7, 9) and (9, 7) share the 7 x 9 work frame: equal field shapes, yet another parameter."""
    tx = getattr(ao, name)(learning_rate=1e-2)
    state = tx.init({"w": jnp.zeros((7, 9))})
    before = [np.asarray(x).tobytes() for x in jax.tree.leaves(state)]
    params = {"w": jnp.ones((9, 7))}
    with pytest.raises(ValueError, match=r"created for a parameter of shape \(7, 9\), not \(9, 7\)"):
        jax.jit(tx.update)(params, state, params)
    assert [np.asarray(x).tobytes() for x in jax.tree.leaves(state)] == before
