r"""What the family modules share: the registry entry types and the small pieces both forms use.

A family is defined twice over, side by side in one module:

* discretely (:class:`~.registry.FamilySpec`): the moment shapes and ``direction``, which maps the
  rotated gradient ``G~`` and the step ``t`` to the rotated direction ``U~`` and the
  new moments; :mod:`adadiag_ref.optim.core` adds the rotation, decay and ``eta_t``;
* in continuous time (:class:`Flow`), the limit ``eta -> 0`` with ``1 - beta_1 = a eta``
  and ``1 - beta_2 = b eta``: the moments' derivatives and the same rotated direction
  ``U~`` in ``W' = -P U~ Q^T - lambda W`` (:func:`~adadiag_ref.optim.rotation.parameter_velocity`),
  the Hamiltonian ``H`` and its closed-form ``dH/dt``; :mod:`adadiag_ref.ode` builds its
  systems from these.

Symbols follow the paper: products, quotients, squares and square roots of
matrices are entry-wise, ``<A, B> = sum_ij A_ij B_ij``, ``1_k`` the all-ones vector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from ..._xp import Array, Namespace, sqrt
from ...config import OPTIMIZERS, BaseConfig, default_eps

__all__ = [
    "Constants",
    "Flow",
    "FlowField",
    "Moments",
    "clip_factor",
    "clipped_normalised",
    "constant_step_size",
    "ema",
    "factored",
    "factored_scale",
    "factored_second_moment",
    "factored_sums",
    "flow_of",
    "normalise",
    "paper_defaults",
]

Moments = dict[str, Array | None]


class Constants(Protocol):
    """The constants of a continuous-time form (:class:`adadiag_ref.ode.System` is one)."""

    @property
    def a(self) -> float: ...  # first-moment rate, 1 - beta_1 = a eta
    @property
    def b(self) -> float: ...  # second-moment rate, 1 - beta_2 = b eta
    @property
    def eps(self) -> float: ...
    @property
    def clip_threshold(self) -> float | None: ...
    @property
    def momentum_form(self) -> str: ...
    @property
    def normalization(self) -> str: ...
    @property
    def momentum_scale(self) -> float: ...


class FlowField(NamedTuple):
    """The vector field of one state, evaluated on demand.

    ``direction()`` is the rotated ``U~`` of ``W' = -P U~ Q^T - lambda W``;
    ``moments[name]()`` the derivative of that moment.  Callables, because semi-implicit
    Euler advances one block at a time and must not evaluate, e.g., ``W'`` at ``r = 0``.
    """

    direction: Callable[[], Array]
    moments: dict[str, Callable[[], Array]]


class Flow(NamedTuple):
    """The continuous-time form of a family (the registry entry :mod:`adadiag_ref.ode` uses).

    Attributes:
        state_type: NamedTuple of ``W`` and the moments (``m x n`` work frame, ``m <= n``).
        default_eps: the paper's smoothing term of the family.
        max_sides: how many sides the family may rotate (0, 1 or 2).
        fields: ``fields(c)``, the state fields present under constants ``c``, in packing order.
        update_order: ``update_order(c)``, blocks of fields in the order the discrete update
            computes them (second moments, first moments, ``W``): semi-implicit Euler over these
            blocks is the discrete optimizer.
        vector_field: ``vector_field(c, state, G~, xp) -> FlowField``.
        hamiltonian: ``hamiltonian(c, state, L(W), xp) -> H``.
        hamiltonian_rate: ``hamiltonian_rate(c, state, G~, xp) -> dH/dt`` without weight decay.
        initial_moments: ``initial_moments(c, G~0, zero, f, xp)``: the moments at ``t0``, from the
            rotated gradient (``zero=False``, floor ``f`` on second moments) or zero.
    """

    state_type: type
    default_eps: float
    max_sides: int
    fields: Callable[[Any], tuple[str, ...]]
    update_order: Callable[[Any], tuple[tuple[str, ...], ...]]
    vector_field: Callable[[Any, Any, Array, Namespace], FlowField]
    hamiltonian: Callable[[Any, Any, Array, Namespace], Array]
    hamiltonian_rate: Callable[[Any, Any, Array, Namespace], Array]
    initial_moments: Callable[[Any, Array, bool, Array, Namespace], Moments]


def flow_of(module: Any, state_type: type, default_eps: float, max_sides: int) -> Flow:
    """A family module's continuous-time functions (``fields``, ``update_order``, ``vector_field``,
    ``hamiltonian``, ``hamiltonian_rate``, ``initial_moments``: the same names in every module) as a
    :class:`Flow`."""
    functions = (getattr(module, name) for name in Flow._fields[3:])  # Flow's function fields bear their names
    return Flow(state_type, default_eps, max_sides, *functions)


def paper_defaults(config_type: type[BaseConfig]) -> tuple[float, int]:
    """``(default eps, most rotated sides)`` of a family, as its discrete configs define them."""
    names = [name for name, entry in OPTIMIZERS.items() if entry.config_type is config_type]
    return default_eps(names[0]), max(OPTIMIZERS[name].sides for name in names)


# ----------------------------------------------------------------------------- discrete pieces


def constant_step_size(cfg: BaseConfig, t: Array, w: Array, lr: Any, xp: Namespace) -> Any:
    """``eta_t = eta``."""
    return lr


def ema(beta_t: Array, old: Array, new: Array) -> Array:
    """``beta_t * old + (1 - beta_t) * new``."""
    return beta_t * old + (1.0 - beta_t) * new


def factored_sums(g: Array, eps: float, xp: Namespace) -> tuple[Array, Array]:
    """``rho = (G~^2 + eps) 1_n`` (m,) and ``sigma = (G~^2 + eps)^T 1_m`` (n,): the inputs of ``r`` and ``s``
    (``(*B, m)`` and ``(*B, n)`` for a stack ``(*B, m, n)``)."""
    sq = g * g + eps
    return xp.sum(sq, axis=-1), xp.sum(sq, axis=-2)  # per matrix of a stack (*B, m, n)


def factored_second_moment(
    r: Array, s: Array, g: Array, eps: float, beta2_t: Array, xp: Namespace
) -> tuple[Array, Array]:
    """Adafactor's factored second moment of the rotated gradient.

    ``r_t = EMA[(G~^2 + eps) 1_n]`` and ``s_t = EMA[(G~^2 + eps)^T 1_m]``; the
    implied ``V_t = r_t s_t^T / (1_m^T r_t)`` is never formed (see :func:`normalise`).
    """
    rho, sigma = factored_sums(g, eps, xp)
    return ema(beta2_t, r, rho), ema(beta2_t, s, sigma)


def normalise(g: Array, r: Array, s: Array, xp: Namespace) -> Array:
    """``G~ / sqrt(V_t)`` with ``V_t = r s^T / (1_m^T r)``, as ``G~ sqrt(1^T r) / (sqrt(r) sqrt(s)^T)``.

    The factored form avoids the product ``r_i s_j``, which underflows in float32
    when both are of the order of eps = 1e-30 (a zero row and a zero column).
    """
    # vectors broadcast against G~ (no m x n temporary of its own) keep G~'s memory order; a stack's r (*B, m)
    # and s (*B, n) give each matrix its own 1^T r
    total = xp.sum(r) if r.ndim == 1 else xp.sum(r, axis=-1, keepdims=True)
    return g * (sqrt(total, xp) / sqrt(s, xp))[..., None, :] / sqrt(r, xp)[..., :, None]


# ----------------------------------------------------------------------------- continuous pieces


def clip_factor(U: Array, threshold: float | None, xp: Namespace) -> Array:
    """``gamma = 1 / max(1, RMS(U) / d)``, so that ``clip(U) = gamma U``; 1 when ``d`` is None."""
    if threshold is None:
        return xp.ones((), dtype=U.dtype)
    ratio = sqrt(xp.mean(U * U), xp) / threshold
    return 1.0 / xp.maximum(ratio, xp.ones_like(ratio))


def factored_scale(r: Array, s: Array, xp: Namespace) -> Array:
    """``S = sqrt(V^)`` with ``V^ = r s^T / (1_m^T r)`` (``m x n``)."""
    return sqrt(r[:, None] * s[None, :] / xp.sum(r), xp)


def clipped_normalised(G_rot: Array, r: Array, s: Array, threshold: float | None, xp: Namespace) -> Array:
    """``gamma U`` with ``U = G~ / S`` and ``gamma = 1 / max(1, RMS(U) / d)`` (:func:`clip_factor`)."""
    U = G_rot / factored_scale(r, s, xp)
    return clip_factor(U, threshold, xp) * U


def factored(state: Any, G_rot: Array, eps: float, xp: Namespace) -> tuple[Array, Array, Array, Array]:
    """``rho``, ``sigma`` (:func:`factored_sums`), ``R = 1_m^T r`` and ``S`` (:func:`factored_scale`)."""
    rho, sigma = factored_sums(G_rot, eps, xp)
    return rho, sigma, xp.sum(state.r), factored_scale(state.r, state.s, xp)


def initial_factored(G0_rot: Array, eps: float, zero: bool, f: Array, xp: Namespace) -> tuple[Array, Array]:
    """``r0 = rho0 + n f`` and ``s0 = sigma0 + m f`` (zeros when ``zero``): ``1_m^T r0 = 1_n^T s0``."""
    m, n = G0_rot.shape
    if zero:
        return xp.zeros((m,), dtype=G0_rot.dtype), xp.zeros((n,), dtype=G0_rot.dtype)
    rho0, sigma0 = factored_sums(G0_rot, eps, xp)
    return rho0 + n * f, sigma0 + m * f
