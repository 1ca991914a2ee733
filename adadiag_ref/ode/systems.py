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
basis refresh (moments are carried over unrotated).  Each ``dH/dt`` is
derived in ``docs/ode.md`` and checked against ``grad H . f`` by the tests.

The equations live with the discrete updates, one module per family in
:mod:`adadiag_ref.optim.families` (their :class:`~adadiag_ref.optim.families.Flow`);
the rotation is the shared :mod:`adadiag_ref.optim.rotation`.  This module adds the
system's constants (:class:`System`) and assembles the pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from .._xp import Array, Namespace, namespace
from ..config import OPTIMIZERS, _check
from ..linalg import canonical_svd
from ..optim.families import (
    FAMILIES,
    MOMENTUM_FLOW,
    AdafactorODEState,
    AdamODEState,
    Flow,
    HfacODEState,
    MomentumODEState,
    ODEState,
    flows,
)
from ..optim.rotation import Basis, parameter_velocity, rotate, unrotate

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
    "compute_basis",
    "field_shapes",
    "hamiltonian",
    "hamiltonian_rate",
    "identity_basis",
    "initial_state",
    "make_system",
    "no_system_reason",
    "rotate",
    "state_fields",
    "state_type",
    "systems",
    "unrotate",
    "update_order",
    "vector_field",
]


# ----------------------------------------------------------------------------- registry


def _flows() -> dict[str, Flow]:
    """Continuous-time forms by family, read from the registry at each call (a family registered later counts)."""
    return {"momentum": MOMENTUM_FLOW, **flows()}


def systems() -> dict[str, tuple[str, int]]:
    """System name -> (family, number of rotated sides): momentum SGD and every registered optimizer whose
    family has a continuous-time form (the core's ``adamw`` is the ODE ``adam``), read from the registry."""
    flows = _flows()
    return {
        "momentum_sgd": ("momentum", 0),
        **{
            "adam" if name == "adamw" else name: (entry.config_type.family, entry.sides)
            for name, entry in OPTIMIZERS.items()
            if entry.config_type.family in flows
        },
    }


SYSTEMS: dict[str, tuple[str, int]] = systems()
"""The systems of the library's own optimizers, as :func:`systems` gives them at import (registered families:
call :func:`systems`)."""

ALIASES: dict[str, str] = {"sgd": "momentum_sgd", "momentum": "momentum_sgd", "sgdm": "momentum_sgd", "adamw": "adam"}
"""Accepted alternative names (the core's ``adamw`` is the ODE ``adam``: weight decay is a field here)."""

_MOMENTUM_FORMS = ("gradient", "update", "none")
_NORMALIZATIONS = ("paper", "algorithm")


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
        flows = _flows()
        _check(self.family in flows, f"unknown family {self.family!r}")
        _check(self.sides in (0, 1, 2), f"sides must be 0, 1 or 2, got {self.sides!r}")
        most = flows[self.family].max_sides
        _check(
            self.sides <= most,
            f"the {self.family} family is defined {('unrotated', 'one-sided', 'two-sided')[most]} only, "
            f"not with {self.sides} rotated sides",
        )
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
        parts = [f"a={self.a:g}"]
        if self.family != "momentum":
            parts += [f"b={self.b:g}", f"eps={self.eps:g}"]
        for f in fields(self):
            if f.name in ("name", "family", "sides", "a", "b", "eps"):
                continue
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={value}")
        return f"{self.name}({', '.join(parts)})"


def no_system_reason(name: str) -> str | None:
    """Why the registered optimizer ``name`` has no ODE system: its family was registered without a continuous-time
    form (``FamilySpec.flow`` is ``None``).  ``None`` when it has a system, or is not a registered optimizer."""
    entry = OPTIMIZERS.get(name)
    if entry is None or ALIASES.get(name, name) in systems():
        return None
    return (
        f"optimizer {name!r} has no continuous-time form: its family {entry.config_type.family!r} was registered "
        "without a Flow (FamilySpec.flow is None); docs/extending.md, section 2, shows how to add one"
    )


def make_system(name: str, **options: Any) -> System:
    """The :class:`System` called ``name`` (aliases allowed) with ``options`` set.

    ``eps`` defaults to the paper's value of the family (1e-8 for the Adam family,
    1e-30 for the factored ones).  ``ValueError`` for an unknown name, and for a registered optimizer whose
    family has no continuous-time form (:func:`no_system_reason` says which).
    """
    key = ALIASES.get(name, name)
    known = systems()
    if key not in known:
        reason = no_system_reason(name)
        raise ValueError(reason or f"unknown system {name!r}; choose one of {', '.join([*known, *ALIASES])}")
    family, sides = known[key]
    options.setdefault("eps", _flows()[family].default_eps)
    allowed = {f.name for f in fields(System)} - {"name", "family", "sides"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    return System(name=key, family=family, sides=sides, **options)


# ----------------------------------------------------------------------------- structure


def _flow(system: System) -> Flow:
    """The family's :class:`Flow`, looked up in the registry at each call (on the path of every evaluation of
    the field: no table is built here, unlike :func:`_flows`)."""
    if system.family == "momentum":
        return MOMENTUM_FLOW
    spec = FAMILIES.get(system.family)
    if spec is None or spec.flow is None:
        raise KeyError(system.family)
    return spec.flow


def state_type(system: System) -> type:
    """The NamedTuple class holding ``system``'s state."""
    return _flow(system).state_type


def state_fields(system: System) -> tuple[str, ...]:
    """The fields that are present (not ``None``) in ``system``'s state, in packing order."""
    return _flow(system).fields(system)


def field_shapes(system: System, m: int, n: int) -> dict[str, tuple[int, ...]]:
    """Shape of every present state field for an ``m x n`` parameter: ``W`` is ``m x n``, a moment has the shape
    its family's registry entry gives it (``FamilySpec.moment_shapes``), and ``m x n`` where none is given
    (momentum SGD's ``M``)."""
    spec = FAMILIES.get(system.family)
    shapes: dict[str, tuple[int, ...] | None] = {"W": (m, n)}
    if spec is not None:
        shapes.update(spec.moment_shapes(spec.config_type(), m, n))
    return {name: shapes.get(name) or (m, n) for name in state_fields(system)}


def update_order(system: System) -> tuple[tuple[str, ...], ...]:
    """Blocks of fields in the order the discrete optimizer updates them.

    Semi-implicit Euler advances the blocks one after another, each with the
    newest values of the blocks before it: second moments, then first moments,
    then ``W``.  This makes one step equal to one discrete optimizer update.
    """
    return _flow(system).update_order(system)


# ----------------------------------------------------------------------------- bases


def identity_basis() -> Basis:
    """``P = Q = I`` (both ``None``)."""
    return Basis(None, None)


def compute_basis(system: System, G: Array, *, xp: Namespace | None = None) -> Basis:
    """Refresh: ``P, _, Q^T = canonical_svd(G)`` for the sides ``system`` rotates.

    Uses the core's :func:`adadiag_ref.linalg.canonical_svd`, so the ODE and the
    discrete optimizers share one deterministic basis.  ``sides = 0`` gives the
    identity.
    """
    if system.sides == 0:
        return identity_basis()
    xp = namespace(G, xp=xp)
    m, n = G.shape
    if m > n:
        raise ValueError(
            f"rotated systems take a wide or square W (m <= n), got {m} x {n}: pass W^T, as the core's work frame does"
        )
    svd = canonical_svd(G, compute_p=True, compute_q=system.sides == 2, xp=xp)
    return Basis(svd.P, svd.Q if system.sides == 2 else None)


# ----------------------------------------------------------------------------- vector field, H, dH/dt


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

    ``W' = -P U~ Q^T - lambda W`` (:func:`~adadiag_ref.optim.rotation.parameter_velocity`)
    with the family's rotated direction ``U~``; the moments' derivatives are the
    family's (the ``vector_field`` of its registered :class:`~adadiag_ref.optim.families.Flow`).
    """
    xp = namespace(G_rot, xp=xp)
    want = set(state._fields if fields is None else fields)
    field = _flow(system).vector_field(system, state, G_rot, xp)
    derivatives = {
        "W": lambda: parameter_velocity(field.direction(), state.W, basis, system.weight_decay, xp),
        **field.moments,
    }
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


def hamiltonian(system: System, state: ODEState, loss: Array, *, xp: Namespace | None = None) -> Array:
    r"""``H(y)`` given ``loss = L(W)``; it never depends on the bases (the family's ``hamiltonian``)."""
    xp = namespace(state.W, xp=xp)
    return _flow(system).hamiltonian(system, state, loss, xp)


def hamiltonian_rate(system: System, state: ODEState, G: Array, G_rot: Array, *, xp: Namespace | None = None) -> Array:
    r"""Closed-form ``dH/dt = <grad H(y), f(y)>`` (derivations in ``docs/ode.md``).

    ``G`` is ``grad L(W)`` and ``G_rot = P^T G Q``: the family's ``hamiltonian_rate`` plus
    ``-lambda <G, W>`` for weight decay.
    """
    xp = namespace(G, xp=xp)
    rate = _flow(system).hamiltonian_rate(system, state, G_rot, xp)
    if not system.weight_decay:
        return rate + xp.zeros((), dtype=G.dtype)
    return rate + -system.weight_decay * xp.sum(G * state.W)


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
    xp = namespace(W0, G0_rot, xp=xp)
    if moments not in ("gradient", "zero"):
        raise ValueError(f"moments must be 'gradient' or 'zero', got {moments!r}")
    mean_sq = xp.mean(G0_rot * G0_rot)
    f = floor * xp.where(mean_sq > 0, mean_sq, xp.ones_like(mean_sq))
    flow = _flow(system)
    return flow.state_type(W=W0, **flow.initial_moments(system, G0_rot, moments == "zero", f, xp))  # type: ignore[no-any-return]
