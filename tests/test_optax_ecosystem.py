"""The optax adapter where JAX users train: ``flax.nnx.Optimizer``, orbax checkpoints, ``jax.vmap`` ensembles.

Each is compared with the plain optax run of the same alias (``tx.init`` / ``tx.update`` / ``apply_updates``)
in float64.  Tolerances: nnx and orbax run the very same jaxpr on the very same arrays as the plain run, so
they are compared bit for bit, except nnx's eager mode (op by op, not one XLA program: rtol 1e-12, rounding);
a vmapped update runs batched products (``dot_general`` over a batch dimension), whose rounding may differ
from the single ones: rtol 1e-12.
"""

from __future__ import annotations

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from adadiag_ref.adapters import optax as ao  # noqa: E402

import adadiag_ref as ar  # noqa: E402

NAMES = list(ar.OPTIMIZERS)
SHAPES = {"wide": (3, 5), "tall": (6, 2), "bias": (5,)}  # one-sided and two-sided bases, a tall leaf, a vector
FREQ = 2  # refreshes at t = 1, 3, 5
RTOL = 1e-12

pytestmark = pytest.mark.usefixtures("jax_x64")  # float64 for this module


def _params(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(s)) for k, s in SHAPES.items()}


def _grads(steps: int, seed: int = 1) -> list[dict[str, jax.Array]]:
    rng = np.random.default_rng(seed)
    return [{k: jnp.asarray(rng.standard_normal(s)) for k, s in SHAPES.items()} for _ in range(steps)]


def _tx(name: str) -> optax.GradientTransformation:
    return ao.ALIASES[name](0.01, weight_decay=0.1, update_freq=FREQ)


def _plain_run(tx: optax.GradientTransformation, params: dict, grads: list[dict], state=None) -> tuple[dict, object]:
    state = tx.init(params) if state is None else state
    update = jax.jit(tx.update)
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _linear_loss(params: dict, grads: dict) -> jax.Array:
    """``sum_k <W_k, G_k>``: its gradient is ``G`` exactly, so both runs see the same gradient stream."""
    return sum(jnp.sum(params[k] * grads[k]) for k in SHAPES)


@pytest.mark.parametrize("mode", ["eager", "nnx.jit"])
@pytest.mark.parametrize("name", NAMES)
def test_flax_nnx_optimizer_equals_the_plain_optax_run(name, mode):
    """``nnx.Optimizer(model, alias)`` for 5 steps (refreshes at 1, 3, 5), gradients from ``nnx.grad``, equals
    ``tx.update`` on the same gradients.  Before the state stored only arrays, NNX rebuilt it without its
    ``None`` fields and step 2 failed (``No attribute 'Q' in State``)."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, params: dict) -> None:
            self.wide, self.tall, self.bias = (nnx.Param(params[k]) for k in ("wide", "tall", "bias"))

        def as_dict(self) -> dict:
            return {"wide": self.wide[...], "tall": self.tall[...], "bias": self.bias[...]}

    model = Model(_params())
    optimizer = nnx.Optimizer(model, _tx(name), wrt=nnx.Param)

    def train_step(model, optimizer, g):
        optimizer.update(model, nnx.grad(lambda m: _linear_loss(m.as_dict(), g))(model))

    step = nnx.jit(train_step) if mode == "nnx.jit" else train_step
    grads = _grads(5)
    for g in grads:
        step(model, optimizer, g)
    params, _ = _plain_run(_tx(name), _params(), grads)
    for k, value in model.as_dict().items():
        # eager nnx runs op by op, jitted runs one XLA program each: rounding, rtol 1e-12 (observed: equal bits)
        np.testing.assert_allclose(np.asarray(value), np.asarray(params[k]), rtol=RTOL, atol=1e-15, err_msg=k)
    assert int(optimizer.step[...]) == 5


@pytest.mark.parametrize("name", NAMES)
def test_orbax_checkpoint_restores_the_state_and_resumes_bit_identically(name, tmp_path):
    """orbax ``StandardCheckpointer`` saves the state after a refresh, restores it (the structure given by
    ``tx.init``) bit for bit, and 3 more steps from the restored state equal the uninterrupted run bit for bit.
    Before, orbax refused the state (``Cannot save arrays with zero size: ...param_shape``)."""
    ocp = pytest.importorskip("orbax.checkpoint")
    tx, grads = _tx(name), _grads(6)
    params, state = _plain_run(tx, _params(), grads[:3])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "state", jax.eval_shape(tx.init, params))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for saved, loaded in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(loaded), np.asarray(saved))
    resumed, _ = _plain_run(tx, params, grads[3:], restored)
    uninterrupted, _ = _plain_run(tx, _params(), grads)
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(resumed[k]), np.asarray(uninterrupted[k]), err_msg=k)


@pytest.mark.parametrize("name", NAMES)
def test_vmapped_update_runs_each_member_as_its_own_plain_run(name):
    """``jax.jit(jax.vmap(tx.update))`` over an ensemble of 3 members that have taken 0, 1 and 2 steps
    (``update_freq=2``: at every step some members are due and some are not) equals each member's own plain
    run: every member refreshes its own basis from its own gradient, when it is due.  Before, the refresh's
    ``pure_callback`` had no ``vmap_method`` and ``jax.vmap`` refused it."""
    tx, members, steps = _tx(name), 3, 4
    starts, runs = [], []
    for i in range(members):
        head = _grads(i, seed=10 + i)
        tail = _grads(steps, seed=20 + i)
        starts.append(_plain_run(tx, _params(seed=i), head))
        runs.append((tail, _plain_run(tx, _params(seed=i), head + tail)[0]))

    def stack(*trees):
        return jnp.stack(trees)

    params = jax.tree.map(stack, *(p for p, _ in starts))
    state = jax.tree.map(stack, *(s for _, s in starts))
    update = jax.jit(jax.vmap(tx.update))
    for t in range(steps):
        grads = jax.tree.map(stack, *(tail[t] for tail, _ in runs))
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    for i, (_, expected) in enumerate(runs):
        for k in SHAPES:
            # batched products against single ones: rounding only (rtol 1e-12, float64)
            np.testing.assert_allclose(np.asarray(params[k][i]), np.asarray(expected[k]), rtol=RTOL, atol=1e-15)


def test_state_leaves_are_non_empty_arrays_only():
    """The stored state has no ``None`` field and no zero-size array (what NNX drops and orbax refuses), and
    still refuses a state of another orientation: the parameter's shape is kept as static metadata."""
    tx = _tx("adadiag_pp")
    state = tx.init(_params())
    leaves = jax.tree.leaves(state, is_leaf=lambda x: x is None)
    assert leaves and all(x is not None and np.size(x) > 0 for x in leaves)
    leaf = state[0].states["wide"]
    assert leaf.Q is not None and leaf.parameter_shape == SHAPES["wide"]
    assert ao.core_states(state[0], _params())["wide"].param_shape.shape == (0, *SHAPES["wide"])
    transposed = {"wide": jnp.zeros((5, 3)), "tall": jnp.zeros((6, 2)), "bias": jnp.zeros((5,))}
    with pytest.raises(ValueError, match=r"created for a parameter of shape \(3, 5\), not \(5, 3\)"):
        tx.update(transposed, state, transposed)  # equal work frames (3 x 5), another parameter


def test_a_state_of_core_namedtuples_is_still_accepted():
    """A state whose leaves are the core's NamedTuples (as ``tx.init`` made them before :class:`LeafState`, or
    ``ar.init``) continues the trajectory bit for bit."""
    tx, grads = _tx("adafacdiag_pp"), _grads(4)
    params, state = _plain_run(tx, _params(), grads[:2])
    stored = jax.tree.map(lambda leaf: leaf.core(), state[0].states, is_leaf=lambda x: isinstance(x, ao.LeafState))
    old_style = (ao.CoreTransformState(states=stored), *state[1:])
    expected, _ = _plain_run(tx, params, grads[2:], state)
    got, _ = _plain_run(tx, params, grads[2:], old_style)
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(expected[k]), err_msg=k)
