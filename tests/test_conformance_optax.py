"""optax conventions, run on every adapter alias and on ``optax.adamw`` as the control.

Each test states one convention optax's own optimizers meet (jit compiles once,
``inject_hyperparams`` traces every numeric hyperparameter, the state is a pytree
of arrays, composition with ``chain``/``MultiSteps``/``masked`` on mixed pytrees).
The control shows the test asserts optax's behaviour; the aliases must match it.

Tolerance: injected hyperparameters are traced float64 arrays where the static
run uses Python floats (``xp.log(beta)`` vs ``math.log(beta)``), so the two runs
agree to rounding, rtol 1e-12 in float64; identical computations are compared
exactly.
"""

from __future__ import annotations

import functools

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from adadiag_ref.adapters import optax as ao  # noqa: E402

CONTROL = "optax.adamw"
SUBJECTS = [*ao.ALIASES, CONTROL]
FREQ = 2  # the aliases refresh at t = 1, 3, 5, ...
RTOL = 1e-12


def factory(subject):
    """The optimizer factory with a common signature (``update_freq`` only for the aliases)."""
    if subject == CONTROL:
        return lambda learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0: optax.adamw(
            learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay
        )
    return functools.partial(ao.ALIASES[subject], update_freq=FREQ)


def hyper(subject, k=0):
    """Step k's hyperparameters (all numeric ones, changed at every step)."""
    values = {"learning_rate": 0.01 / (1 + k), "b1": 0.9 - 0.1 * k, "b2": 0.99 - 0.01 * k, "weight_decay": 0.1 * k}
    values["eps"] = 1e-8 * (1 + k) if subject in (CONTROL, "adamw", "adadiag", "adadiag_pp") else 1e-30 * (1 + k)
    return values


def mixed_params():
    """Uncommitted arrays (as users create them): a matrix, a vector and a scalar."""
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((5, 7))),
        "b": jnp.asarray(rng.standard_normal(7)),
        "s": jnp.asarray(0.5, dtype=jnp.float64),  # not weakly typed: apply_updates would change that
    }


def grads_for(params, steps, seed=1):
    rng = np.random.default_rng(seed)
    return [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(np.shape(p))), params) for _ in range(steps)]


def assert_trees_close(a, b, rtol=RTOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-15)


pytestmark = [pytest.mark.parametrize("subject", SUBJECTS), pytest.mark.usefixtures("jax_x64")]


def test_train_step_compiles_once_under_jit(subject):
    """The documented loop: params made without a device, ``jax.jit`` over params and state, 5 steps (3 refresh)."""
    opt = factory(subject)(0.01)
    params = mixed_params()
    state = opt.init(params)
    traces = []

    @jax.jit
    def train_step(params, state, grads):
        traces.append(1)  # Python side effect: runs once per trace
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for grads in grads_for(params, 5):
        params, state = train_step(params, state, grads)
    assert len(traces) == 1 and train_step._cache_size() == 1


def test_every_numeric_hyperparameter_is_injectable_and_traced(subject):
    """``inject_hyperparams`` with no static_args: every number is traced; changing them never recompiles and each
    step equals the uninjected optimizer built with that step's values (``update_freq`` too, for the aliases)."""
    params = mixed_params()
    grads = grads_for(params, 4)
    make = factory(subject)
    extra = {} if subject == CONTROL else {"update_freq": FREQ}
    opt = optax.inject_hyperparams(make)(**hyper(subject), **extra)
    state = opt.init(params)
    traces = []

    def update(g, s, p):
        traces.append(1)
        return opt.update(g, s, p)

    update = jax.jit(update)
    ref_params, ref_state, got = params, make(**hyper(subject), **extra).init(params), params
    for k, g in enumerate(grads):
        for key, value in hyper(subject, k).items():
            state.hyperparams[key] = jnp.asarray(value, dtype=state.hyperparams[key].dtype)
        if extra:
            period = state.hyperparams["update_freq"]
            state.hyperparams["update_freq"] = jnp.asarray(1 + k % 2, dtype=period.dtype)  # a traced refresh period
        updates, state = update(g, state, got)
        got = optax.apply_updates(got, updates)
        static_extra = {"update_freq": 1 + k % 2} if extra else {}
        ref_updates, ref_state = make(**hyper(subject, k), **static_extra).update(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
    assert len(traces) == 1
    assert_trees_close(got, ref_params)


def test_state_is_a_pytree_of_arrays_that_checkpoints_and_donates(subject):
    opt = factory(subject)(0.01)
    params = mixed_params()
    grads = grads_for(params, 4)
    state = opt.init(params)
    leaves, treedef = jax.tree.flatten(state)
    assert leaves and all(isinstance(x, jax.Array) for x in leaves)
    update = jax.jit(opt.update)
    for g in grads[:2]:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
    # checkpoint: to host arrays and back through the treedef, then continue identically
    restored = jax.tree.unflatten(treedef, [jnp.asarray(np.asarray(x)) for x in jax.tree.leaves(state)])
    donating = jax.jit(opt.update, donate_argnums=1)
    p1 = p2 = params
    for g in grads[2:]:
        u1, state = update(g, state, p1)
        u2, restored = donating(g, restored, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _run(opt, params, grads):
    state = opt.init(params)
    update = jax.jit(opt.update)
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_inside_chain_on_a_mixed_pytree(subject):
    params = mixed_params()
    grads = grads_for(params, 4)
    plain = _run(factory(subject)(0.01), params, grads)
    chained = _run(optax.chain(optax.identity(), factory(subject)(0.01)), params, grads)
    assert_trees_close(chained, plain, rtol=0)


def test_multisteps_applies_every_k_steps_on_a_mixed_pytree(subject):
    params = mixed_params()
    grads = grads_for(params, 4)
    multi = optax.MultiSteps(factory(subject)(0.01), every_k_schedule=2, accumulator_dtype=jnp.float64)
    got = _run(multi, params, grads)
    means = [jax.tree.map(lambda a, b: (a + b) / 2, grads[k], grads[k + 1]) for k in (0, 2)]
    assert_trees_close(got, _run(factory(subject)(0.01), params, means))


def test_masked_leaves_are_left_to_the_caller(subject):
    params = mixed_params()
    grads = grads_for(params, 3)
    mask = {"w": True, "b": False, "s": True}
    masked = optax.masked(factory(subject)(0.01), mask)
    state = masked.init(params)
    got = params
    for g in grads:
        updates, state = jax.jit(masked.update)(g, state, got)
        np.testing.assert_array_equal(np.asarray(updates["b"]), np.asarray(g["b"]))  # passed through untouched
        got = optax.apply_updates(got, updates)
    sub = {k: params[k] for k in ("w", "s")}
    ref = _run(factory(subject)(0.01), sub, [{k: g[k] for k in ("w", "s")} for g in grads])
    assert_trees_close({k: got[k] for k in ("w", "s")}, ref, rtol=0)


def test_inject_hyperparams_init_and_update_both_jit(subject):
    """optax's alias battery (``test_optimizers_can_be_wrapped_in_inject_hyperparams``): ``jax.jit(init)`` and
    ``jax.jit(update)`` of ``inject_hyperparams(alias)(learning_rate=0.1)``, every default numeric hyperparameter
    traced in ``init`` too; the Adafactor family with ``static_args=("min_dim_size_to_factor",)`` as optax's
    battery passes it to ``optax.adafactor``.  float32 parameters as there.  Tolerance: the injected
    hyperparameters are float32 arrays (0.999 -> 0.99900001) where the plain optimizer uses Python floats; the
    control's state differs by 1.3e-5 relative (``(1 - b2) g^2``), the aliases' updates and states by 0 (measured):
    rtol 1e-4 (optax's battery uses 1e-3 for the updates, 1e-4 for the states)."""
    make = factory(subject)
    static = ("min_dim_size_to_factor",) if subject in ("adafactor", "adafacdiag", "adafacdiag_pp") else ()
    plain = make(learning_rate=0.1)
    injected = optax.inject_hyperparams(make, static_args=static)(learning_rate=0.1)
    params = [jnp.negative(jnp.ones((2, 3), jnp.float32)), jnp.ones((2, 5, 2), jnp.float32)]
    grads = [jnp.ones((2, 3), jnp.float32), jnp.negative(jnp.ones((2, 5, 2), jnp.float32))]

    updates, state = jax.jit(plain.update)(grads, jax.jit(plain.init)(params), params)
    injected_state = jax.jit(injected.init)(params)
    assert all(isinstance(v, jax.Array) for v in injected_state.hyperparams.values())
    injected_updates, injected_state = jax.jit(injected.update)(grads, injected_state, params)
    assert_trees_close(injected_updates, updates, rtol=1e-4)
    assert jax.tree.structure(injected_state.inner_state) == jax.tree.structure(state)
    assert_trees_close(injected_state.inner_state, state, rtol=1e-4)
