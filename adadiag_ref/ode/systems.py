r"""Continuous-time forms of the eight optimizers, their Hamiltonians and dH/dt.

Symbols follow the paper.  ``W`` is the ``m x n`` parameter, ``G = grad L(W)``,
``P`` (``m x m``) and ``Q`` (``n x n``) are orthogonal bases and
``G~ = P^T G Q`` is the rotated gradient (a missing basis is the identity).
Products, quotients, squares and square roots of matrices are entry-wise;
``<A, B> = sum_ij A_ij B_ij``; ``1_k`` is the all-ones vector.

Every system uses general rate constants: ``a`` for first moments and ``b`` for
second moments, so that ``M' = a (G~ - M)`` and ``V' = b (G~^2 - V)``.  A
discrete optimizer with learning rate ``eta = h`` and ``beta_1 = 1 - a h``,
``beta_2 = 1 - b h`` (no bias correction) is the semi-implicit Euler
discretisation of its system (see :class:`adadiag_ref.ode.solvers.SemiImplicitEuler`).
The paper's ODEs are the case ``a = b = 1`` (for Adafactor and Hfac: ``alpha = 1``).

==================  =========  =====  ===============================================
system              family     sides  state
==================  =========  =====  ===============================================
``momentum_sgd``    momentum   0      ``W, M``
``adam``            adam       0      ``W, M, V``
``adadiag``         adam       1      ``W, M, V``
``adadiag_pp``      adam       2      ``W, M, V``
``adafactor``       adafactor  0      ``W, M, r, s`` (no ``M`` when ``momentum_form="none"``)
``adafacdiag``      adafactor  1      ``W, M, r, s``
``adafacdiag_pp``   adafactor  2      ``W, M, r, s``
``hfac``            hfac       0      ``W, u, v, r, s``
``hfacdiag``        hfac       1      ``W, u, v, r, s``
==================  =========  =====  ===============================================

The Hamiltonians do not depend on ``P`` or ``Q``, so ``H`` is continuous across a
basis refresh (moments are carried over unrotated).  Each ``dH/dt`` below is
derived in ``docs/ode.md`` and checked against ``grad H . f`` by the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

from ._arrays import Array, Namespace, inner, namespace_of

__all__ = [
    "ALIASES",
    "SYSTEMS",
    "AdafactorODEState",
    "AdamODEState",
    "Basis",
    "HfacODEState",
    "MomentumODEState",
    "ODEState",
    "System",
    "clip_factor",
    "compute_basis",
    "field_shapes",
    "hamiltonian",
    "hamiltonian_rate",
    "identity_basis",
    "initial_state",
    "make_system",
    "rotate",
    "state_fields",
    "state_type",
    "unrotate",
    "update_order",
    "vector_field",
]


# ----------------------------------------------------------------------------- registry

SYSTEMS: dict[str, tuple[str, int]] = {
    "momentum_sgd": ("momentum", 0),
    "adam": ("adam", 0),
    "adadiag": ("adam", 1),
    "adadiag_pp": ("adam", 2),
    "adafactor": ("adafactor", 0),
    "adafacdiag": ("adafactor", 1),
    "adafacdiag_pp": ("adafactor", 2),
    "hfac": ("hfac", 0),
    "hfacdiag": ("hfac", 1),
}
"""System name -> (family, number of rotated sides)."""

ALIASES: dict[str, str] = {"sgd": "momentum_sgd", "momentum": "momentum_sgd", "sgdm": "momentum_sgd", "adamw": "adam"}
"""Accepted alternative names (the core's ``adamw`` is the ODE ``adam``: weight decay is a field here)."""

_DEFAULT_EPS = {"momentum": 0.0, "adam": 1e-8, "adafactor": 1e-30, "hfac": 1e-30}
_MOMENTUM_FORMS = ("gradient", "update", "none")
_NORMALIZATIONS = ("paper", "algorithm")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class System:
    r"""One optimizer's ODE with its rate constants (frozen, hashable).

    Attributes:
        name: registry name (see :data:`SYSTEMS`).
        family: ``"momentum"``, ``"adam"``, ``"adafactor"`` or ``"hfac"``.
        sides: 0 (no basis), 1 (``G~ = P^T G``) or 2 (``G~ = P^T G Q``).
        a: first-moment rate, ``M' = a (G~ - M)`` [``1 - beta_1 = a eta``].
        b: second-moment rate, ``V' = b (G~^2 - V)`` [``1 - beta_2 = b eta``].
        eps: smoothing term [epsilon].  Adam family: ``sqrt(V) + eps``.  Adafactor
            and Hfac: added to ``G~^2`` in ``r`` and ``s`` (the paper's 1e-30).
        weight_decay: decoupled weight decay [lambda]: ``W' = ... - lambda W``.
        clip_threshold: ``d`` of ``clip(U) = U / max(1, RMS(U) / d)`` (Adafactor
            ``update``/``none`` forms and Hfac); ``None`` = no clipping (the paper's ODEs).
        momentum_form: Adafactor family only.  ``"gradient"``: the paper's ODE
            (``M`` is an EMA of ``G~``, ``W' = -P M / sqrt(V^)``).  ``"update"``: the
            limit of Algorithm AdafacDiag (``M`` is an EMA of ``clip(G~ / sqrt(V^))``,
            ``W' = -P M``).  ``"none"``: Adafactor without momentum.
        normalization: Hfac family only.  ``"paper"``: the appendix ODE, with
            ``sqrt(r 1_n^T)`` and ``sqrt(1_m s^T)``.  ``"algorithm"``: Algorithm
            HfacDiag's ``sqrt(r 1_n^T / n)`` and ``sqrt(1_m s^T / m)``.
        momentum_scale: Hfac family only: the factor ``c`` in front of ``phi`` and
            ``psi`` (Algorithm HfacDiag has ``beta_1``, which tends to 1 as ``eta -> 0``).
    """

    name: str
    family: str
    sides: int
    a: float = 1.0
    b: float = 1.0
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_threshold: float | None = None
    momentum_form: str = "gradient"
    normalization: str = "paper"
    momentum_scale: float = 1.0

    def __post_init__(self) -> None:
        _check(self.family in _DEFAULT_EPS, f"unknown family {self.family!r}")
        _check(self.sides in (0, 1, 2), f"sides must be 0, 1 or 2, got {self.sides!r}")
        _check(self.family != "momentum" or self.sides == 0, "momentum SGD has no rotated form")
        _check(self.family != "hfac" or self.sides <= 1, "Hfac is defined one-sided only (hfac, hfacdiag)")
        for label in ("a", "b"):
            value = getattr(self, label)
            _check(math.isfinite(value) and value > 0, f"rate {label} must be a finite number > 0, got {value!r}")
        _check(math.isfinite(self.eps) and self.eps >= 0, f"eps must be >= 0, got {self.eps!r}")
        _check(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"weight_decay must be >= 0, got {self.weight_decay!r}",
        )
        _check(
            self.clip_threshold is None or (math.isfinite(self.clip_threshold) and self.clip_threshold > 0),
            f"clip_threshold must be > 0 or None, got {self.clip_threshold!r}",
        )
        _check(self.momentum_form in _MOMENTUM_FORMS, f"momentum_form must be one of {_MOMENTUM_FORMS}")
        _check(self.normalization in _NORMALIZATIONS, f"normalization must be one of {_NORMALIZATIONS}")
        _check(math.isfinite(self.momentum_scale) and self.momentum_scale >= 0, "momentum_scale must be >= 0")
        if self.family != "adafactor":
            _check(self.momentum_form == "gradient", f"momentum_form is an Adafactor option, not of {self.name!r}")
        if self.family != "hfac":
            _check(self.normalization == "paper", f"normalization is an Hfac option, not of {self.name!r}")
            _check(self.momentum_scale == 1.0, f"momentum_scale is an Hfac option, not of {self.name!r}")
        if self.family in ("momentum", "adam") or (self.family == "adafactor" and self.momentum_form == "gradient"):
            _check(
                self.clip_threshold is None,
                f"clip_threshold has no place in the {self.name!r} ODE "
                "(the paper's forms have no clipping; use momentum_form='update' for Adafactor)",
            )

    def replace(self, **changes: Any) -> System:
        """A validated copy with ``changes`` applied."""
        return replace(self, **changes)

    def describe(self) -> str:
        """One line naming the system and its non-default constants."""
        parts = [f"a={self.a:g}", f"b={self.b:g}"] if self.family != "momentum" else [f"a={self.a:g}"]
        if self.family != "momentum":
            parts.append(f"eps={self.eps:g}")
        for f in fields(self):
            if f.name in ("name", "family", "sides", "a", "b", "eps"):
                continue
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={value}")
        return f"{self.name}({', '.join(parts)})"


def make_system(name: str, **options: Any) -> System:
    """The :class:`System` called ``name`` (aliases allowed) with ``options`` set.

    ``eps`` defaults to the paper's value of the family (1e-8 for the Adam family,
    1e-30 for the factored ones).
    """
    key = ALIASES.get(name, name)
    if key not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; choose one of {', '.join([*SYSTEMS, *ALIASES])}")
    family, sides = SYSTEMS[key]
    options.setdefault("eps", _DEFAULT_EPS[family])
    allowed = {f.name for f in fields(System)} - {"name", "family", "sides"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    return System(name=key, family=family, sides=sides, **options)


# ----------------------------------------------------------------------------- states


class MomentumODEState(NamedTuple):
    """Momentum SGD: parameter ``W`` and momentum ``M`` (both ``m x n``)."""

    W: Array
    M: Array


class AdamODEState(NamedTuple):
    """Adam, AdaDiag, AdaDiag++: ``W`` and the rotated moments ``M``, ``V`` (``m x n``)."""

    W: Array
    M: Array
    V: Array


class AdafactorODEState(NamedTuple):
    """Adafactor family: ``W``, first moment ``M`` (``None`` without momentum), ``r`` (m,), ``s`` (n,)."""

    W: Array
    M: Array | None
    r: Array
    s: Array


class HfacODEState(NamedTuple):
    """Hfac family: ``W``, factored first moment ``u`` (m,), ``v`` (n,), second ``r`` (m,), ``s`` (n,)."""

    W: Array
    u: Array
    v: Array
    r: Array
    s: Array


ODEState = MomentumODEState | AdamODEState | AdafactorODEState | HfacODEState

_STATE_TYPES: dict[str, type] = {
    "momentum": MomentumODEState,
    "adam": AdamODEState,
    "adafactor": AdafactorODEState,
    "hfac": HfacODEState,
}


def state_type(system: System) -> type:
    """The NamedTuple class holding ``system``'s state."""
    return _STATE_TYPES[system.family]


def state_fields(system: System) -> tuple[str, ...]:
    """The fields that are present (not ``None``) in ``system``'s state, in packing order."""
    names: tuple[str, ...] = state_type(system)._fields  # type: ignore[attr-defined]
    if system.family == "adafactor" and system.momentum_form == "none":
        names = tuple(f for f in names if f != "M")
    return names


def field_shapes(system: System, m: int, n: int) -> dict[str, tuple[int, ...]]:
    """Shape of every present state field for an ``m x n`` parameter."""
    shapes = {"W": (m, n), "M": (m, n), "V": (m, n), "r": (m,), "s": (n,), "u": (m,), "v": (n,)}
    return {name: shapes[name] for name in state_fields(system)}


def update_order(system: System) -> tuple[tuple[str, ...], ...]:
    """Blocks of fields in the order the discrete optimizer updates them.

    Semi-implicit Euler advances the blocks one after another, each with the
    newest values of the blocks before it: second moments, then first moments,
    then ``W``.  This makes one step equal to one discrete optimizer update.
    """
    if system.family == "momentum":
        return (("M",), ("W",))
    if system.family == "adam":
        return (("M", "V"), ("W",))
    if system.family == "hfac":
        return (("u", "v", "r", "s"), ("W",))
    if system.momentum_form == "none":
        return (("r", "s"), ("W",))
    if system.momentum_form == "gradient":
        return (("r", "s", "M"), ("W",))
    return (("r", "s"), ("M",), ("W",))  # the algorithm's M uses the new r, s


# ----------------------------------------------------------------------------- bases


class Basis(NamedTuple):
    """The bases in force: ``P`` (``m x m``) and ``Q`` (``n x n``); ``None`` means identity."""

    P: Array | None
    Q: Array | None


def identity_basis() -> Basis:
    """``P = Q = I`` (both ``None``)."""
    return Basis(None, None)


def rotate(G: Array, basis: Basis, xp: Namespace) -> Array:
    """``G~ = P^T G Q``."""
    if basis.P is not None:
        G = xp.matrix_transpose(basis.P) @ G
    if basis.Q is not None:
        G = G @ basis.Q
    return G


def unrotate(X: Array, basis: Basis, xp: Namespace) -> Array:
    """``P X Q^T`` (the adjoint of :func:`rotate`: ``<G, P X Q^T> = <P^T G Q, X>`` for any P, Q)."""
    if basis.P is not None:
        X = basis.P @ X
    if basis.Q is not None:
        X = X @ xp.matrix_transpose(basis.Q)
    return X


def compute_basis(system: System, G: Array, *, xp: Namespace | None = None) -> Basis:
    """Refresh: ``P, _, Q^T = canonical_svd(G)`` for the sides ``system`` rotates.

    Uses the core's :func:`adadiag_ref.linalg.canonical_svd`, so the ODE and the
    discrete optimizers share one deterministic basis.  ``sides = 0`` gives the
    identity.
    """
    if system.sides == 0:
        return identity_basis()
    xp = namespace_of(G, xp=xp)
    m, n = G.shape
    if m > n:
        raise ValueError(
            f"rotated systems take a wide or square W (m <= n), got {m} x {n}: pass W^T, as the core's work frame does"
        )
    from ..linalg import canonical_svd

    svd = canonical_svd(G, compute_p=True, compute_q=system.sides == 2, xp=xp)
    return Basis(svd.P, svd.Q if system.sides == 2 else None)


# ----------------------------------------------------------------------------- shared pieces


def clip_factor(U: Array, threshold: float | None, xp: Namespace) -> Array:
    """``gamma = 1 / max(1, RMS(U) / d)``, so that ``clip(U) = gamma U``; 1 when ``d`` is None."""
    if threshold is None:
        return xp.ones((), dtype=U.dtype)
    ratio = xp.sqrt(xp.mean(U * U)) / threshold
    return 1.0 / xp.maximum(ratio, xp.ones_like(ratio))


def _factored(
    state: AdafactorODEState | HfacODEState, G_rot: Array, eps: float, xp: Namespace
) -> tuple[Array, Array, Array, Array]:
    """``rho = (G~^2 + eps) 1_n``, ``sigma = (G~^2 + eps)^T 1_m``, ``R = 1_m^T r`` and ``S = sqrt(r s^T / R)``."""
    sq = G_rot * G_rot + eps
    rho = xp.sum(sq, axis=1)
    sigma = xp.sum(sq, axis=0)
    R = xp.sum(state.r)
    S = xp.sqrt(state.r[:, None] * state.s[None, :] / R)
    return rho, sigma, R, S


def _hfac_constants(system: System, m: int, n: int) -> tuple[float, float]:
    """``(kappa_r, kappa_s)``: 1, 1 for the paper's ODE; ``n``, ``m`` for Algorithm HfacDiag."""
    if system.normalization == "algorithm":
        return float(n), float(m)
    return 1.0, 1.0


def _decay(system: System, state: ODEState, G: Array, xp: Namespace) -> Array:
    """The weight-decay part of ``dH/dt``: ``-lambda <G, W>``."""
    if not system.weight_decay:
        return xp.zeros((), dtype=G.dtype)
    return -system.weight_decay * inner(G, state.W, xp)


# ----------------------------------------------------------------------------- vector fields


def vector_field(
    system: System,
    state: ODEState,
    G_rot: Array,
    basis: Basis,
    *,
    fields: tuple[str, ...] | None = None,
    xp: Namespace | None = None,
) -> ODEState:
    r"""``f(y) = dy/dt`` given the rotated gradient ``G~ = P^T grad L(W) Q``.

    Returns a state of the same type whose fields are the time derivatives.  With
    ``fields`` only those are computed and the others are zero (semi-implicit Euler
    advances one block at a time and must not evaluate, e.g., ``W'`` at ``r = 0``).

    * momentum SGD::

        W' = -M - lambda W,        M' = a (G - M)

    * Adam / AdaDiag / AdaDiag++ (``D = sqrt(V) + eps``)::

        W' = -P (M / D) Q^T - lambda W,   M' = a (G~ - M),   V' = b (G~^2 - V)

    * Adafactor / AdafacDiag, with ``rho = (G~^2 + eps) 1_n``,
      ``sigma = (G~^2 + eps)^T 1_m``, ``V^ = r s^T / (1_m^T r)``, ``S = sqrt(V^)``,
      ``U = G~ / S`` and ``gamma = 1 / max(1, RMS(U) / d)``::

        r' = b (rho - r),   s' = b (sigma - s)
        gradient form (paper):   M' = a (G~ - M),        W' = -P (M / S) Q^T - lambda W
        update form (Algorithm): M' = a (gamma U - M),   W' = -P M Q^T - lambda W
        none (no momentum):                              W' = -P (gamma U) Q^T - lambda W

    * Hfac / HfacDiag, with ``g_r = G~ 1_n / n``, ``g_c = G~^T 1_m / m``,
      ``phi = (u - g_r) / sqrt(r / kappa_r)`` (m), ``psi = (v - g_c) / sqrt(s / kappa_s)``
      (n), ``kappa = 1`` (paper) or ``kappa_r = n, kappa_s = m`` (Algorithm)::

        W' = -P (gamma U + (c / 2)(phi 1_n^T + 1_m psi^T)) - lambda W
        u' = a (g_r - u),  v' = a (g_c - v),  r' = b (rho - r),  s' = b (sigma - s)
    """
    xp = namespace_of(G_rot, xp=xp)
    want = set(state._fields if fields is None else fields)
    lam = system.weight_decay

    def out(**derivatives: Callable[[], Array] | None) -> Any:
        values: dict[str, Array | None] = {}
        for name in state._fields:
            x = getattr(state, name)
            make = derivatives.get(name)
            if x is None or make is None:
                values[name] = None
            elif name in want:
                values[name] = make()
            else:
                values[name] = xp.zeros_like(x)
        return type(state)(**values)

    def w_dot(step: Array) -> Array:
        """``W' = -P step Q^T - lambda W``."""
        direction = -unrotate(step, basis, xp)
        return direction - lam * state.W if lam else direction

    a, b = system.a, system.b
    if isinstance(state, MomentumODEState):
        M_sgd = state.M
        return out(W=lambda: -M_sgd - lam * state.W if lam else -M_sgd, M=lambda: a * (G_rot - M_sgd))
    if isinstance(state, AdamODEState):
        M, V = state.M, state.V
        return out(
            W=lambda: w_dot(M / (xp.sqrt(V) + system.eps)),
            M=lambda: a * (G_rot - M),
            V=lambda: b * (G_rot * G_rot - V),
        )
    sq = G_rot * G_rot + system.eps
    r, s = state.r, state.s

    def S() -> Array:
        """``sqrt(V^) = sqrt(r s^T / 1_m^T r)``."""
        return xp.sqrt(r[:, None] * s[None, :] / xp.sum(r))

    def clipped_u() -> Array:
        """``gamma U`` with ``U = G~ / sqrt(V^)``."""
        U = G_rot / S()
        return clip_factor(U, system.clip_threshold, xp) * U

    def r_dot() -> Array:
        return b * (xp.sum(sq, axis=1) - r)

    def s_dot() -> Array:
        return b * (xp.sum(sq, axis=0) - s)

    if isinstance(state, AdafactorODEState):
        M_af = state.M
        if system.momentum_form == "gradient":
            assert M_af is not None
            return out(W=lambda: w_dot(M_af / S()), M=lambda: a * (G_rot - M_af), r=r_dot, s=s_dot)
        if system.momentum_form == "update":
            assert M_af is not None
            return out(W=lambda: w_dot(M_af), M=lambda: a * (clipped_u() - M_af), r=r_dot, s=s_dot)
        return out(W=lambda: w_dot(clipped_u()), r=r_dot, s=s_dot)
    assert isinstance(state, HfacODEState)
    m, n = G_rot.shape
    kr, ks = _hfac_constants(system, m, n)
    g_r, g_c = xp.mean(G_rot, axis=1), xp.mean(G_rot, axis=0)
    u, v = state.u, state.v

    def hfac_step() -> Array:
        """``gamma U + (c/2)(phi 1_n^T + 1_m psi^T)``."""
        phi = (u - g_r) / xp.sqrt(r / kr)
        psi = (v - g_c) / xp.sqrt(s / ks)
        return clipped_u() + (0.5 * system.momentum_scale) * (phi[:, None] + psi[None, :])

    return out(
        W=lambda: w_dot(hfac_step()),
        u=lambda: a * (g_r - u),
        v=lambda: a * (g_c - v),
        r=r_dot,
        s=s_dot,
    )


# ----------------------------------------------------------------------------- Hamiltonians


def hamiltonian(system: System, state: ODEState, loss: Array, *, xp: Namespace | None = None) -> Array:
    r"""``H(y)`` given ``loss = L(W)``; it never depends on the bases.

    * momentum SGD: ``H = L + <M, M> / (2a)``
    * Adam family: ``H = L + <M / (sqrt(V) + eps), M> / (2a)`` (the paper's, with ``1/(2a)``)
    * Adafactor, gradient form: ``H = L + <M / S, M> / (2a)`` (the paper's)
    * Adafactor, update form: ``H = L + <S M, M> / (2a)``;  no momentum: ``H = L``
    * Hfac: ``H = L + K_u sum_i u_i^2 / sqrt(r_i) + K_v sum_j v_j^2 / sqrt(s_j)`` with
      ``K_u = c n sqrt(kappa_r) / (4a)``, ``K_v = c m sqrt(kappa_s) / (4a)``.  For the
      paper's ODE (``c = kappa = a = 1``) this is the appendix's
      ``L + <u 1_n^T / sqrt(r 1_n^T), u 1_n^T> / 4 + <1_m v^T / sqrt(1_m s^T), 1_m v^T> / 4``.
    """
    xp = namespace_of(state.W, xp=xp)
    a = system.a
    if system.family == "momentum":
        assert isinstance(state, MomentumODEState)
        return loss + inner(state.M, state.M, xp) / (2 * a)
    if system.family == "adam":
        assert isinstance(state, AdamODEState)
        return loss + xp.sum(state.M * state.M / (xp.sqrt(state.V) + system.eps)) / (2 * a)
    if system.family == "adafactor":
        assert isinstance(state, AdafactorODEState)
        if system.momentum_form == "none":
            return loss + xp.zeros((), dtype=state.W.dtype)
        assert state.M is not None
        S = xp.sqrt(state.r[:, None] * state.s[None, :] / xp.sum(state.r))
        kinetic = state.M * state.M / S if system.momentum_form == "gradient" else S * state.M * state.M
        return loss + xp.sum(kinetic) / (2 * a)
    assert isinstance(state, HfacODEState)
    m, n = state.W.shape
    kr, ks = _hfac_constants(system, m, n)
    c = system.momentum_scale
    K_u = c * n * math.sqrt(kr) / (4 * a)
    K_v = c * m * math.sqrt(ks) / (4 * a)
    return (
        loss + K_u * xp.sum(state.u * state.u / xp.sqrt(state.r)) + K_v * xp.sum(state.v * state.v / xp.sqrt(state.s))
    )


def _adam_rate(system: System, state: AdamODEState, G_rot: Array, xp: Namespace) -> Array:
    """Adam family ``dH/dt`` without weight decay (see :func:`hamiltonian_rate`)."""
    q = system.b / (4 * system.a)
    M2 = state.M * state.M
    sqrtV = xp.sqrt(state.V)
    D = sqrtV + system.eps
    num = M2 * G_rot * G_rot
    zero = xp.zeros_like(num)
    # The term M^2 G~^2 / (sqrt(V) D^2) is -dH/dV * V'-part; at V = 0 it is +inf where M G~ != 0.
    positive_v = state.V > 0
    safe_sqrtV = xp.where(positive_v, sqrtV, xp.ones_like(sqrtV))
    gradient_term = xp.where(positive_v, num / (safe_sqrtV * D * D), xp.where(num > 0, zero + xp.inf, zero))
    return -xp.sum(M2 / D) + q * xp.sum(M2 * sqrtV / (D * D)) - q * xp.sum(gradient_term)


def _adafactor_rate(system: System, state: AdafactorODEState, G_rot: Array, xp: Namespace) -> Array:
    """Adafactor family ``dH/dt`` without weight decay (see :func:`hamiltonian_rate`)."""
    q = system.b / (4 * system.a)
    rho, sigma, R, S = _factored(state, G_rot, system.eps, xp)
    U = G_rot / S
    gamma = clip_factor(U, system.clip_threshold, xp)
    if system.momentum_form == "none":
        return -gamma * xp.sum(G_rot * G_rot / S)
    assert state.M is not None
    M2 = state.M * state.M
    if system.momentum_form == "gradient":
        Psi = M2 / S
        total = xp.sum(Psi)
        ratio = xp.sum(rho) / R
        spread = xp.sum(xp.sum(Psi, axis=1) * rho / state.r) + xp.sum(xp.sum(Psi, axis=0) * sigma / state.s)
        return -total * (1.0 - q * (1.0 + ratio)) - q * spread
    growth = rho[:, None] / state.r[:, None] + sigma[None, :] / state.s[None, :] - xp.sum(rho) / R - 1.0
    return -(1.0 - gamma) * inner(G_rot, state.M, xp) - xp.sum(S * M2) + q * xp.sum(S * M2 * growth)


def _hfac_rate(system: System, state: HfacODEState, G_rot: Array, xp: Namespace) -> Array:
    """Hfac family ``dH/dt`` without weight decay (see :func:`hamiltonian_rate`)."""
    m, n = G_rot.shape
    kr, ks = _hfac_constants(system, m, n)
    q = system.b / (4 * system.a)
    c = system.momentum_scale
    rho, sigma, _, S = _factored(state, G_rot, system.eps, xp)
    U = G_rot / S
    gamma = clip_factor(U, system.clip_threshold, xp)
    g_r, g_c = xp.mean(G_rot, axis=1), xp.mean(G_rot, axis=0)
    cu = 0.5 * c * n * math.sqrt(kr)
    cv = 0.5 * c * m * math.sqrt(ks)
    sr, ss = xp.sqrt(state.r), xp.sqrt(state.s)
    u2, v2 = state.u * state.u, state.v * state.v
    row = cu * xp.sum((g_r * g_r - (1.0 - q) * u2) / sr) - cu * q * xp.sum(u2 * rho / (state.r * sr))
    col = cv * xp.sum((g_c * g_c - (1.0 - q) * v2) / ss) - cv * q * xp.sum(v2 * sigma / (state.s * ss))
    return -gamma * xp.sum(G_rot * G_rot / S) + row + col


def hamiltonian_rate(system: System, state: ODEState, G: Array, G_rot: Array, *, xp: Namespace | None = None) -> Array:
    r"""Closed-form ``dH/dt = <grad H(y), f(y)>`` (derivations in ``docs/ode.md``).

    ``G`` is ``grad L(W)`` and ``G_rot = P^T G Q``; ``q = b / (4a)``.  Every system
    adds ``-lambda <G, W>`` for weight decay.

    * momentum SGD: ``-<M, M>``
    * Adam family (``D = sqrt(V) + eps``)::

        -sum M^2 / D  +  q sum M^2 sqrt(V) / D^2  -  q sum M^2 G~^2 / (sqrt(V) D^2)

      The middle term (from the ``-V`` in ``V'``) is positive; it is dominated by the
      first iff ``q sqrt(V)/D <= 1``, which holds for every state iff ``b <= 4a``.
    * Adafactor, gradient form, with ``Psi = M^2 / S``, row sums ``Psi_r``, column sums
      ``Psi_c`` and ``R = 1^T r``::

        -sum Psi (1 - q (1 + 1^T rho / R))  -  q (<Psi_r, rho / r> + <Psi_c, sigma / s>)

    * Adafactor, update form:
      ``-(1 - gamma) <G~, M> - sum S M^2 + q sum S M^2 (rho_i/r_i + sigma_j/s_j - 1^T rho / R - 1)``;
      no momentum: ``-gamma sum G~^2 / S``.
    * Hfac, with ``C_u = c n sqrt(kappa_r) / 2``, ``C_v = c m sqrt(kappa_s) / 2``::

        -gamma sum G~^2 / S
        + C_u sum_i (g_r,i^2 - (1 - q) u_i^2) / sqrt(r_i) - C_u q sum_i u_i^2 rho_i / r_i^(3/2)
        + C_v sum_j (g_c,j^2 - (1 - q) v_j^2) / sqrt(s_j) - C_v q sum_j v_j^2 sigma_j / s_j^(3/2)

      The ``+g^2`` terms are where the paper's claim can fail.
    """
    xp = namespace_of(G, xp=xp)
    if system.family == "momentum":
        assert isinstance(state, MomentumODEState)
        rate = -inner(state.M, state.M, xp)
    elif system.family == "adam":
        assert isinstance(state, AdamODEState)
        rate = _adam_rate(system, state, G_rot, xp)
    elif system.family == "adafactor":
        assert isinstance(state, AdafactorODEState)
        rate = _adafactor_rate(system, state, G_rot, xp)
    else:
        assert isinstance(state, HfacODEState)
        rate = _hfac_rate(system, state, G_rot, xp)
    return rate + _decay(system, state, G, xp)


# ----------------------------------------------------------------------------- initial conditions


def initial_state(
    system: System,
    W0: Array,
    G0_rot: Array,
    *,
    moments: str = "gradient",
    floor: float = 1e-4,
    xp: Namespace | None = None,
) -> ODEState:
    r"""Initial state ``y(t0)`` for parameter ``W0`` with rotated gradient ``G~0``.

    ``moments="gradient"`` (default) starts where the bias-corrected discrete
    optimizer is after its first step: ``M0 = G~0``, ``V0 = G~0^2 + f``,
    ``r0 = rho0 + n f``, ``s0 = sigma0 + m f``, ``u0 = g_r``, ``v0 = g_c``, with the
    floor ``f = floor * mean(G~0^2)`` (absolute ``floor`` when ``G~0 = 0``) keeping
    every second moment strictly positive, which the Hamiltonian needs (it is not
    differentiable at ``V = 0``).  ``1_m^T r0 = 1_n^T s0``, so the start lies on the
    invariant manifold of the factored families.

    ``moments="zero"`` is the discrete optimizer's literal start (all moments 0).
    It is well posed for the Adam family only with ``eps > 0`` and is stiff for
    small ``eps``; the factored families are undefined there (``V^ = 0/0``).
    """
    xp = namespace_of(W0, G0_rot, xp=xp)
    m, n = W0.shape
    if moments not in ("gradient", "zero"):
        raise ValueError(f"moments must be 'gradient' or 'zero', got {moments!r}")
    zero = moments == "zero"
    sq = G0_rot * G0_rot
    mean_sq = xp.mean(sq)
    f = floor * xp.where(mean_sq > 0, mean_sq, xp.ones_like(mean_sq))
    if system.family == "momentum":
        return MomentumODEState(W=W0, M=xp.zeros_like(G0_rot) if zero else G0_rot)
    if system.family == "adam":
        if zero:
            return AdamODEState(W=W0, M=xp.zeros_like(G0_rot), V=xp.zeros_like(G0_rot))
        return AdamODEState(W=W0, M=G0_rot, V=sq + f)
    sqe = sq + system.eps
    r0 = xp.zeros((m,), dtype=W0.dtype) if zero else xp.sum(sqe, axis=1) + n * f
    s0 = xp.zeros((n,), dtype=W0.dtype) if zero else xp.sum(sqe, axis=0) + m * f
    if system.family == "adafactor":
        if system.momentum_form == "none":
            M0 = None
        elif zero:
            M0 = xp.zeros_like(G0_rot)
        elif system.momentum_form == "gradient":
            M0 = G0_rot
        else:
            S0 = xp.sqrt(r0[:, None] * s0[None, :] / xp.sum(r0))
            U0 = G0_rot / S0
            M0 = clip_factor(U0, system.clip_threshold, xp) * U0
        return AdafactorODEState(W=W0, M=M0, r=r0, s=s0)
    if zero:
        return HfacODEState(W=W0, u=xp.zeros((m,), dtype=W0.dtype), v=xp.zeros((n,), dtype=W0.dtype), r=r0, s=s0)
    return HfacODEState(W=W0, u=xp.mean(G0_rot, axis=1), v=xp.mean(G0_rot, axis=0), r=r0, s=s0)
