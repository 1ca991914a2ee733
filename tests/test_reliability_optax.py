"""The optax adapter under ``jax.jit`` follows the core's keep-the-previous-basis rule (docs/reliability.md).

A refresh on a NaN/Inf gradient, or one whose decomposition fails on every rung,
must return ``P_{t-1}, Q_{t-1}`` bit for bit (as the eager ``step(check=False)``
and ``refresh_basis`` do), never the identity of a fresh state.
"""

from __future__ import annotations

import contextlib

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from adadiag_ref.adapters import optax as ao  # noqa: E402

import adadiag_ref as ar  # noqa: E402
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


# ----------------------------------------------------------------------------- kept basis: same bits as ar.step

ONE_SIDED = ["adadiag", "adafacdiag", "hfacdiag"]  # one per family; ar.step on jax arrays forms the same P as the
# host callback for a full-rank G (a two-sided Q is completed by another routine on each side: not bit-comparable)


def _break_the_ladder(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise np.linalg.LinAlgError("injected: SVD did not converge")

    monkeypatch.setattr(linalg, "DECOMPOSITION_LADDER", [(rung, broken) for rung, _ in linalg.DECOMPOSITION_LADDER])


def _kept_basis_gradient(fault: str, P: np.ndarray) -> np.ndarray:
    """Step 3's gradient.  ``"inf"``: Inf in one entry (applied with the kept basis, the refresh-step structure
    would find no finite row norm and zero all of ``G~``).  ``"decomposition"``: finite, in the span of the kept
    ``P``'s first two columns, so ``P^T G`` has three rows of pure rounding noise that the structure would zero."""
    rng = np.random.default_rng(2)
    if fault == "inf":
        g = rng.standard_normal(SHAPE)
        g[1, 2] = np.inf
        return g
    return P[:, :2] @ rng.standard_normal((2, SHAPE[1]))


def _core_and_adapter_after_a_kept_refresh(name: str, fault: str, monkeypatch, *, jit: bool):
    """Four steps (refreshes due at t = 1, 3) through the adapter and through ``ar.step(check=False)``; the refresh
    at t = 3 keeps the previous basis.  Returns both ``(params, state)`` pairs after each step."""
    tx = getattr(ao, name)(learning_rate=1e-2, update_freq=FREQ)
    cfg = ar.make_config(name, update_freq=FREQ)
    w0 = np.random.default_rng(0).standard_normal(SHAPE)
    params, core_w = {"w": jnp.asarray(w0)}, jnp.asarray(w0)
    state, core_state = tx.init(params), ar.init(core_w, cfg)
    update = jax.jit(tx.update) if jit else tx.update
    rng = np.random.default_rng(1)
    out = []
    for t in range(1, 5):
        g = rng.standard_normal(SHAPE)
        if t == 3:
            g = _kept_basis_gradient(fault, np.asarray(core_state.P))
            if fault == "decomposition":
                _break_the_ladder(monkeypatch)
        warning = {"inf": NonFiniteGradientWarning, "decomposition": linalg.DecompositionWarning}[fault]
        with pytest.warns(warning) if t == 3 else contextlib.nullcontext():
            updates, state = update({"w": jnp.asarray(g)}, state, params)
            jax.block_until_ready(state)
        with pytest.warns(warning) if t == 3 else contextlib.nullcontext():
            core_w, core_state = ar.step(core_state, jnp.asarray(g), cfg, core_w, lr=1e-2, check=False)
        if t == 3:
            monkeypatch.undo()
        params = optax.apply_updates(params, updates)
        out.append(((params["w"], ao.core_states(state[0], params)["w"]), (core_w, core_state)))
    return out


@pytest.mark.parametrize("fault", ["inf", "decomposition"])
@pytest.mark.parametrize("name", ONE_SIDED)
def test_a_kept_basis_gives_the_bits_of_ar_step(name: str, fault: str, monkeypatch) -> None:
    """A refresh that keeps the previous basis is no refresh for the update (``refreshed=False``, no structure),
    as in ``ar.step``: the adapter's parameters and state equal ``ar.step``'s on the same jax arrays bit for bit
    (its update run eagerly: the same operations, through the same ``lax.cond`` and host callback)."""
    for t, ((w, state), (core_w, core_state)) in enumerate(
        _core_and_adapter_after_a_kept_refresh(name, fault, monkeypatch, jit=False), start=1
    ):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(core_w), err_msg=f"W after step {t}")
        for field in core_state._fields:
            a, b = getattr(state, field), getattr(core_state, field)
            assert (a is None) == (b is None), field
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{field} after step {t}")


@pytest.mark.parametrize("name", ONE_SIDED)
def test_a_kept_basis_under_jit_matches_ar_step(name: str, monkeypatch) -> None:
    """The same under ``jax.jit``, where ``refreshed`` comes back from the callback as a traced flag.  XLA fuses
    the elementwise work, so the jitted step agrees with the eager ``ar.step`` to rounding (rtol 1e-12 in float64);
    the refresh-step structure applied with the kept basis would zero all of ``G~`` (an O(1) difference)."""
    for t, ((w, state), (core_w, core_state)) in enumerate(
        _core_and_adapter_after_a_kept_refresh(name, "inf", monkeypatch, jit=True), start=1
    ):
        np.testing.assert_allclose(np.asarray(w), np.asarray(core_w), rtol=1e-12, atol=1e-14, err_msg=f"step {t}")
        np.testing.assert_array_equal(np.asarray(state.P), np.asarray(core_state.P), err_msg=f"P after step {t}")
