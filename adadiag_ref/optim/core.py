"""The one update machinery shared by all eight optimizers.

For a parameter ``W`` (work frame ``m x n``, ``m <= n``) and gradient ``G``::

    refresh (t = 1 or (t - 1) mod T == 0):  P, _, Q = canonical_svd(G)
    G~      = P^T G Q                      (rotate; P or Q is I when absent)
    U~, S_t = family.direction(S_{t-1}, G~, t)
    W_{t+1} = W_t - eta_t (P U~ Q^T + lambda W_t)   (unrotate, decoupled decay)

``init``, ``refresh_basis`` and ``update`` are pure and trace under ``jax.jit``
(no Python branching on array values).  ``step`` is the eager driver: it checks
its input, decides on the refresh with a Python ``if`` and applies the update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .._xp import (
    Array,
    Namespace,
    count_nonfinite,
    creation_device,
    float_dtype_name,
    namespace,
    require_linalg,
    sqrt,
    state_dtype,
    warn_at_caller,
)
from ..config import BaseConfig, _is_traced, check_learning_rate, step_config
from ..linalg import DecompositionError, DecompositionWarning, NonFiniteInputError, canonical_svd, canonical_svd_batch
from . import rotation as _rotation
from .families import Moments, State, family_of
from .layout import Layout, layout_for, split_batch, to_work
from .schedules import host_step, learning_rate
from .tail import parameter_delta

DirectionFn = Callable[[Any, Array, Any, BaseConfig, Namespace], "tuple[Array, Moments]"]
"""``(state, G~, t, cfg, xp) -> (U~, moments)``: a family's direction (its reference, or the engine's routed one)."""

__all__ = [
    "SLOW_REFRESH_SIDE",
    "NonFiniteGradientWarning",
    "SlowRefreshWarning",
    "check_inputs",
    "check_orientation",
    "check_state",
    "init",
    "preconditioned_direction",
    "refresh_basis",
    "refresh_due",
    "refresh_step_structure",
    "rotate",
    "step",
    "unrotate",
    "update",
]


def _in_parameter_order(x: Array | None, batch: tuple[int, ...], xp: Namespace) -> Array | None:
    """A zero ``m x n`` state matrix of a tall parameter, stored as the transpose of an ``n x m`` array (each
    matrix of a stack ``(*B, m, n)``; vectors unchanged).

    Shapes stay those of the work frame; only the memory order follows the
    parameter, so that ``G``, ``W`` and the moments are traversed in one order.
    """
    if x is None or x.ndim != 2 + len(batch):
        return x
    shape = (*batch, x.shape[-1], x.shape[-2])
    return xp.matrix_transpose(xp.zeros(shape, dtype=x.dtype, device=creation_device(x)))


def _identity(k: int, batch: tuple[int, ...], dtype: Any, device: Any, xp: Namespace) -> Array:
    """``I_k``, or a stack ``(*B, k, k)`` of them (a new array, not a broadcast view: bases are replaced in place)."""
    eye = xp.eye(k, dtype=dtype, device=device)
    return eye + xp.zeros((*batch, k, k), dtype=dtype, device=device) if batch else eye


SLOW_REFRESH_SIDE = 2048
"""Longest rotated side ``init`` accepts without a :class:`SlowRefreshWarning`.

From the measured refresh time per side (``benchmarks/refresh_size.py``, table in
``docs/reliability.md``): one refresh of an ``n``-wide side costs ``t = c n^3``;
2048 is the largest power of two whose refresh stays under one minute in both
float32 and float64 on the reference 2-core machine.  The default
``max_basis_dim = 8192`` is the largest power of two whose float32 refresh stays
under 30 minutes there (about 15; SOAP's 10,000 would take about 27).
"""

REFRESH_SECONDS_PER_N3 = {"float32": 1.6e-9, "float64": 5.6e-9}
"""Fitted ``c`` of ``t = c n^3`` (seconds per refresh, reference machine; ``docs/reliability.md``)."""


class SlowRefreshWarning(UserWarning):
    """A rotated side is longer than :data:`SLOW_REFRESH_SIDE`: each basis refresh takes minutes (``~ n^3``)."""


def _warn_slow_refresh(layout: Layout, dtype: Any, xp: Namespace) -> None:
    """Warn when the longest rotated side ``n`` exceeds :data:`SLOW_REFRESH_SIDE` (it is <= ``max_basis_dim``)."""
    side = layout.cols if layout.rotate_right else layout.rows if layout.rotate_left else 0
    if side <= SLOW_REFRESH_SIDE:
        return
    dtype_name = "float64" if dtype == getattr(xp, "float64", None) else "float32"
    c = REFRESH_SECONDS_PER_N3[dtype_name]
    warn_at_caller(
        f"a parameter of shape {layout.shape} has a rotated side of {side} > {SLOW_REFRESH_SIDE}: each basis "
        f"refresh costs about {c * side**3 / 60:.0f} min ({dtype_name}, t = c n^3 measured on a 2-core machine; "
        "docs/reliability.md); pass a smaller max_basis_dim to leave that side unrotated",
        SlowRefreshWarning,
    )


def init(param: Array, cfg: BaseConfig, *, xp: Namespace | None = None) -> State:
    """Initial state: zero moments, identity bases, ``count = 0``.

    Shapes follow :func:`~adadiag_ref.optim.layout.layout_for` (with ``cfg.batch_dims > 0`` every field but
    ``count`` and ``param_shape`` carries the leading batch shape ``B``: ``P`` is ``(*B, m, m)``, the moments
    ``(*B, m, n)`` or ``(*B, m)``); the dtype is the
    state dtype of ``param`` (float64 for float64, float32 otherwise).
    ``param_shape`` records ``param.shape`` (a zero-size array, :data:`adadiag_ref.optim.families.State`)
    so that a state is refused for a parameter of another orientation.
    A rotated side longer than :data:`SLOW_REFRESH_SIDE` (and at most
    ``cfg.max_basis_dim``) issues a :class:`SlowRefreshWarning`.
    """
    xp = namespace(param, xp=xp)
    layout = layout_for(tuple(param.shape), cfg)
    dtype = state_dtype(param.dtype, xp, cfg.state_dtype)
    device = creation_device(param)
    m, n = layout.rows, layout.cols
    _warn_slow_refresh(layout, dtype, xp)
    batch = layout.batch
    P = _identity(m, batch, dtype, device, xp) if layout.rotate_left else None
    Q = _identity(n, batch, dtype, device, xp) if layout.rotate_right else None
    count = xp.zeros((), dtype=xp.int32, device=device)
    family = family_of(cfg)
    moments = {
        name: None if shape is None else xp.zeros((*batch, *shape), dtype=dtype, device=device)
        for name, shape in family.moment_shapes(cfg, m, n).items()
    }
    if layout.transposed:
        moments = {name: _in_parameter_order(value, batch, xp) for name, value in moments.items()}
    param_shape = xp.zeros((0, *layout.shape), dtype=dtype, device=device)
    return family.state_type(count=count, P=P, Q=Q, **moments, param_shape=param_shape)  # type: ignore[no-any-return]


def check_orientation(state: State, shape: tuple[int, ...], *, name: str | None = None) -> None:
    """Refuse a state created for a parameter of another shape (e.g. ``(7, 9)`` for ``(9, 7)``).

    The work-frame field shapes cannot tell such parameters apart (both are
    ``7 x 9``); the state's ``param_shape`` can.  Reads only static shapes, so
    it runs under ``jax.jit`` too.  Raises ``ValueError``; touches nothing.
    """
    recorded = getattr(state, "param_shape", None)
    if recorded is None:
        return
    created = tuple(int(d) for d in recorded.shape[1:])
    if created != tuple(int(d) for d in shape):
        raise ValueError(
            f"{_label(name)}: the optimizer state was created for a parameter of shape {created}, not "
            f"{tuple(shape)}: was it the state of another parameter? The state was left unchanged"
        )


def work_dtype(state: State) -> Any:
    """The state dtype, in which every step computes: that of the state's arrays (the first moment present, else
    the ``param_shape`` record, else a basis)."""
    for name in state._fields[3:]:
        value = getattr(state, name)
        if value is not None:
            return value.dtype
    basis = state.P if state.P is not None else state.Q
    if basis is None:
        raise ValueError("the state holds no array to take its dtype from (no moment, no param_shape, no basis)")
    return basis.dtype


class NonFiniteGradientWarning(RuntimeWarning):
    """An unvalidated refresh met a gradient with NaN or Inf and kept the previous basis."""


def rotate(
    g: Array, P: Array | None = None, Q: Array | None = None, xp: Namespace | None = None, *, transposed: bool = False
) -> Array:
    """``G~ = P^T G Q`` (a missing basis, ``None``, is the identity); ``xp`` as everywhere (``None``: from ``g``).

    ``transposed``: ``g`` is the transposed view of a tall parameter (:func:`~adadiag_ref.optim.layout.to_work`),
    the product then keeps the parameter's memory order (:func:`adadiag_ref.optim.rotation.rotate`).
    """
    return _rotation.rotate(g, P, Q, namespace(g, xp=xp), transposed=transposed)


def unrotate(
    u: Array, P: Array | None = None, Q: Array | None = None, xp: Namespace | None = None, *, transposed: bool = False
) -> Array:
    """``P U~ Q^T``, the inverse of :func:`rotate` for orthogonal ``P`` and ``Q`` (``xp``, ``transposed`` as there)."""
    return _rotation.unrotate(u, P, Q, namespace(u, xp=xp), transposed=transposed)


def _where(name: str | None, state: State, shape: tuple[int, ...], count: int | None = None) -> str:
    """``"parameter 'fc.weight' (shape (7, 9)) at step 5"`` for error and warning messages (``count``: the host
    counter, when the caller keeps one; else the state's is read)."""
    try:
        t: Any = (int(state.count) if count is None else count) + 1
    except Exception:  # a traced counter (jax.jit): no concrete step
        t = "?"
    who = f"parameter {name!r}" if name else "parameter"
    return f"{who} (shape {shape}) at step {t}"


def _label(name: str | None) -> str:
    """``"parameter 'fc.weight'"`` (or ``"the parameter"``): who a mismatch error is about."""
    return f"parameter {name!r}" if name else "the parameter"


def _library(x: Array) -> str:
    """The library of an array, from its type (``numpy``, ``torch``, ``jax``, ...): a few hundred nanoseconds,
    no namespace resolution.  A JAX array and a JAX tracer are both ``jax``."""
    root = type(x).__module__.partition(".")[0]
    return "jax" if root == "jaxlib" else root


def _one_library(a: Array, b: Array) -> bool:
    """Whether ``a`` and ``b`` are of one type up to subclassing (a torch ``Parameter`` and its ``Tensor`` state):
    ``isinstance`` only, which ``torch.compile`` traces without a graph break (``str`` methods it does not)."""
    return isinstance(a, type(b)) or isinstance(b, type(a))


def check_backends(state: State, param: Array, *, name: str | None = None) -> None:
    """``TypeError`` unless every array of ``state`` comes from ``param``'s library (a NumPy basis beside a JAX
    parameter, a torch state beside a NumPy parameter), before anything is computed: one line naming the
    parameter, the field and both libraries.  Reads types only (traces under ``jax.jit``)."""
    for field in state._fields:
        value = getattr(state, field)
        if value is None or _one_library(value, param) or not hasattr(value, "shape"):  # the common case
            continue
        if _library(value) != _library(param):  # None fields and host ints aside
            raise TypeError(
                f"{_label(name)} is a {_library(param)} array but its optimizer state's {field!r} is a "
                f"{_library(value)} array: make the state with ar.init on the parameter itself (or convert it); the "
                "state was left unchanged"
            )


JIT_TOOLKIT = (
    "under jax.jit use adadiag_ref.update (traceable) with adadiag_ref.refresh_when_due (the refresh as one "
    "lax.cond and host callback) and adadiag_ref.traced_refresh_due; docs/embedding.md, 'Your own jitted loop'"
)


def _refuse_traced(function: str, *arrays: Array) -> None:
    """One-line ``TypeError`` for an eager function called under ``jax.jit`` (instead of JAX's
    ``TracerBoolConversionError`` deep inside), pointing to the traceable toolkit."""
    if any(_is_traced(a) for a in arrays):
        raise TypeError(f"adadiag_ref.{function} is eager (it reads values on the host); {JIT_TOOLKIT}")


def _check_failure_policy(on_nonfinite: str, on_failure: str) -> None:
    """``ValueError`` unless both policies of a refresh (:func:`refresh_basis`) are ``"keep"`` or ``"raise"``."""
    if on_nonfinite not in ("keep", "raise") or on_failure not in ("keep", "raise"):
        raise ValueError(f"on_nonfinite and on_failure must be 'keep' or 'raise', got {on_nonfinite!r}, {on_failure!r}")


def refresh_basis(
    state: State,
    grad: Array,
    cfg: BaseConfig,
    *,
    name: str | None = None,
    on_nonfinite: str = "keep",
    on_failure: str = "keep",
    count: int | None = None,
    xp: Namespace | None = None,
) -> State:
    """``P_t, _, Q_t^T = canonical_svd(G_t)``: new bases, moments untouched.

    Only the sides the layout rotates are decomposed (a one-sided optimizer never
    forms ``Q``).  Same shapes and dtypes in and out.  ``cfg.basis_method``
    chooses the route (:func:`~adadiag_ref.linalg.gram_route_applies`): the
    canonical SVD, or for a float32 one-sided refresh the eigenvectors of the
    float64 Gram matrix ``G_t G_t^T`` under the same canonical rules.  A state
    created for a parameter of another shape (``(7, 9)`` for a ``(9, 7)``
    gradient) raises ``ValueError`` (:func:`check_orientation`).

    Failure policy (``docs/reliability.md``); ``name`` labels the parameter in messages:

    * ``G_t`` holds NaN or Inf: no decomposition runs.  ``on_nonfinite="keep"``
      (default; safe inside a host callback under ``jax.jit``) returns ``state``
      unchanged (the previous bases ``P_{t-1}, Q_{t-1}``) with a
      :class:`NonFiniteGradientWarning`; ``"raise"`` raises ``ValueError``.
    * the SVD fails on every rung of :data:`~adadiag_ref.linalg.DECOMPOSITION_LADDER`:
      ``on_failure="keep"`` (default) keeps the previous bases with a
      :class:`~adadiag_ref.linalg.DecompositionWarning`; ``"raise"`` raises
      :class:`~adadiag_ref.linalg.DecompositionError`.

    A kept basis is returned as the very same objects (``new.P is state.P``).  ``count`` (the steps taken, a
    host int, as in :func:`step`) only names the step in messages, without reading the state's counter.

    A stack (``cfg.batch_dims > 0``) is refreshed as one batched decomposition
    (:func:`~adadiag_ref.linalg.canonical_svd_batch`: one stacked call on a device backend; on NumPy each
    matrix's :func:`~adadiag_ref.linalg.canonical_svd`, so each basis is bit for bit its own run's), and as one
    unit under the failure policy: when any of its matrices holds NaN or Inf or cannot be decomposed, every
    matrix of the stack keeps its previous basis.
    """
    _check_failure_policy(on_nonfinite, on_failure)
    _refuse_traced("refresh_basis", grad, state.count)
    xp = namespace(grad, xp=xp)
    check_orientation(state, tuple(grad.shape), name=name)
    layout = layout_for(tuple(grad.shape), cfg)
    if not layout.rotate_left:
        return state
    check_backends(state, grad, name=name)
    require_linalg(xp, f"the refresh of {_label(name)} ({cfg.name!r})")
    g = to_work(xp.astype(grad, work_dtype(state), copy=False), layout, xp)
    label = f"gradient of {_where(name, state, layout.shape, count)}"
    try:
        P, Q = _decompose(g, layout, cfg.basis_method, label, xp)
    except NonFiniteInputError:
        message = f"the {label} contains NaN or Inf"
        if on_nonfinite == "raise":
            raise ValueError(f"{message}; the optimizer state was left unchanged") from None
        warn_at_caller(f"{message}: kept the previous basis", NonFiniteGradientWarning)
        return state
    except DecompositionError as exc:
        if on_failure == "raise":
            raise
        warn_at_caller(f"{exc}; kept the previous basis", DecompositionWarning)
        return state
    return state._replace(P=P, Q=Q)


def _decompose(g: Array, layout: Layout, method: str, label: str, xp: Namespace) -> tuple[Array, Array | None]:
    """``(P, Q)`` of the work-frame gradient ``g`` (``Q`` only where the layout rotates the right side): its
    :func:`~adadiag_ref.linalg.canonical_svd`, or for a stack ``(*B, m, n)`` the canonical SVD of every matrix by
    one :func:`~adadiag_ref.linalg.canonical_svd_batch` (a matrix it leaves undecided takes ``canonical_svd``,
    which raises as for one matrix), restacked as ``(*B, m, m)`` and ``(*B, n, n)``."""
    right = layout.rotate_right
    if not layout.batch:
        svd = canonical_svd(g, compute_p=True, compute_q=right, method=method, label=label, xp=xp)
        return svd.P, svd.Q if right else None
    m, n = layout.rows, layout.cols
    flat = xp.reshape(g, (-1, m, n))
    matrices = [flat[i, ...] for i in range(flat.shape[0])]
    decided = canonical_svd_batch(matrices, compute_p=True, compute_q=right, method=method, xp=xp)
    svds = [
        svd
        if svd is not None
        else canonical_svd(G, compute_p=True, compute_q=right, method=method, label=f"{label}, matrix {i}", xp=xp)
        for i, (G, svd) in enumerate(zip(matrices, decided, strict=True))
    ]
    P = xp.reshape(xp.stack([svd.P for svd in svds]), (*layout.batch, m, m))
    Q = xp.reshape(xp.stack([svd.Q for svd in svds]), (*layout.batch, n, n)) if right else None
    return P, Q


def refresh_step_structure(
    g_rot: Array, two_sided: bool, refreshed: Any, xp: Namespace, *, rank_from: Array | None = None
) -> Array:
    """A refresh step's ``G~`` set to its exact-arithmetic structure (``docs/spec.md``, section 5).

    On the step whose gradient defined the bases, ``G~ = P^T G Q`` is, in exact arithmetic, ``Sigma``
    (two-sided: ``G~_ii = sigma_i``, every other entry zero) or ``Sigma Q^T`` (one-sided, only ``P``
    rotating: row ``i`` is ``sigma_i q_i^T``).  In floating point the structural zeros are rounding noise
    (``~eps ||G||``, and more between the vectors of a rotated cluster of equal singular values), which the
    Adafactor/Hfac normalisation ``G~ / sqrt(V)`` (eps = 1e-30) and Adam's ``M / (sqrt(V) + eps)`` turn into
    backend-dependent updates.  So, when ``refreshed`` is true:

    * two-sided: keep ``G~_ii`` for ``i < r``, zero everything else;
    * one-sided: zero the rows ``i >= r``, keep the others untouched;

    with ``r = #{i : s_i > max(m, n) eps(dtype) max_j s_j}`` (``canonical_svd``'s rank rule 2), where
    ``s_i = |G~_ii|`` (two-sided) or ``||G~_i,:||`` (one-sided) equal ``sigma_i`` to rounding.  Which entries
    are kept depends on no entry's rounding, only on the rank, and no entry that is nonzero in exact arithmetic
    (within the rank) is zeroed.
    ``refreshed`` is a bool or, under ``jax.jit``, a boolean 0-d array (``G~`` is returned as is where false).
    For a stack ``(*B, m, n)`` (``batch_dims``) the rule holds per matrix (its own rank).  ``rank_from`` (a
    sharded caller's block of whole columns: ``adapters/_sharded.py``) is the whole parameter's ``G~``, from which
    the rank is taken, so a block keeps exactly the rows the whole step keeps.
    """
    m, n = g_rot.shape[-2:]
    device = creation_device(g_rot)
    # the index grids in G~'s own memory order (zeros_like keeps it), so that the result keeps it too
    grid = xp.zeros_like(g_rot, dtype=xp.int32)
    rows = grid + xp.reshape(xp.arange(m, dtype=xp.int32, device=device), (m, 1))
    ranked = g_rot if rank_from is None else rank_from
    keep = rows < _numerical_rank(_structure_sizes(ranked, two_sided, xp), max(ranked.shape[-2:]), xp)
    if two_sided:
        keep = keep & (rows == grid + xp.reshape(xp.arange(n, dtype=xp.int32, device=device), (1, n)))
    if refreshed is not True:
        keep = keep | ~refreshed
    return xp.where(keep, g_rot, xp.zeros_like(g_rot))


def _structure_sizes(g_rot: Array, two_sided: bool, xp: Namespace) -> Array:
    """``s_i`` of every matrix of ``g_rot`` (``(*B, m, n)``), shape ``(*B, m)``: ``|G~_ii|`` (two-sided) or
    ``||G~_i,:||`` up to one positive factor per matrix (one-sided), both ``sigma_i`` to rounding.  For the row
    norms each matrix is scaled by its ``max |G~|`` first: no underflow of the squares of a tiny float32
    gradient, no overflow of a huge one."""
    m, n = g_rot.shape[-2:]
    if two_sided:
        device = creation_device(g_rot)
        rows = xp.reshape(xp.arange(m, dtype=xp.int32, device=device), (m, 1))
        diagonal = rows == xp.reshape(xp.arange(n, dtype=xp.int32, device=device), (1, n))
        return xp.sum(xp.where(diagonal, xp.abs(g_rot), xp.zeros_like(g_rot)), axis=-1)  # one nonzero term a row
    scale = xp.max(xp.abs(g_rot), axis=(-2, -1), keepdims=True)
    y = g_rot / xp.where(scale > 0, scale, xp.ones_like(scale))
    return sqrt(xp.sum(y * y, axis=-1), xp)


def _numerical_rank(sizes: Array, side: int, xp: Namespace) -> Array:
    """``#{i : s_i > side eps max_j s_j}`` per matrix, shape ``(*B, 1, 1)`` (broadcasts against ``(*B, m, n)``;
    traces under ``jax.jit``): rule 2 of ``canonical_svd``."""
    tol = side * float(xp.finfo(sizes.dtype).eps) * xp.max(sizes, axis=-1, keepdims=True)
    rank = xp.sum(xp.astype(sizes > tol, xp.int32), axis=-1, keepdims=True)
    return xp.reshape(rank, (*rank.shape, 1))


class StepInput(NamedTuple):
    """What every update form computes first (:func:`prepare_step`)."""

    layout: Layout
    t: Array  # the step t = count + 1, in the state dtype
    g: Array  # G in the work frame and state dtype
    w: Array  # W in the work frame and state dtype
    g_rot: Array  # G~ = P^T G Q, set to its exact structure on a refresh step


def host_count(count: Any) -> int | None:
    """``count`` (the steps taken, kept by the caller on the host) checked: ``None`` or an int ``>= 0``."""
    if count is None:
        return None
    if isinstance(count, bool) or not isinstance(count, int | np.integer):
        raise TypeError(f"count must be a host int (the number of steps taken) or None, got {type(count).__name__}")
    if count < 0:
        raise ValueError(f"count must be >= 0 (the number of steps taken), got {count}")
    return int(count)


def prepare_step(
    state: State,
    grad: Array,
    cfg: BaseConfig,
    param: Array,
    refreshed: Any,
    xp: Namespace,
    count: int | None = None,
    *,
    block: Layout | None = None,
    whole_grad: Array | None = None,
    name: str | None = None,
) -> StepInput:
    """Check shapes, then form ``t``, ``G`` and ``W`` in the work frame and ``G~`` (shared by the update forms).

    ``t = count + 1`` from the host counter when given (:func:`~adadiag_ref.optim.schedules.host_step`: the
    coefficients are then host numbers), else from the state's counter.

    ``block`` (a sharded caller, ``adapters/_sharded.py``): ``param`` and ``grad`` are a block of whole columns
    (or rows) of a larger parameter's work frame whose rotated sides the block holds entirely; ``block`` is their
    layout (``rows``/``cols`` the block's, ``transposed`` and the rotated sides the whole parameter's) and the state
    holds the block's moments.  ``whole_grad`` (the whole parameter's gradient, parameter-shaped) then gives the
    numerical rank of a refresh step's structure (:func:`refresh_step_structure`), so the block keeps exactly the
    rows the whole step keeps.  ``name`` labels the parameter in the shape checks' messages.
    """
    layout = layout_for(tuple(param.shape), cfg) if block is None else block
    _check_static(state, grad, param, layout, cfg, name=name)
    dtype = work_dtype(state)
    # copy=False: no copy of G and W when they already have the state dtype (nothing here mutates them)
    g = to_work(xp.astype(grad, dtype, copy=False), layout, xp)
    w = to_work(xp.astype(param, dtype, copy=False), layout, xp)
    g_rot = _rotation.rotate(g, state.P, state.Q, xp, transposed=layout.transposed)
    if state.P is not None and refreshed is not False:
        rank_from = None
        if whole_grad is not None:  # a block of whole columns: the rank is the whole parameter's
            whole = to_work(xp.astype(whole_grad, dtype, copy=False), layout_for(tuple(whole_grad.shape), cfg), xp)
            rank_from = _rotation.rotate(whole, state.P, state.Q, xp, transposed=layout.transposed)
        g_rot = refresh_step_structure(g_rot, state.Q is not None, refreshed, xp, rank_from=rank_from)
    t = host_step(count, dtype, xp) if count is not None else xp.astype(state.count + 1, dtype)
    return StepInput(layout, t, g, w, g_rot)


def update(
    state: State,
    grad: Array,
    cfg: BaseConfig,
    param: Array,
    *,
    lr: Any = None,
    weight_decay: Any = None,
    betas: Any = None,
    refreshed: Any = False,
    count: int | None = None,
    name: str | None = None,
    xp: Namespace | None = None,
) -> tuple[Array, State]:
    """One optimizer update with the current bases (never refreshes).

    Returns ``(delta, new_state)`` with ``W_{t+1} = W_t + delta`` and
    ``delta = -eta_t (P U~ Q^T + lambda W_t)``.  The step's hyperparameters may change at every step:
    ``lr`` overrides ``cfg.lr`` (``eta``), ``weight_decay`` ``cfg.weight_decay`` (``lambda``) and ``betas``
    ``cfg.betas`` (``beta_1, beta_2``; ``beta_1`` must stay ``> 0`` or ``= 0`` as in ``cfg``, which made the
    state).  Each is a number or a 0-d array: known on the host it is validated by ``make_config``'s rules
    (``ValueError``, nothing computed); traced (``jax.jit``) or on a device it is used as it is
    (:func:`~adadiag_ref.config.step_config`), cast to the state dtype except ``lr``.  The result equals the
    update under a config rebuilt with those values, bit for bit.  ``delta`` has the
    parameter's dtype; all arithmetic runs in the state dtype.  ``name`` labels the parameter in errors.

    ``refreshed`` (a bool, or a boolean array under ``jax.jit``) says that the
    bases were just computed from this very gradient.  Then ``G~`` is ``Sigma``
    (two-sided) or ``Sigma Q^T`` (one-sided) in exact arithmetic, and its structural
    zeros (rounding noise in floating point) are set to exactly zero (:func:`refresh_step_structure`).

    ``count``: the steps taken (``state.count``) as a host int, for a caller that keeps its own counter
    (:func:`step`): the step's coefficients are then host numbers, not device arrays.
    """
    xp = step_namespace(grad, param, xp, name)
    cfg = step_hyperparameters(cfg, state, xp, lr=lr, weight_decay=weight_decay, betas=betas)
    step_in = prepare_step(state, grad, cfg, param, refreshed, xp, host_count(count), name=name)
    return update_prepared(state, step_in, cfg, param, lr, xp)


def step_hyperparameters(
    cfg: BaseConfig, state: State, xp: Namespace, *, lr: Any = None, weight_decay: Any = None, betas: Any = None
) -> BaseConfig:
    """The config of one step with its per-step ``weight_decay`` and ``betas``
    (:func:`~adadiag_ref.config.step_config`: validated when known on the host; a traced or device value cast to
    the state dtype, so that a float64 value never promotes a float32 step), after checking ``lr``
    (:func:`~adadiag_ref.config.check_learning_rate`).  ``cfg`` itself when neither is given."""
    check_learning_rate(lr)
    if weight_decay is None and betas is None:
        return cfg
    dtype = work_dtype(state)
    return step_config(
        cfg, weight_decay=weight_decay, betas=betas, cast=lambda value: xp.astype(xp.asarray(value), dtype)
    )


def update_prepared(
    state: State,
    step_in: StepInput,
    cfg: BaseConfig,
    param: Array,
    lr: Any,
    xp: Namespace,
    direction: DirectionFn | None = None,
) -> tuple[Array, State]:
    """:func:`update` after :func:`prepare_step`: ``U~`` by the family's ``direction`` (or the given function of
    the same signature: the engine's routes), ``P U~ Q^T`` (:func:`_direction`), the family's step size and the
    shared tail (:func:`~adadiag_ref.optim.tail.parameter_delta`): ``delta = -eta_t (P U~ Q^T + lambda W_t)`` in
    the parameter's frame and dtype."""
    unrotated, new_state = _direction(state, step_in, cfg, xp, direction)
    eta_t = family_of(cfg).step_size(cfg, step_in.t, step_in.w, learning_rate(cfg, lr), xp)
    return parameter_delta(unrotated, step_in.w, eta_t, cfg, step_in.layout, param.dtype, xp, owned=False), new_state


def preconditioned_direction(
    state: State,
    grad: Array,
    cfg: BaseConfig,
    param: Array,
    *,
    refreshed: Any = False,
    count: int | None = None,
    xp: Namespace | None = None,
) -> tuple[Array, State, StepInput]:
    """The preconditioned direction ``U = P U~ Q^T`` of one step, without step size or weight decay.

    Returns ``(U, new_state, step_input)``: ``U`` in the work frame and state
    dtype (:func:`~adadiag_ref.optim.layout.from_work` maps it to the
    parameter's shape), the state with the new moments and ``count + 1``, and
    the :class:`StepInput` (``t``, ``G``, ``W``, ``G~``) it was computed from.
    :func:`update` is ``delta = -eta_t (U + lambda W_t)`` on top of it; an
    optax-style ``scale_by`` transformation returns ``U`` itself.  ``U~`` is the family's reference
    ``direction``; ``count`` as in :func:`update`.
    """
    xp = namespace(grad, param, xp=xp)
    step_in = prepare_step(state, grad, cfg, param, refreshed, xp, host_count(count))
    return (*_direction(state, step_in, cfg, xp), step_in)


def _direction(
    state: State, step_in: StepInput, cfg: BaseConfig, xp: Namespace, direction: DirectionFn | None = None
) -> tuple[Array, State]:
    """``(P U~ Q^T, new_state)`` from a prepared step; ``U~`` by ``direction``, else the family's reference."""
    u_rot, moments = (direction or family_of(cfg).direction)(state, step_in.g_rot, step_in.t, cfg, xp)
    direction = _rotation.unrotate(u_rot, state.P, state.Q, xp, transposed=step_in.layout.transposed)
    return direction, state._replace(count=state.count + 1, **moments)


def refresh_due(count: int, cfg: BaseConfig) -> bool:
    """Whether step ``t = count + 1`` refreshes the basis: ``t == 1`` or ``(t - 1) mod T == 0``."""
    t = count + 1
    return t == 1 or (cfg.update_freq is not None and (t - 1) % cfg.update_freq == 0)


def _check_gradient_shape(grad: Array, param: Array, name: str | None = None) -> None:
    if tuple(grad.shape) != tuple(param.shape):
        raise ValueError(
            f"{_label(name)}: gradient shape {tuple(grad.shape)} does not match parameter shape "
            f"{tuple(param.shape)}; the optimizer state was left unchanged"
        )


def _check_gradient_dtype(grad: Array, param: Array, xp: Namespace, name: str | None = None) -> None:
    try:
        pname, gname = float_dtype_name(param.dtype, xp), float_dtype_name(grad.dtype, xp)
    except ValueError as exc:
        raise ValueError(f"{_label(name)}: {exc}") from None
    if pname != gname:
        raise ValueError(
            f"{_label(name)}: gradient dtype {gname} does not match parameter dtype {pname}; the optimizer state "
            "was left unchanged"
        )


def check_gradient_matches(grad: Array, param: Array, xp: Namespace, *, name: str | None = None) -> None:
    """``ValueError`` unless ``G`` has the parameter's shape and real floating dtype (no value read): the checks
    of one gradient against its parameter that :func:`check_inputs` and the engine share; ``name`` labels it."""
    _check_gradient_shape(grad, param, name)
    _check_gradient_dtype(grad, param, xp, name)


def step_namespace(grad: Array, param: Array, xp: Namespace | None, name: str | None = None) -> Namespace:
    """The namespace of one step's gradient and parameter (``xp`` when given, a plain module wrapped), and a
    ``TypeError`` naming the parameter when they come from two libraries (instead of array_api_compat's
    "Multiple namespaces")."""
    if xp is None and not _one_library(grad, param) and _library(grad) != _library(param):
        raise TypeError(
            f"{_label(name)} is a {_library(param)} array but its gradient a {_library(grad)} array: pass both "
            "from one library; the optimizer state was left unchanged"
        )
    return namespace(grad, param, xp=xp)


def _check_static(
    state: State, grad: Array, param: Array, layout: Layout, cfg: BaseConfig, *, name: str | None = None
) -> None:
    _check_gradient_shape(grad, param, name)
    family = family_of(cfg)
    if not isinstance(state, family.state_type):
        raise ValueError(
            f"{_label(name)}: state of type {type(state).__name__} does not belong to optimizer {cfg.name!r}"
        )
    check_backends(state, param, name=name)
    m, n, batch = layout.rows, layout.cols, layout.batch
    expected = {
        "P": (*batch, m, m) if layout.rotate_left else None,
        "Q": (*batch, n, n) if layout.rotate_right else None,
        **{k: None if v is None else (*batch, *v) for k, v in family.moment_shapes(cfg, m, n).items()},
    }
    for field in state._fields:
        if field in ("count", "param_shape"):
            continue
        value = getattr(state, field)
        want = expected[field]
        got = None if value is None else tuple(value.shape)
        if got != want:
            raise ValueError(
                f"{_label(name)}: state field {field!r} has shape {got}, expected {want} for a parameter of shape "
                f"{layout.shape} under {cfg.name!r}: was the state created for another parameter or config?"
            )
    # a float64 state under state_dtype="float32" would otherwise stay float64
    if cfg.state_dtype is not None and cfg.state_dtype not in str(work_dtype(state)):
        raise ValueError(
            f"{_label(name)}: the optimizer state holds {work_dtype(state)!s}, but the config says state_dtype="
            f"{cfg.state_dtype!r}: make the state with ar.init under this config; the state was left unchanged"
        )
    check_orientation(state, tuple(param.shape), name=name)  # equal work frames, another parameter shape


def check_state(state: State, grad: Array, param: Array, cfg: BaseConfig, *, name: str | None = None) -> None:
    """``ValueError`` naming the parameter unless ``state`` belongs to ``cfg``'s optimizer and holds, for a
    parameter of ``param``'s shape and orientation, ``P`` (``m x m``), ``Q`` (``n x n``) and the moments of the
    family's shapes in its work frame (``m x n``, ``m <= n``), and ``G`` has ``W``'s shape: the checks of
    :func:`check_inputs` that read no value (no finiteness scan, no dtype rule); nothing is changed."""
    _check_static(state, grad, param, layout_for(tuple(param.shape), cfg), cfg, name=name)


def check_inputs(
    state: State,
    grad: Array,
    cfg: BaseConfig,
    param: Array,
    *,
    name: str | None = None,
    count: int | None = None,
    xp: Namespace | None = None,
) -> None:
    """Eager validation of one step's input; raises ``ValueError`` and touches nothing.

    Checks shapes against the parameter and the state, that parameter and
    gradient share one real floating dtype, and that the gradient is finite
    (the message names the parameter, ``name`` when given, and the step: ``count + 1`` when the caller keeps
    the counter on the host, else read from the state).  One host synchronisation: the finiteness verdict.
    Every mismatch (shape, dtype, a state of another library or dtype) names the parameter in one line.
    Eager: under ``jax.jit`` a one-line ``TypeError`` points to the traceable toolkit.
    """
    _refuse_traced("check_inputs", grad, param)
    xp = step_namespace(grad, param, xp, name)
    split_batch(tuple(param.shape), cfg.batch_dims, name=name)  # first: its message names the parameter
    check_state(state, grad, param, cfg, name=name)
    _check_gradient_dtype(grad, param, xp, name)
    bad = count_nonfinite(grad, xp)
    if bad:
        raise ValueError(
            f"non-finite gradient: {bad} NaN or Inf entr{'y' if bad == 1 else 'ies'} in the gradient of "
            f"{_where(name, state, tuple(param.shape), count)}; the optimizer state was left unchanged"
        )


def step(
    state: State,
    grad: Array,
    cfg: BaseConfig,
    param: Array,
    *,
    lr: Any = None,
    weight_decay: Any = None,
    betas: Any = None,
    check: bool = True,
    name: str | None = None,
    count: int | None = None,
    xp: Namespace | None = None,
) -> tuple[Array, State]:
    """Eager driver: validate, refresh the basis when due, update: ``W_{t+1} = W_t + delta``.

    ``lr``, ``weight_decay`` and ``betas``: this step's ``eta``, ``lambda`` and ``(beta_1, beta_2)`` instead of
    the config's, as in :func:`update` (validated first: an invalid one raises ``ValueError`` with the state
    untouched).  Under ``jax.jit`` ``step`` raises a one-line ``TypeError`` pointing to :func:`update` and
    :func:`~adadiag_ref.optim.traced.refresh_when_due` (it decides the refresh with a Python ``if``).

    Returns ``(new_param, new_state)``.  ``check=True``: invalid input (shapes,
    dtypes, a NaN or Inf in ``G``) raises ``ValueError`` before anything is
    computed, naming the cause, the parameter (``name``) and the step.
    ``check=False``: a non-finite ``G`` keeps the previous basis (with a
    :class:`NonFiniteGradientWarning`) and the values propagate into the moments
    and the parameter as in Adam.  A failed decomposition keeps the previous
    basis with a warning (:func:`refresh_basis`).  The inputs are never modified.

    ``count`` (a host int, the steps taken: ``state.count``'s value, which the caller promises and which is not
    read back to check it): the refresh schedule and the step's coefficients come from it instead of from the
    state's counter, so a step on a device backend (CuPy, CUDA torch) waits for the device only where it must:
    never on a step without refresh with ``check=False``, once (the finiteness verdict) with ``check=True``.
    Without ``count`` the state's counter is read (one synchronisation on a device backend).  The result is the
    same; on NumPy, bit for bit.
    """
    _refuse_traced("step", grad, param, state.count)
    xp = step_namespace(grad, param, xp, name)
    count = host_count(count)
    cfg = step_hyperparameters(cfg, state, xp, lr=lr, weight_decay=weight_decay, betas=betas)
    if check:
        check_inputs(state, grad, cfg, param, name=name, count=count, xp=xp)
    refreshed = False
    if refresh_due(int(state.count) if count is None else count, cfg):
        new = refresh_basis(state, grad, cfg, name=name, count=count, xp=xp)
        # a failed refresh keeps the previous basis, not computed from this G: no refresh-step structure
        state, refreshed = new, new.P is not state.P
    step_in = prepare_step(state, grad, cfg, param, refreshed, xp, count, name=name)
    delta, state = update_prepared(state, step_in, cfg, param, lr, xp)
    return param + delta, state
