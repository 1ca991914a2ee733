r"""Terms: the right-hand side ``f(t, y, args)`` of ``dy/dt = f(t, y, args)`` on flat vectors.

Solvers see a flat 1-D state ``y`` (so that any Runge-Kutta method, error norm
and :func:`scipy.integrate.solve_ivp` can handle it); a :class:`SystemTerm` packs
an optimizer's structured state (``W, M, V, ...``) into it and back.

* :class:`ODETerm` wraps any callable ``f(t, y, args)``.
* :class:`SystemTerm` is one optimizer's system (:mod:`.systems`) on one
  problem (:mod:`.problems`).  Its ``args`` is the :class:`~.systems.Basis` in
  force, which :meth:`SystemTerm.refresh` recomputes at a basis refresh.  It
  also exposes the split that semi-implicit Euler needs: the gradient once per
  step, then the field block by block (:func:`~.systems.update_order`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from .._xp import Array, Namespace, namespace, sqrt
from .problems import Problem
from .systems import (
    Basis,
    ODEState,
    System,
    compute_basis,
    field_shapes,
    hamiltonian,
    hamiltonian_rate,
    identity_basis,
    initial_state,
    rotate,
    state_type,
    update_order,
    vector_field,
)

__all__ = [
    "BiasCorrectedTerm",
    "Diagnostics",
    "Gradients",
    "ODETerm",
    "StateLayout",
    "SystemTerm",
    "bias_corrected_rate",
    "bias_corrected_term",
    "pack",
    "unpack",
]


class StateLayout(NamedTuple):
    """Where each field of a structured state lives in the flat vector (static, hashable)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    dim: int

    @classmethod
    def from_shapes(cls, shapes: dict[str, tuple[int, ...]]) -> StateLayout:
        """Fields packed one after another, in the order of ``shapes``."""
        offsets, total = [], 0
        for shape in shapes.values():
            offsets.append(total)
            total += math.prod(shape)
        return cls(tuple(shapes), tuple(shapes.values()), tuple(offsets), total)

    def span(self, name: str) -> tuple[int, int]:
        """``(start, stop)`` of field ``name`` in the flat vector."""
        i = self.names.index(name)
        return self.offsets[i], self.offsets[i] + math.prod(self.shapes[i])


def _reshape(x: Array, shape: tuple[int, ...], xp: Namespace) -> Array:
    """``xp.reshape(x, shape)``, by the array's own method where it has one (NumPy's module function costs ~3 us
    a call in wrappers, on the path of every evaluation of the field; the same view either way)."""
    method = getattr(x, "reshape", None)
    return method(shape) if method is not None else xp.reshape(x, shape)


def pack(state: ODEState, layout: StateLayout, xp: Namespace) -> Array:
    """``y = concat(vec(field) for field in layout)`` (row-major ``vec``)."""
    return xp.concat([_reshape(getattr(state, name), (-1,), xp) for name in layout.names])


def unpack(y: Array, layout: StateLayout, cls: type, xp: Namespace) -> Any:
    """Inverse of :func:`pack`: a ``cls`` NamedTuple (absent fields ``None``)."""
    values: dict[str, Any] = dict.fromkeys(cls._fields)  # type: ignore[attr-defined]
    for name, shape, start in zip(layout.names, layout.shapes, layout.offsets, strict=True):
        values[name] = _reshape(y[start : start + math.prod(shape)], shape, xp)
    return cls(**values)


@dataclass(frozen=True, eq=False)
class ODETerm:
    """A plain vector field ``f(t, y, args) -> dy/dt`` on flat vectors, with optional extras.

    Attributes:
        fn: ``f(t, y, args)``.
        refresh_fn: ``refresh_fn(t, y, args) -> args`` at a basis refresh (``None``: ``args`` kept).
        hamiltonian_fn: ``H(y)``, a host float; with ``rate_fn`` it makes the term checkable by
            :func:`~.checks.check` (your own flow, no family registration).
        rate_fn: the closed-form ``dH/dt = <grad H(y), f(t, y, args)>`` at ``(t, y, args)``.
        loss_fn: ``L(y)`` for the report (``None``: reported as ``H``).
        grad_norm_fn: ``||grad L||`` at ``y`` for the report and gradient-tolerance events (``None``: NaN).
        autonomous: ``f`` does not depend on ``t`` (spares :class:`~.solvers.Rosenbrock` its ``df/dt``).
    """

    fn: Callable[[float, Array, Any], Array]
    refresh_fn: Callable[[float, Array, Any], Any] | None = None
    hamiltonian_fn: Callable[[Array], float] | None = None
    rate_fn: Callable[[float, Array, Any], float] | None = None
    loss_fn: Callable[[Array], float] | None = None
    grad_norm_fn: Callable[[Array], float] | None = None
    autonomous: bool = False

    def vector_field(self, t: float, y: Array, args: Any) -> Array:
        """``f(t, y, args)``."""
        return self.fn(t, y, args)

    def refresh(self, t: float, y: Array, args: Any) -> Any:
        """``refresh_fn(t, y, args)``, or ``args`` unchanged when the term has nothing to refresh."""
        return args if self.refresh_fn is None else self.refresh_fn(t, y, args)

    def _needs(self, name: str) -> Callable[..., Any]:
        fn = getattr(self, name)
        if fn is None:
            raise ValueError(f"this ODETerm has no {name}: pass ODETerm(fn, {name}=...)")
        return fn  # type: ignore[no-any-return]

    def hamiltonian(self, y: Array) -> float:
        """``H(y)`` by ``hamiltonian_fn`` (``ValueError`` without one)."""
        return float(self._needs("hamiltonian_fn")(y))

    def hamiltonian_rate(self, t: float, y: Array, args: Any) -> float:
        """The closed-form ``dH/dt`` by ``rate_fn`` (``ValueError`` without one)."""
        return float(self._needs("rate_fn")(t, y, args))

    def loss(self, y: Array) -> float:
        """``loss_fn(y)``, or ``H(y)`` without one."""
        return float(self.loss_fn(y)) if self.loss_fn is not None else self.hamiltonian(y)

    def grad_norm(self, y: Array) -> float:
        """``grad_norm_fn(y)``, or NaN without one."""
        return float(self.grad_norm_fn(y)) if self.grad_norm_fn is not None else math.nan

    def diagnostics(self, t: float, y: Array, args: Any) -> Diagnostics:
        """``H``, ``L``, ``||grad L||``, ``dH/dt`` at ``y`` from the callables (:meth:`loss`, :meth:`grad_norm`)."""
        return Diagnostics(self.hamiltonian(y), self.loss(y), self.grad_norm(y), self.hamiltonian_rate(t, y, args))


class Diagnostics(NamedTuple):
    """``H(y)``, ``L(W)``, ``||grad L(W)||`` and closed-form ``dH/dt`` at one state."""

    H: float
    L: float
    grad_norm: float
    rate: float


class Gradients(NamedTuple):
    """``G = grad L(W)`` and ``G~ = P^T G Q`` at one state."""

    G: Array
    G_rot: Array


@dataclass(frozen=True, eq=False)
class SystemTerm:
    """An optimizer's ODE (``system``) on ``problem``; ``args`` is the :class:`Basis`.

    ``y`` packs the state fields of :func:`~.systems.state_fields` in order.
    """

    system: System
    problem: Problem
    layout: StateLayout = field(init=False)
    autonomous: ClassVar[bool] = True
    """``f`` does not depend on ``t`` (the rates are constants)."""
    xp: Namespace = field(init=False, repr=False)

    def __post_init__(self) -> None:
        m, n = self.problem.shape
        if self.system.sides and m > n:
            raise ValueError(f"rotated systems need m <= n, got W of shape {m} x {n}; use W^T")
        object.__setattr__(self, "layout", StateLayout.from_shapes(field_shapes(self.system, m, n)))
        object.__setattr__(self, "xp", namespace(self.problem.W0))

    # -- structure ---------------------------------------------------------------------------

    def unpack(self, y: Array) -> ODEState:
        """Structured state from the flat ``y``."""
        return unpack(y, self.layout, state_type(self.system), self.xp)  # type: ignore[no-any-return]

    def pack(self, state: ODEState) -> Array:
        """Flat ``y`` from the structured state."""
        return pack(state, self.layout, self.xp)

    def blocks(self) -> tuple[tuple[str, ...], ...]:
        """The semi-implicit Euler blocks, in the discrete optimizer's order (:func:`~.systems.update_order`)."""
        return update_order(self.system)

    # -- the vector field --------------------------------------------------------------------

    def gradients(self, t: float, y: Array, args: Basis) -> Gradients:
        """``G = grad L(W)`` and ``G~ = P^T G Q`` at ``y`` (one gradient evaluation)."""
        G = self.problem.grad(self.unpack(y).W)
        return Gradients(G, rotate(G, *args, self.xp))

    def field_given_gradients(
        self, t: float, y: Array, grads: Gradients, args: Basis, fields: tuple[str, ...] | None = None
    ) -> Array:
        """``f(y)`` with the gradient supplied; only ``fields`` (zeros elsewhere) when given.

        Semi-implicit Euler re-uses one gradient per step and advances one block of fields at a time.
        """
        return self._field(t, self.unpack(y), grads.G_rot, args, fields)

    def vector_field(self, t: float, y: Array, args: Basis) -> Array:
        """``f(t, y, args) = dy/dt`` (one gradient evaluation; ``y`` unpacked once)."""
        state = self.unpack(y)
        return self._field(t, state, rotate(self.problem.grad(state.W), *args, self.xp), args)

    def _field(
        self, t: float, state: ODEState, G_rot: Array, args: Basis, fields: tuple[str, ...] | None = None
    ) -> Array:
        """The packed field of the structured ``state`` given ``G~`` (the system's constant rates)."""
        return pack(vector_field(self.system, state, G_rot, args, fields=fields, xp=self.xp), self.layout, self.xp)

    def refresh(self, t: float, y: Array, args: Basis) -> Basis:
        """Basis refresh at ``t``: ``P, _, Q^T = canonical_svd(grad L(W(t)))``; moments untouched."""
        return compute_basis(self.system, self.problem.grad(self.unpack(y).W))

    # -- initial conditions ------------------------------------------------------------------

    def initial_basis(self, W: Array | None = None) -> Basis:
        """The basis of ``grad L(W)`` (``W0`` by default), identity for unrotated systems."""
        W = self.problem.W0 if W is None else W
        return compute_basis(self.system, self.problem.grad(W))

    def initial_state(
        self,
        basis: Basis | None = None,
        *,
        W0: Array | None = None,
        moments: str = "gradient",
        floor: float = 1e-4,
    ) -> Array:
        """Flat ``y0`` (see :func:`~.systems.initial_state`) for ``W0`` (default ``problem.W0``)."""
        W0 = self.problem.W0 if W0 is None else W0
        basis = identity_basis() if basis is None else basis
        G0 = rotate(self.problem.grad(W0), *basis, self.xp)
        return self.pack(initial_state(self.system, W0, G0, moments=moments, floor=floor, xp=self.xp))

    # -- diagnostics -------------------------------------------------------------------------

    def loss(self, y: Array) -> float:
        """``L(W)``."""
        return float(self.problem.loss(self.unpack(y).W))

    def grad_norm(self, y: Array) -> float:
        """``||grad L(W)||_F``."""
        G = self.problem.grad(self.unpack(y).W)
        return float(sqrt(self.xp.sum(G * G), self.xp))

    def hamiltonian(self, y: Array) -> float:
        """``H(y)`` (independent of the basis)."""
        state = self.unpack(y)
        return float(hamiltonian(self.system, state, self.problem.loss(state.W), xp=self.xp))

    def hamiltonian_rate(self, t: float, y: Array, args: Basis) -> float:
        """Closed-form ``dH/dt`` at ``y`` under basis ``args``."""
        state = self.unpack(y)
        grads = self.gradients(t, y, args)
        return float(hamiltonian_rate(self.system, state, grads.G, grads.G_rot, xp=self.xp))

    def diagnostics(self, t: float, y: Array, args: Basis) -> Diagnostics:
        """``H``, ``L``, ``||grad L||`` and ``dH/dt`` at ``y`` with one loss and one gradient evaluation."""
        xp = self.xp
        state = self.unpack(y)
        loss = self.problem.loss(state.W)
        G = self.problem.grad(state.W)
        G_rot = rotate(G, *args, xp)
        return Diagnostics(
            H=float(hamiltonian(self.system, state, loss, xp=xp)),
            L=float(loss),
            grad_norm=float(sqrt(xp.sum(G * G), xp)),
            rate=float(hamiltonian_rate(self.system, state, G, G_rot, xp=xp)),
        )


def bias_corrected_rate(rate: float, t: float) -> float:
    r"""``rate / (1 - exp(-rate t))``: the limit of the bias-corrected EMA coefficient.

    With ``beta = 1 - rate h`` and ``t = k h``, Adam's bias correction
    ``beta_hat_k = beta (1 - beta^(k-1)) / (1 - beta^k)`` gives
    ``(1 - beta_hat_k) / h -> rate / (1 - exp(-rate t))`` as ``h -> 0``: ``~ 1/t`` at the
    start, ``rate`` for ``t >> 1 / rate``.  ``t`` is floored at 1e-300 (the rate is
    infinite at ``t = 0``, where the moments must equal their inputs).
    """
    return rate / -math.expm1(-rate * max(t, 1e-300))


@dataclass(frozen=True, eq=False)
class BiasCorrectedTerm(SystemTerm):
    r"""The non-autonomous limit of a *bias-corrected* discrete optimizer (see :func:`bias_corrected_term`).

    The same state layout, blocks and basis refresh as :class:`SystemTerm` (a refresh recomputes
    ``P, Q`` from ``grad L(W(t))``, moments untouched); only the rates are time dependent,
    ``a(t) = a / (1 - e^{-a t})`` and ``b(t) = b / (1 - e^{-b t})``.  ``H`` is not conserved in the
    autonomous sense here, so the closed-form ``dH/dt`` (and :meth:`diagnostics`) are refused.
    """

    _systems: dict[float, System] = field(init=False, default_factory=dict, repr=False)
    autonomous: ClassVar[bool] = False

    def system_at(self, t: float) -> System:
        """The system with the rates in force at ``t``: ``a(t)``, ``b(t)`` (:func:`bias_corrected_rate`)."""
        found = self._systems.get(t)
        if found is None:
            found = self.system.replace(
                a=bias_corrected_rate(self.system.a, t), b=bias_corrected_rate(self.system.b, t)
            )
            if len(self._systems) >= 4096:  # bound the memory of a long run; the cache only saves revalidation
                self._systems.clear()
            self._systems[t] = found
        return found

    def _field(
        self, t: float, state: ODEState, G_rot: Array, args: Basis, fields: tuple[str, ...] | None = None
    ) -> Array:
        """The packed field with the rates ``a(t)``, ``b(t)`` in force at ``t``."""
        derivative = vector_field(self.system_at(t), state, G_rot, args, fields=fields, xp=self.xp)
        return pack(derivative, self.layout, self.xp)

    def hamiltonian_rate(self, t: float, y: Array, args: Basis) -> float:
        """Refused: the autonomous ``H`` has no sign-definite rate along the bias-corrected flow."""
        raise TypeError("a bias-corrected term has a time-dependent Hamiltonian; docs/ode.md, section 3, gives it")

    def diagnostics(self, t: float, y: Array, args: Basis) -> Diagnostics:
        """Refused, as :meth:`hamiltonian_rate`."""
        return self.hamiltonian_rate(t, y, args)  # type: ignore[return-value]


def bias_corrected_term(system: System, problem: Problem) -> BiasCorrectedTerm:
    r"""The non-autonomous limit of a *bias-corrected* discrete optimizer: a :class:`BiasCorrectedTerm`.

    Every EMA rate becomes time dependent, ``a(t) = a / (1 - e^{-a t})`` and
    ``b(t) = b / (1 - e^{-b t})`` (:func:`bias_corrected_rate`); the start is
    ``M(0) = G~0``, ``V(0) = G~0^2`` (``moments="gradient"`` with ``floor=0``).  ``args``
    is the basis, and a :class:`~.integrate.BasisSchedule` refreshes it exactly as for a
    :class:`SystemTerm` (``P, _, Q^T = canonical_svd(grad L(W(t)))``, moments untouched), so a rotated
    optimizer with bias correction and refreshes converges to this flow at order 1.  The autonomous
    :class:`SystemTerm` is the limit without bias correction; the two differ by O(1) on ``t <~ 1/b``.
    See ``docs/ode.md``.
    """
    return BiasCorrectedTerm(system, problem)
