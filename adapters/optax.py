"""JAX / optax adapter: ``scale_by_<name>`` building blocks and ``<name>`` aliases.

For every parameter leaf the update is the core's, run on ``jax.Array`` leaves::

    due = (t == 1) | ((t - 1) mod T == 0)            # traced, t = count + 1
    S   = lax.cond(due, refresh, identity, S)         # refresh: P, Q <- canonical_svd(G) on the host
    U, S = core direction with the current bases      # ar.update with eta = 1, lambda = 0, negated

``scale_by_<name>`` returns the preconditioned direction ``U = P U~ Q^T`` (no
learning rate, no weight decay).  The alias is::

    <name>(learning_rate, ...) = chain(scale_by_<name>(...),
                                       add_decayed_weights(weight_decay),
                                       scale_by_learning_rate(learning_rate))

which gives ``W <- W - eta (U + lambda W)``, the core's update.  (With the
Adafactor options ``relative_step`` or ``scale_parameter`` the core's step
size ``eta_t`` is not ``eta`` times a factor of the direction alone, so the
alias then runs the core's whole update, decay included, in one transformation.)

The canonical SVD decides the rank and clusters on host data and does not
trace, so the refresh runs through ``jax.pure_callback`` into the core's NumPy
:func:`adadiag_ref.refresh_basis`, inside ``lax.cond`` on the traced counter:
the update jits once and never recompiles across steps.  Only the rotated
sides are decomposed; baselines (``adamw``, ``adafactor``, ``hfac``) never call
back.  Under ``jax.jit`` the gradient is not validated (no ``check_inputs``):
a NaN gradient propagates as in any optax transformation.

State: :class:`CoreTransformState` with ``states``, a pytree shaped like the
parameters whose leaves are the core's NamedTuple states (``AdamState``,
``AdafactorState``, ``HfacState``); each has its own ``count``.
"""

from __future__ import annotations

try:
    import jax
    import optax
except ImportError as exc:  # name the extra instead of a bare "No module named 'jax'"
    raise ImportError(
        'adadiag_ref.adapters.optax needs JAX and optax: pip install "adadiag-ref[jax]"', name=exc.name
    ) from exc

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

import adadiag_ref as ar
from adadiag_ref.config import AdafactorConfig, BaseConfig

__all__ = [
    "CoreTransformState",
    "adadiag",
    "adadiag_pp",
    "adafacdiag",
    "adafacdiag_pp",
    "adafactor",
    "adamw",
    "hfac",
    "hfacdiag",
    "refresh_due",
    "scale_by_adadiag",
    "scale_by_adadiag_pp",
    "scale_by_adafacdiag",
    "scale_by_adafacdiag_pp",
    "scale_by_adafactor",
    "scale_by_adamw",
    "scale_by_core",
    "scale_by_hfac",
    "scale_by_hfacdiag",
]

ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]


class CoreTransformState(NamedTuple):
    """``states``: pytree like the parameters, each leaf a core state (``count``, ``P``, ``Q``, moments)."""

    states: Any


def refresh_due(count: jax.Array, cfg: BaseConfig) -> jax.Array:
    """Traced :func:`adadiag_ref.refresh_due`: ``t == 1`` or ``(t - 1) mod T == 0`` with ``t = count + 1``."""
    t = count + 1
    due = t == 1
    if cfg.update_freq is not None:
        due = due | ((t - 1) % cfg.update_freq == 0)
    return due


def _host_refresh(cfg: BaseConfig, dtype: np.dtype) -> Callable[[np.ndarray], tuple[np.ndarray, ...]]:
    """Host callback: the core's :func:`adadiag_ref.refresh_basis` on the NumPy gradient, returning ``(P[, Q])``.

    Only the gradient crosses to the host (the moments stay on the device); the
    host state is a fresh ``ar.init`` of the state dtype, whose bases are replaced.
    """

    def callback(grad: np.ndarray) -> tuple[np.ndarray, ...]:
        grad = np.asarray(grad)
        host_state = ar.init(np.zeros(grad.shape, dtype=dtype), cfg)
        new = ar.refresh_basis(host_state, grad, cfg)
        return tuple(np.asarray(b, dtype=dtype) for b in (new.P, new.Q) if b is not None)

    return callback


def _refresh(state: Any, grad: jax.Array, cfg: BaseConfig) -> Any:
    """``lax.cond(due, refresh_basis, identity)`` with the refresh on the host (traceable)."""
    if state.P is None:  # no rotated side: nothing to refresh
        return state
    bases = [b for b in (state.P, state.Q) if b is not None]
    shapes = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bases)
    callback = _host_refresh(cfg, np.dtype(state.P.dtype))

    def do_refresh(s: Any) -> Any:
        new = jax.pure_callback(callback, shapes, grad)
        return s._replace(P=new[0], Q=new[1] if s.Q is not None else None)

    return jax.lax.cond(refresh_due(state.count, cfg), do_refresh, lambda s: s, state)


def _leaf_update(grad: jax.Array, state: Any, param: jax.Array, cfg: BaseConfig, lr: Any) -> tuple[jax.Array, Any]:
    """Refresh when due, then the core's ``update``; returns ``(delta, new_state)``."""
    due = refresh_due(state.count, cfg)
    state = _refresh(state, grad, cfg)
    return ar.update(state, grad, cfg, param, lr=lr, refreshed=due if state.P is not None else False)


def _split(tree: Any, outputs: Any) -> tuple[Any, Any]:
    """Unzip a pytree whose leaves were replaced by ``(delta, state)`` pairs."""
    deltas = jax.tree.map(lambda _, pair: pair[0], tree, outputs)
    states = jax.tree.map(lambda _, pair: pair[1], tree, outputs)
    return deltas, states


def _init_leaf(param: jax.Array, cfg: BaseConfig) -> Any:
    """``ar.init`` for one leaf.

    A leaf sharded over several devices is initialised under ``jax.jit``: the
    core places its zeros with ``device=device(param)``, which for such a leaf
    is a sharding that does not fit the 0-d counter; traced, XLA places them.
    """
    sharding = getattr(param, "sharding", None)
    if sharding is not None and len(sharding.device_set) > 1:
        return jax.jit(lambda p: ar.init(p, cfg))(param)
    return ar.init(param, cfg)


def _check_update_args(params: Any, needs_params: bool) -> None:
    if params is None and needs_params:
        raise ValueError("this transformation needs params (weight decay or Adafactor parameter scaling uses W)")


def scale_by_core(name: str, **options: Any) -> optax.GradientTransformation:
    """``scale_by_<name>`` for any core name: the preconditioned direction ``U`` (no lr, no decay).

    ``options`` are core config fields (``betas``, ``eps``, ``update_freq``,
    ``max_basis_dim``, ``clip_threshold``, ...), given as Python numbers: the
    config is static under ``jax.jit``.
    """
    cfg = ar.make_config(name, **{**options, "lr": 1.0, "weight_decay": 0.0})
    needs_params = isinstance(cfg, AdafactorConfig) and (cfg.scale_parameter or cfg.relative_step)

    def init_fn(params: Any) -> CoreTransformState:
        return CoreTransformState(states=jax.tree.map(lambda p: _init_leaf(p, cfg), params))

    def update_fn(updates: Any, state: CoreTransformState, params: Any = None) -> tuple[Any, CoreTransformState]:
        _check_update_args(params, needs_params)
        # Without weight decay or parameter scaling the core reads only W's shape and dtype.
        weights = updates if params is None else params
        outputs = jax.tree.map(lambda g, s, w: _leaf_update(g, s, w, cfg, 1.0), updates, state.states, weights)
        deltas, states = _split(updates, outputs)
        return jax.tree.map(jnp.negative, deltas), CoreTransformState(states=states)

    return optax.GradientTransformation(init_fn, update_fn)


def _fused_core(name: str, learning_rate: ScalarOrSchedule, **options: Any) -> optax.GradientTransformation:
    """The core's whole update ``delta = -eta_t (U + lambda W)`` as one transformation (schedules allowed)."""
    cfg = ar.make_config(name, **options)

    def init_fn(params: Any) -> CoreTransformState:
        return CoreTransformState(states=jax.tree.map(lambda p: _init_leaf(p, cfg), params))

    def update_fn(updates: Any, state: CoreTransformState, params: Any = None) -> tuple[Any, CoreTransformState]:
        _check_update_args(params, True)
        first = jax.tree.leaves(state.states, is_leaf=lambda x: hasattr(x, "_fields"))
        lr = learning_rate(first[0].count) if callable(learning_rate) and first else learning_rate
        outputs = jax.tree.map(lambda g, s, w: _leaf_update(g, s, w, cfg, lr), updates, state.states, params)
        deltas, states = _split(updates, outputs)
        return deltas, CoreTransformState(states=states)

    return optax.GradientTransformation(init_fn, update_fn)


def core_alias(
    name: str,
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float | None = None,
    weight_decay: Any = 0.0,
    update_freq: int | None = 200,
    **family_options: Any,
) -> optax.GradientTransformation:
    """``<name>`` alias: ``chain(scale_by_<name>, add_decayed_weights, scale_by_learning_rate)``.

    Equals the core's ``W_{t+1} = W_t - eta (P U~ Q^T + lambda W_t)``.  With
    ``optax.inject_hyperparams`` inject ``learning_rate`` (and ``weight_decay``);
    the other arguments shape the static config (list them in ``static_args``).
    """
    # optax.inject_hyperparams binds the signature and passes ``**family_options`` back as one keyword.
    family_options = {**family_options.pop("family_options", {}), **family_options}
    options = {"betas": (b1, b2), "eps": eps, "update_freq": update_freq, **family_options}
    cfg = ar.make_config(name, **options)
    if isinstance(cfg, AdafactorConfig) and (cfg.relative_step or cfg.scale_parameter):
        return _fused_core(name, learning_rate, weight_decay=float(weight_decay), **options)
    return optax.chain(
        scale_by_core(name, **options),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


def _scale_by(name: str) -> Callable[..., optax.GradientTransformation]:
    def scale_by(
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float | None = None,
        update_freq: int | None = 200,
        **family_options: Any,
    ) -> optax.GradientTransformation:
        return scale_by_core(name, betas=(b1, b2), eps=eps, update_freq=update_freq, **family_options)

    scale_by.__name__ = scale_by.__qualname__ = f"scale_by_{name}"
    scale_by.__doc__ = (
        f"Preconditioned direction of the core's ``{name!r}`` (no learning rate, no weight decay); "
        "see :func:`scale_by_core`."
    )
    return scale_by


def _alias(name: str) -> Callable[..., optax.GradientTransformation]:
    def alias(
        learning_rate: ScalarOrSchedule,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float | None = None,
        weight_decay: Any = 0.0,
        update_freq: int | None = 200,
        **family_options: Any,
    ) -> optax.GradientTransformation:
        return core_alias(name, learning_rate, b1, b2, eps, weight_decay, update_freq, **family_options)

    alias.__name__ = alias.__qualname__ = name
    alias.__doc__ = f"The core's ``{name!r}`` as an optax optimizer; see :func:`core_alias`."
    return alias


scale_by_adamw = _scale_by("adamw")
scale_by_adadiag = _scale_by("adadiag")
scale_by_adadiag_pp = _scale_by("adadiag_pp")
scale_by_adafactor = _scale_by("adafactor")
scale_by_adafacdiag = _scale_by("adafacdiag")
scale_by_adafacdiag_pp = _scale_by("adafacdiag_pp")
scale_by_hfac = _scale_by("hfac")
scale_by_hfacdiag = _scale_by("hfacdiag")

adamw = _alias("adamw")
adadiag = _alias("adadiag")
adadiag_pp = _alias("adadiag_pp")
adafactor = _alias("adafactor")
adafacdiag = _alias("adafacdiag")
adafacdiag_pp = _alias("adafacdiag_pp")
hfac = _alias("hfac")
hfacdiag = _alias("hfacdiag")

ALIASES: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adamw": adamw,
    "adadiag": adadiag,
    "adadiag_pp": adadiag_pp,
    "adafactor": adafactor,
    "adafacdiag": adafacdiag,
    "adafacdiag_pp": adafacdiag_pp,
    "hfac": hfac,
    "hfacdiag": hfacdiag,
}
"""Core name -> optax alias."""
