"""JAX / optax adapter: ``scale_by_<name>`` building blocks and ``<name>`` aliases.

For every parameter leaf the update is the core's, run on ``jax.Array`` leaves::

    due = (t == 1) | ((t - 1) mod T == 0)            # traced, t = count + 1 (one counter for all leaves)
    S_k = lax.cond(due, refresh_bases, identity, S_k) # one cond, all leaves k: P, Q <- canonical_svd(G_k) on the host
    U, S = preconditioned_direction(S, G, cfg, W)     # per leaf: the core's U = P U~ Q^T with the current bases

``scale_by_<name>`` returns the preconditioned direction ``U = P U~ Q^T`` (no
learning rate, no weight decay), computed by the core's
:func:`~adadiag_ref.optim.core.preconditioned_direction`.  The alias is::

    <name>(learning_rate, ...) = chain(scale_by_<name>(...),
                                       add_decayed_weights(weight_decay),
                                       scale_by_learning_rate(learning_rate))

which gives ``W <- W - eta (U + lambda W)``, the core's update.  (With the
Adafactor options ``relative_step`` or ``scale_parameter`` the core's step
size ``eta_t`` is not ``eta`` times a factor of the direction alone, so the
alias then runs the core's whole update, :func:`adadiag_ref.update` with the
real learning rate and weight decay, in one transformation.)

The canonical SVD decides the rank and clusters on host data and does not
trace, so the refresh runs through one ``jax.pure_callback`` per step into the
core's NumPy :func:`adadiag_ref.refresh_bases` (every rotated leaf), inside one
``lax.cond`` on the traced counter: the update jits once and never recompiles
across steps.  Only the rotated sides are decomposed; baselines (``adamw``,
``adafactor``, ``hfac``) never call back.  The matrix products (the rotations)
are traced at ``precision=HIGHEST``: float32 arithmetic whatever JAX's default
matmul precision (:func:`_tree_step`).  Under ``jax.jit`` the gradient is not validated (no ``check_inputs``):
a NaN gradient propagates into the moments as in any optax transformation,
and a refresh on a non-finite gradient (or one whose decomposition fails)
keeps the previous bases and is no refresh for that step's update
(``refreshed=False``: no refresh-step structure), as the eager core does.

State: :class:`CoreTransformState`, whose :class:`LeafState` leaves (each with its own ``count``) hold arrays
only, so that ``flax.nnx``, orbax and ``jax.vmap`` take it.
"""

from __future__ import annotations

try:
    import jax
    import optax
except ImportError as exc:  # name the extra instead of a bare "No module named 'jax'"
    raise ImportError(
        'adadiag_ref.adapters.optax needs JAX and optax: pip install "adadiag-ref[jax]"', name=exc.name
    ) from exc

import collections
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import jax.numpy as jnp
import numpy as np

import adadiag_ref as ar
from adadiag_ref.config import AdafactorConfig, BaseConfig, step_config
from adadiag_ref.optim import (
    check_orientation,
    from_work,
    preconditioned_direction,
    refresh_when_due,
    split_batch,
    traced_refresh_due,
    transposed_frame,
    work_dtype,
)
from adadiag_ref.optim.families import family_of

__all__ = [
    "ALIASES",
    "SCALE_BY",
    "CoreTransformState",
    "LeafState",
    "core_alias",
    "core_states",
    "refresh_due",
    "scale_by_core",
    *ar.OPTIMIZERS,
    *(f"scale_by_{name}" for name in ar.OPTIMIZERS),
]

ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]


class CoreTransformState(NamedTuple):
    """``states``: pytree like the parameters, each leaf a :class:`LeafState` (``count``, ``P``, ``Q``, moments).

    Its leaves are non-empty arrays only (a field the core leaves ``None`` is no child, the parameter's shape is
    static metadata), so the state checkpoints (orbax), donates, shards and goes through ``flax.nnx`` like
    optax's own.
    The moment matrices of a tall parameter without a basis (more rows than columns: the core's work frame is
    its transpose; ``P`` absent: AdamW, Adafactor, Hfac, a side over ``max_basis_dim``) are kept in the
    parameter's orientation, as the transposes of the core's ``m x n`` matrices
    (:func:`_parameter_oriented`): an XLA array has one memory order, so kept in the work frame's they would
    make every step read ``G`` and write ``U`` transposed.  :func:`core_states` gives the core's states.
    """

    states: Any


class LeafState:
    """One parameter's core state as the adapter stores it: a NamedTuple of its arrays only.

    A core state (``AdamState``, ``AdafactorState``, ``HfacState``, a registered family's) is a NamedTuple
    ``(count, P, Q, *moments, param_shape)`` whose absent fields are ``None`` and whose ``param_shape`` is a
    zero-size array recording the parameter's shape.  Frameworks that rebuild a state from its arrays drop
    ``None`` fields (``flax.nnx.Optimizer``: ``No attribute 'Q' in State`` at the second step), and orbax
    refuses to save zero-size arrays.  The stored form is a NamedTuple of the fields that hold arrays (``count``,
    ``P``, ``M``, ...), whose type (one per core state type, fields present and parameter shape: :func:`_stored_type`)
    carries the core state type (:attr:`state_type`) and the parameter's shape (:attr:`parameter_shape`,
    ``None`` when the core state had no ``param_shape`` record) as static data.  Being a NamedTuple, it is
    flattened by JAX's C++ pytree code (a registered Python node took 6x the time, per leaf and per step).

    It reads like the core's state: ``leaf.count``, ``leaf.M``, ``leaf.P`` (``None`` when absent);
    :meth:`core` and :func:`core_states` give the core's NamedTuples.
    """

    __slots__ = ()
    state_type: ClassVar[Any]
    parameter_shape: ClassVar[tuple[int, ...] | None]

    @staticmethod
    def of(state: Any) -> Any:
        """The stored form of a core state: its non-``None`` fields; the shape its ``param_shape`` records."""
        recorded = getattr(state, "param_shape", None)
        shape = None if recorded is None else tuple(int(d) for d in recorded.shape[1:])
        fields = tuple(f for f in state._fields if f != "param_shape" and getattr(state, f) is not None)
        state_type: Any = type(state)
        return _stored_type(state_type, fields, shape)(*(getattr(state, f) for f in fields))

    def core(self) -> Any:
        """The core's state: absent fields ``None``, ``param_shape`` a zero-size ``(0, *shape)`` array again."""
        kind = self.state_type
        state = kind(**{f: getattr(self, f) for f in kind._fields if f != "param_shape"})
        if self.parameter_shape is None:
            return state
        return state._replace(param_shape=jnp.zeros((0, *self.parameter_shape), work_dtype(state)))

    def __getattr__(self, name: str) -> Any:  # only for names that are not fields of the stored NamedTuple
        if name in type(self).state_type._fields:
            return None  # a field the core leaves None
        raise AttributeError(name)

    def __reduce__(self) -> tuple[Any, ...]:  # the stored types are made at run time: pickle by their recipe
        return _stored_leaf, (self.state_type, self._fields, self.parameter_shape, tuple(self))  # type: ignore[attr-defined]


@functools.cache
def _stored_type(state_type: Any, fields: tuple[str, ...], shape: tuple[int, ...] | None) -> type:
    """The NamedTuple type that stores the ``fields`` of a ``state_type`` for a parameter of shape ``shape``."""
    base = collections.namedtuple(f"Stored{state_type.__name__}", fields)  # type: ignore[misc]
    namespace = {"__slots__": (), "state_type": state_type, "parameter_shape": shape}
    return type(base.__name__, (base, LeafState), namespace)


def _stored_leaf(state_type: Any, fields: tuple[str, ...], shape: tuple[int, ...] | None, values: Any) -> Any:
    return _stored_type(state_type, tuple(fields), shape)(*values)


def _core_state(leaf: Any, cfg: BaseConfig | None = None) -> Any:
    """The core state of a stored leaf.

    A :class:`LeafState` gives its :meth:`~LeafState.core`; a core NamedTuple (a state stored before
    :class:`LeafState` existed, or one made with ``ar.init``) is taken as it is.  A mapping of field names to
    arrays is a :class:`LeafState` that a framework rebuilt from its keyed children (``flax.nnx.Optimizer``
    writes each new state back as an ``nnx.State``): the fields it lacks are ``None`` and its type is ``cfg``'s
    family's; it carries no parameter shape, so the orientation check is skipped, as for any state without a
    ``param_shape`` record (the framework keys the state by the parameter's path).
    """
    if isinstance(leaf, LeafState):
        return leaf.core()
    if isinstance(leaf, Mapping):
        if cfg is None:
            raise TypeError(f"a {type(leaf).__name__} of state fields is read with the optimizer's config")
        state_type: Any = family_of(cfg).state_type
        return state_type(**{f: leaf.get(f) for f in state_type._fields if f != "param_shape"})
    return leaf


_TRACEABLE = frozenset({"betas", "eps", "weight_decay", "update_freq", "clip_threshold", "decay_rate", "eps2"})
"""Numeric config fields that may be traced arrays (``optax.inject_hyperparams``); the rest shape the state."""


def _is_traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def _python(value: Any) -> Any:
    """A concrete 0-d array as a Python number (to validate it); other values unchanged."""
    if isinstance(value, jax.Array | np.ndarray | np.generic) and not _is_traced(value):
        if np.ndim(value) != 0:
            raise ValueError(f"hyperparameters must be scalars, got an array of shape {np.shape(value)}")
        return value.item()
    return value


class _Options(NamedTuple):
    """The validated static config and the traced hyperparameters that override its fields."""

    cfg: BaseConfig
    traced: dict[str, Any]


def _options(name: str, options: dict[str, Any]) -> _Options:
    """Validate the concrete options (``make_config``); keep traced ones aside.

    A traced value is validated where ``optax.inject_hyperparams`` sees it
    concretely: in ``init``.  Under ``jax.jit`` its config field holds a valid
    placeholder (the default) and the traced value replaces it per leaf.
    """
    concrete, traced = {}, {}
    for key, value in options.items():
        if key == "betas":
            betas = tuple(value)
            if any(_is_traced(b) for b in betas):
                traced[key] = betas
            concrete[key] = tuple(0.5 if _is_traced(b) else _python(b) for b in betas)  # a valid placeholder
        elif _is_traced(value):
            if key not in _TRACEABLE:
                raise TypeError(f"{key!r} shapes the optimizer state and cannot be traced; pass it in static_args")
            traced[key] = value
        else:
            concrete[key] = _python(value)
    return _Options(ar.make_config(name, **concrete), traced)


def _leaf_config(opts: _Options, state: Any) -> BaseConfig:
    """The config one leaf's update reads: the static one with the traced fields
    (:func:`adadiag_ref.config.step_config`, each cast to the state dtype).

    Whether ``M`` exists (momentum) is read from the state, which ``init`` built
    from the concrete values.
    """
    values = {key: value for key, value in opts.traced.items() if key != "update_freq"}  # the period: refresh_due's
    if not values:
        return opts.cfg
    dtype = work_dtype(state)
    momentum = getattr(state, "M", None) is not None
    return step_config(opts.cfg, momentum=momentum, cast=lambda value: jnp.asarray(value, dtype), **values)


refresh_due = traced_refresh_due
"""Traced :func:`adadiag_ref.refresh_due` (:func:`adadiag_ref.traced_refresh_due`, kept here under its old name)."""


def _prepared_leaves(grads: list[jax.Array], stored: list[Any], names: list[str], opts: _Options) -> list[Any]:
    """Each leaf's config, its core state (the core's orientation: :func:`_parameter_oriented`, after the
    orientation check it would otherwise defeat) with the bases refreshed when due, and the ``refreshed`` flag
    for the core."""
    states = []
    for grad, leaf in zip(grads, stored, strict=True):
        state = _core_state(leaf, opts.cfg)
        check_orientation(state, tuple(grad.shape))
        states.append(_parameter_oriented(state, tuple(grad.shape), opts.cfg.batch_dims))
    # every leaf of one transformation advances its count together (refresh_when_due): one counter for all,
    # so the step's coefficients (bias corrections, schedules) are one computation and the new counts one
    # value, not a few scalar kernels per leaf (on a GPU, 3 of a leaf's 6 launches)
    count = states[0].count if states else None
    states = [s._replace(count=count) for s in states]
    # one lax.cond and one host callback for all rotated leaves, with the transformation's period (traced when injected)
    period = opts.traced.get("update_freq", opts.cfg)
    states, refreshed = refresh_when_due(states, grads, opts.cfg, names=names, period=period)
    return [(_leaf_config(opts, s), s, r) for s, r in zip(states, refreshed, strict=True)]


LeafStep = Callable[[jax.Array, Any, jax.Array, BaseConfig, Any], tuple[jax.Array, Any]]
"""One leaf's step after the refresh: ``(grad, core state, weight, config, refreshed) -> (output, new state)``."""


def _tree_step(updates: Any, state: CoreTransformState, weights: Any, opts: _Options, step: LeafStep) -> Any:
    """``step`` over every leaf after one refresh for all (``refresh_when_due``) -> ``(outputs, state)``.

    Traced with float32 matrix products at full precision (``jax.default_matmul_precision("highest")``, which
    JAX records on each product as ``precision=HIGHEST``): the rotations ``P^T G Q`` and ``P U~ Q^T`` are the
    core's float32 arithmetic whatever the caller's default (TF32 on A100/H100 GPUs, or a
    ``jax.default_matmul_precision("bfloat16")`` around the step).  On a CPU the products are the same bits.
    """
    with jax.default_matmul_precision("highest"):
        with_paths, treedef_ = jax.tree_util.tree_flatten_with_path(updates)
        treedef: Any = treedef_  # its flatten_up_to and unflatten are missing from JAX's type stubs
        grads = [g for _, g in with_paths]
        names = [jax.tree_util.keystr(path) for path, _ in with_paths]
        prepared = _prepared_leaves(grads, treedef.flatten_up_to(state.states), names, opts)
        outputs, states = [], []
        for g, w, (cfg, s, refreshed) in zip(grads, treedef.flatten_up_to(weights), prepared, strict=True):
            out, new_state = step(g, s, w, cfg, refreshed)
            outputs.append(out)
            states.append(LeafState.of(_parameter_oriented(new_state, tuple(g.shape), opts.cfg.batch_dims)))
        return treedef.unflatten(outputs), CoreTransformState(states=treedef.unflatten(states))


def _parameter_oriented(state: Any, shape: tuple[int, ...], batch_dims: int = 0) -> Any:
    """A leaf's core state with its moment matrices transposed when the parameter is tall and not rotated (its
    own inverse).

    The core keeps a tall parameter's moments as ``m x n`` matrices of its work frame, the transpose of the
    parameter (``layout_for``); on NumPy, CuPy and torch they are transposed views of buffers in the
    parameter's memory order (``ar.init``), so ``G``, ``W`` and the moments are read in one order.  A JAX
    array has no such view: stored as the core's, an entrywise step over a 4096 x 1024 leaf reads and writes
    transposed (5.5x ``optax.adamw``'s time on a CPU).  Stored as their transposes, the transposes the step
    applies on the way in and out cancel in XLA, and the step runs in the parameter's order.  A rotated leaf
    (``P`` present) keeps the core's orientation: there ``G~ = P^T G`` and ``P U~`` are GEMMs, whose operands
    and results XLA lays out in either order at no cost, and re-oriented moments would only add transposes
    (1.5x the time of an AdaDiag step on LLaMA-60M's shapes on a CPU).  With ``batch_dims > 0`` each matrix of
    the stack is transposed (the moments ``(*B, m, n)``, not the factored vectors ``(*B, m)``).
    """
    if state.P is not None or not transposed_frame(shape, batch_dims):
        return state  # a rotated leaf meets G only through GEMMs, which XLA lays out as needed
    moments = state._fields[3:-1]  # (count, P, Q, *moments, param_shape): the registry's field order
    matrices = [f for f in moments if getattr(state, f) is not None and getattr(state, f).ndim == 2 + batch_dims]
    return state._replace(**{f: jnp.matrix_transpose(getattr(state, f)) for f in matrices})


def core_states(state: CoreTransformState, params: Any, *, batch_dims: int = 0) -> Any:
    """The core's states (``ar.init``'s shapes: moments in the work frame) of a :class:`CoreTransformState`.

    ``params`` gives each leaf's shape (the parameters, or anything shaped like them).  The moment matrices
    of a tall parameter without a basis are transposed back (:class:`CoreTransformState`); every other field
    is returned as is, so ``ar.update(core_states(state, params)[k], ...)`` continues the adapter's trajectory.
    ``batch_dims``: the option the transformation was built with (which matrices a leaf's moments stack).
    """
    # params' structure is a prefix of the states': each parameter leaf meets its whole stored state
    return jax.tree.map(
        lambda param, leaf: _parameter_oriented(_core_state(leaf), tuple(np.shape(param)), batch_dims),
        params,
        state.states,
    )


def _init_leaf(path: Any, param: jax.Array, cfg: BaseConfig) -> LeafState:
    """``ar.init`` for one leaf, its moment matrices in the parameter's orientation (:func:`_parameter_oriented`),
    stored as a :class:`LeafState`.

    A leaf sharded over several devices is initialised under ``jax.jit``: the
    core places its zeros with ``device=device(param)``, which for such a leaf
    is a sharding that does not fit the 0-d counter; traced, XLA places them.
    """
    # a leaf with fewer dimensions than batch_dims: ValueError naming the leaf, before any state exists
    split_batch(tuple(np.shape(param)), cfg.batch_dims, name=jax.tree_util.keystr(path))
    shape = tuple(param.shape)
    sharding = getattr(param, "sharding", None)
    if sharding is not None and len(sharding.device_set) > 1:
        return jax.jit(lambda p: LeafState.of(_parameter_oriented(ar.init(p, cfg), shape, cfg.batch_dims)))(param)
    return LeafState.of(_parameter_oriented(ar.init(param, cfg), shape, cfg.batch_dims))


def _init_fn(opts: _Options) -> Callable[[Any], CoreTransformState]:
    """``init``: ``ar.init`` per leaf, which reads only what is static.

    The state's structure and values depend on the leaf's shape and dtype and on
    the static config (``sides``, ``max_basis_dim``, ``state_dtype``, the family,
    whether the Adafactor family keeps ``M``), never on a traced number, so
    ``jax.jit(init)`` works with injected hyperparameters as optax's own aliases
    do.  The one structural choice a traced number could make is the Adafactor
    family's momentum (``b1 > 0``): with ``b1`` traced, ``M`` is kept (unless
    ``momentum=False``), and a ``b1 = 0`` arriving later gives
    ``M_t = beta_hat(0) M + U_t = U_t``, the momentum-free direction, at the cost
    of ``M``'s memory; pass ``b1`` in ``static_args`` to decide it from its
    value.  Traced values are not validated (optax validates none either); the
    eager ``init`` sees them concretely and validates them.
    """

    def init_fn(params: Any) -> CoreTransformState:
        init_leaf = functools.partial(_init_leaf, cfg=opts.cfg)
        return CoreTransformState(states=jax.tree_util.tree_map_with_path(init_leaf, params))

    return init_fn


_OPTAX_ADAFACTOR_NAMES = {"clipping_threshold": "clip_threshold", "multiply_by_parameter_scale": "scale_parameter"}
"""``optax.adafactor``'s keywords that mean what an Adafactor-family option means -> that option's name."""


def _from_optax_names(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Adafactor family: ``optax.adafactor``'s keywords with the same meaning, under the core's names.

    * ``clipping_threshold=d`` is ``clip_threshold=d``: ``U / max(1, RMS(U) / d)``
      after the factored normalisation and before momentum (optax's
      ``clip_by_block_rms``); ``None`` disables it in both.
    * ``multiply_by_parameter_scale`` is ``scale_parameter``: the step times
      ``max(eps2, RMS(W_t))`` with ``eps2 = 1e-3`` (optax's
      ``scale_by_param_block_rms``).  The default stays the core's ``False``
      (optax's is ``True``).
    * ``min_dim_size_to_factor``: optax factors a matrix only when its second
      largest dimension is at least this; the core factors every matrix, which is
      ``1`` (or ``None``, the default here); any other value raises
      ``ValueError``.  Static, as in optax (``static_args``).
    * ``decay_rate`` and ``eps`` already have optax's names and meanings
      (``decay_rate`` is read under ``beta2_schedule="adafactor"``, optax's
      ``1 - t^(-decay_rate)``).

    Not accepted, because they mean something else here: optax's float
    ``momentum`` (an EMA without bias correction; here ``momentum`` is a bool,
    beta_1 is ``b1``), ``weight_decay_rate`` (not multiplied by the learning
    rate; here ``weight_decay`` is), ``decay_offset``, ``dtype_momentum``,
    ``factored`` and ``weight_decay_mask``.
    """
    if not _is_adafactor(name):
        return options
    options = dict(options)
    for theirs, ours in _OPTAX_ADAFACTOR_NAMES.items():
        if theirs in options:
            if ours in options:
                raise ValueError(f"pass {ours}= or optax's name {theirs}=, not both")
            options[ours] = options.pop(theirs)
    if "min_dim_size_to_factor" in options:
        size = options.pop("min_dim_size_to_factor")
        if _is_traced(size):
            raise TypeError("'min_dim_size_to_factor' is static (pass it in static_args)")
        size = _python(size)
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size > 1):
            raise ValueError(
                f"min_dim_size_to_factor must be None or an int <= 1 (the core factors the second moment of "
                f"every matrix), got {size!r}"
            )
    momentum = options.get("momentum")
    if momentum is not None and not isinstance(momentum, bool):
        raise ValueError(
            f"momentum must be True, False or None (whether M is kept; beta_1 is b1), got {momentum!r}; "
            "optax.adafactor's momentum=b (an EMA without bias correction) has no equivalent option"
        )
    return options


def scale_by_core(name: str, **options: Any) -> optax.GradientTransformation:
    """``scale_by_<name>`` for any core name: the preconditioned direction ``U = P U~ Q^T`` (no lr, no decay).

    ``options`` are core config fields (``betas``, ``eps``, ``update_freq``,
    ``max_basis_dim``, ``clip_threshold``, ...).  The numeric ones (betas, eps,
    update_freq, clip_threshold, decay_rate, eps2) may be traced arrays, as
    ``optax.inject_hyperparams`` passes them under ``jax.jit``; the others shape
    the state and are static.
    """
    options.pop("lr", None)
    options = _from_optax_names(name, options)
    opts = _options(name, {**options, "weight_decay": 0.0})
    needs_params = isinstance(opts.cfg, AdafactorConfig) and (opts.cfg.scale_parameter or opts.cfg.relative_step)

    def leaf(g: jax.Array, s: Any, w: jax.Array, cfg: BaseConfig, refreshed: Any) -> tuple[jax.Array, Any]:
        u, new_state, step_in = preconditioned_direction(s, g, cfg, w, refreshed=refreshed, xp=jnp)
        return jnp.astype(from_work(u, step_in.layout, jnp), w.dtype), new_state

    return _transformation(opts, leaf, needs_params)


def _fused_core(opts: _Options, learning_rate: ScalarOrSchedule, weight_decay: Any) -> optax.GradientTransformation:
    """The core's whole update ``delta = -eta_t (U + lambda W)`` as one transformation (schedules allowed).

    For Adafactor's ``relative_step`` / ``scale_parameter``, where ``eta_t``
    (``min(eta, 1/sqrt(t)) max(eps2, RMS(W_t))``) is not ``eta`` times a factor of ``U``:
    :func:`adadiag_ref.update` itself, with the learning rate (a schedule is
    evaluated at the count) and the weight decay (traced when injected).
    """

    def leaf(g: jax.Array, s: Any, w: jax.Array, cfg: BaseConfig, refreshed: Any) -> tuple[jax.Array, Any]:
        lr = learning_rate(s.count) if callable(learning_rate) else learning_rate  # one count for all leaves
        return ar.update(  # type: ignore[no-any-return]
            s, g, cfg, w, lr=lr, weight_decay=weight_decay, refreshed=refreshed, xp=jnp
        )

    return _transformation(opts, leaf, needs_params=True)


def _transformation(opts: _Options, step: LeafStep, needs_params: bool) -> optax.GradientTransformation:
    """``init`` (:func:`_init_fn`) and an ``update`` that runs ``step`` on every leaf (:func:`_tree_step`)."""

    def update_fn(updates: Any, state: CoreTransformState, params: Any = None) -> tuple[Any, CoreTransformState]:
        if params is None and needs_params:
            raise ValueError("this transformation needs params (weight decay or Adafactor parameter scaling uses W)")
        # Without parameter scaling the direction reads only W's shape and dtype.
        weights = updates if params is None else params
        return _tree_step(updates, state, weights, opts, step)  # type: ignore[no-any-return]

    return optax.GradientTransformation(_init_fn(opts), update_fn)


def _check_weight_decay(weight_decay: Any) -> None:
    """``weight_decay`` is a finite number >= 0 (checked when concrete; optax.add_decayed_weights checks nothing)."""
    if callable(weight_decay) or _is_traced(weight_decay):
        return
    value = _python(weight_decay)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")


def core_alias(
    name: str,
    learning_rate: ScalarOrSchedule,
    b1: Any = 0.9,
    b2: Any = 0.999,
    eps: Any = None,
    weight_decay: Any = 0.0,
    update_freq: Any = 200,
    **family_options: Any,
) -> optax.GradientTransformation:
    """``<name>`` alias: ``chain(scale_by_<name>, add_decayed_weights, scale_by_learning_rate)``.

    Equals the core's ``W_{t+1} = W_t - eta (P U~ Q^T + lambda W_t)``.  Every
    numeric argument can be injected with ``optax.inject_hyperparams`` and is
    traced under ``jax.jit`` (``update_freq`` included: the refresh predicate
    takes a traced period); ``update_freq=None`` and the family options that
    shape the state (``max_basis_dim``, ``momentum``, ``relative_step``,
    ``batch_dims``, ...) stay static.  ``batch_dims=k`` makes every leaf
    ``prod(shape[:k])`` independent matrices (stacked experts; give such leaves
    their own alias with ``optax.multi_transform``); a leaf with fewer than ``k``
    dimensions raises ``ValueError`` naming its path in ``init``.  ``init`` reads
    only static values, so it jits with injected hyperparameters too (``_init_fn``).  The Adafactor family also takes
    ``optax.adafactor``'s keywords of the same meaning (``_from_optax_names``).
    """
    # optax.inject_hyperparams binds the signature and passes ``**family_options`` back as one keyword.
    family_options = {**family_options.pop("family_options", {}), **family_options}
    family_options = _from_optax_names(name, family_options)
    _check_weight_decay(weight_decay)
    options = {"betas": (b1, b2), "eps": eps, "update_freq": update_freq, **family_options}
    opts = _options(name, {**options, "weight_decay": 0.0})  # lambda: add_decayed_weights or update's keyword
    if isinstance(opts.cfg, AdafactorConfig) and (opts.cfg.relative_step or opts.cfg.scale_parameter):
        return _fused_core(opts, learning_rate, weight_decay)
    return optax.chain(
        scale_by_core(name, **options),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )


def _is_adafactor(name: str) -> bool:
    entry = ar.OPTIMIZERS.get(name)
    return entry is not None and issubclass(entry.config_type, AdafactorConfig)


def _scale_by(name: str) -> Callable[..., optax.GradientTransformation]:
    def scale_by(
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float | None = None,
        update_freq: int | None = 200,
        **family_options: Any,
    ) -> optax.GradientTransformation:
        return scale_by_core(name, betas=(b1, b2), eps=eps, update_freq=update_freq, **family_options)

    def scale_by_adafactor_family(
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float | None = None,
        update_freq: int | None = 200,
        min_dim_size_to_factor: int | None = None,
        **family_options: Any,
    ) -> optax.GradientTransformation:
        return scale_by(b1, b2, eps, update_freq, min_dim_size_to_factor=min_dim_size_to_factor, **family_options)

    # optax.adafactor's min_dim_size_to_factor is named in this and _alias's signature: static_args needs it
    function = scale_by_adafactor_family if _is_adafactor(name) else scale_by
    function.__name__ = function.__qualname__ = f"scale_by_{name}"
    function.__doc__ = (
        f"Preconditioned direction of the core's ``{name!r}`` (no learning rate, no weight decay); "
        "see :func:`scale_by_core`."
    )
    return function


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

    def adafactor_family_alias(
        learning_rate: ScalarOrSchedule,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float | None = None,
        weight_decay: Any = 0.0,
        update_freq: int | None = 200,
        min_dim_size_to_factor: int | None = None,
        **family_options: Any,
    ) -> optax.GradientTransformation:
        options = {"min_dim_size_to_factor": min_dim_size_to_factor, **family_options}
        return alias(learning_rate, b1, b2, eps, weight_decay, update_freq, **options)

    function = adafactor_family_alias if _is_adafactor(name) else alias
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"The core's ``{name!r}`` as an optax optimizer; see :func:`core_alias`." + (
        "  Also takes ``optax.adafactor``'s ``clipping_threshold``, ``multiply_by_parameter_scale`` and "
        "``min_dim_size_to_factor`` (:func:`_from_optax_names`)."
        if _is_adafactor(name)
        else ""
    )
    return function


ALIASES: dict[str, Callable[..., optax.GradientTransformation]] = {name: _alias(name) for name in ar.OPTIMIZERS}
"""Core name -> optax alias, for the optimizers registered when this module was imported (``adamw``,
``adadiag``, ...; an optimizer registered later: :func:`core_alias` and :func:`scale_by_core` take its name)."""
SCALE_BY: dict[str, Callable[..., optax.GradientTransformation]] = {name: _scale_by(name) for name in ar.OPTIMIZERS}
"""Core name -> ``scale_by_<name>`` block."""
globals().update(ALIASES)  # optax-style module attributes: adamw, adadiag, ..., generated from the registry
globals().update({block.__name__: block for block in SCALE_BY.values()})  # scale_by_adamw, ...
