"""optax's own idioms on the aliases: ``inject_hyperparams`` with a jitted ``init`` and ``update``, and
``optax.adafactor``'s keywords where they mean what ours mean (issue: newcomer edges)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from adadiag_ref.adapters import optax as ao  # noqa: E402

import adadiag_ref as ar  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_x64")


def _problem() -> tuple[dict, list[dict]]:
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((4, 6))), "b": jnp.asarray(rng.standard_normal(6))}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape)), params) for _ in range(5)]
    return params, grads


def _run(tx: optax.GradientTransformation, params: dict, grads: list[dict], jit: bool) -> dict:
    init, update = (jax.jit(tx.init), jax.jit(tx.update)) if jit else (tx.init, tx.update)
    state = init(params)
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("name", list(ar.OPTIMIZERS))
def test_inject_hyperparams_initialises_and_updates_under_jit(name: str) -> None:
    # optax's generic alias test: init and update jitted with injected hyperparameters equal the plain alias
    params, grads = _problem()
    alias = ao.ALIASES[name]
    injected = _run(optax.inject_hyperparams(alias)(learning_rate=0.1), params, grads, jit=True)
    plain = _run(alias(learning_rate=0.1), params, grads, jit=False)
    for a, b in zip(jax.tree.leaves(injected), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-12)  # the tolerance


@pytest.mark.parametrize("name", ["adafactor", "adafacdiag", "adafacdiag_pp"])
def test_optax_adafactor_keywords_mean_ours(name: str) -> None:
    params, grads = _problem()
    alias = ao.ALIASES[name]
    pairs = [
        ({"clipping_threshold": 0.5}, {"clip_threshold": 0.5}),
        ({"weight_decay_rate": 0.01}, {"weight_decay": 0.01}),
        ({"multiply_by_parameter_scale": True}, {"scale_parameter": True}),
        ({"decay_rate": 0.7}, {"decay_rate": 0.7}),
    ]
    for theirs, ours in pairs:
        a = _run(alias(learning_rate=0.1, **theirs), params, grads, jit=False)
        b = _run(alias(learning_rate=0.1, **ours), params, grads, jit=False)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_optax_adafactor_static_args_and_refused_names() -> None:
    params, grads = _problem()
    tx = optax.inject_hyperparams(ao.adafactor, static_args=("min_dim_size_to_factor",))(
        learning_rate=0.1, clipping_threshold=0.5
    )
    injected = _run(tx, params, grads, jit=True)
    plain = _run(ao.adafactor(learning_rate=0.1, clip_threshold=0.5), params, grads, jit=False)
    for a, b in zip(jax.tree.leaves(injected), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-12)
    with pytest.raises(ValueError, match="'min_dim_size_to_factor' has no counterpart in 'adafactor'"):
        ao.adafactor(learning_rate=0.1, min_dim_size_to_factor=64)
    with pytest.raises(ValueError, match=r"'clipping_threshold' .* and 'clip_threshold' both given"):
        ao.adafactor(learning_rate=0.1, clipping_threshold=0.5, clip_threshold=0.25)
