r"""The paper's Hamiltonian claims, their proven sufficient conditions and concrete counterexamples.

The paper (Convergence Analysis; Appendix "Hamiltonian function analyses")
claims ``dH/dt <= 0`` along the ODE of every optimizer.  Deriving ``dH/dt``
(:func:`~.systems.hamiltonian_rate`) shows:

* momentum SGD: ``dH/dt = -||M||^2``: holds;
* Adam, AdaDiag, AdaDiag++: holds for the paper's rates ``a = b = 1``, and for any
  rates iff ``b <= 4a``, with *any* basis (orthogonal or not), and across refreshes
  (``H`` does not depend on ``P``, ``Q``);
* Adafactor / AdafacDiag (the paper's ODE): **fails**; it holds when
  ``(b / 4a)(1 + (||G~||^2 + eps m n) / 1^T r) <= 1``;
* Hfac / HfacDiag (the paper's ODE): **fails**; it holds when ``b <= 4a`` and
  ``(c/2)(sqrt(kappa_r s_j) + sqrt(kappa_s r_i)) <= gamma sqrt(1^T r)`` for all ``i, j``,
  which for the paper's ODE follows from ``max_j s_j <= 1^T r`` (true on the invariant
  manifold ``1^T r = 1^T s`` that the zero start lies on);
* decoupled weight decay adds ``-lambda <G, W>``, which has no sign.

:func:`counterexample` builds each failure on a concrete state, :func:`evaluate_at`
returns the closed-form rate, an independent finite-difference value of
``<grad H, f>`` and whether the sufficient condition holds there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .._xp import Array, Namespace, namespace, sqrt
from ..optim.families.common import clip_factor, factored
from ..optim.families.hfac import normalization_constants
from .problems import Problem, _namespace, custom_problem
from .systems import (
    AdafactorODEState,
    AdamODEState,
    Basis,
    HfacODEState,
    MomentumODEState,
    ODEState,
    System,
    hamiltonian,
    hamiltonian_rate,
    identity_basis,
    make_system,
    rotate,
    vector_field,
)

__all__ = [
    "CLAIMS",
    "COUNTEREXAMPLES",
    "Claim",
    "ClaimEvaluation",
    "Counterexample",
    "counterexample",
    "directional_derivative",
    "evaluate_at",
    "quadratic_problem",
    "random_state",
    "sufficient_condition",
]


@dataclass(frozen=True)
class Claim:
    """One statement of the paper and what the library found."""

    key: str
    source: str
    statement: str
    finding: str
    condition: str
    counterexample: str | None


CLAIMS: tuple[Claim, ...] = (
    Claim(
        "momentum_sgd",
        "App. Hamiltonian, Momentum SGD",
        "dH/dt <= 0 for W' = -M, M' = a(G - M), H = L + |M|^2/(2a)",
        "holds: dH/dt = -|M|^2",
        "always (lambda = 0)",
        None,
    ),
    Claim(
        "adam",
        "Sec. Convergence Analysis; App. proof for Adam",
        "dH/dt <= -(1/4)<M^2/(sqrt(V)(sqrt(V)+eps)^2), G^2> <= 0",
        "holds for a = b = 1; the +V term is positive but at most 1/4 of the -M^2/D term. "
        "With general rates it holds for every state iff b <= 4a",
        "b <= 4a, i.e. 1 - beta_2 <= 4 (1 - beta_1)",
        "adam_rates",
    ),
    Claim(
        "adadiag",
        "Proposition (AdaDiag, AdaDiag++); App. proof",
        "same H, dH/dt <= 0; limit points satisfy P^T grad L = 0, hence grad L = 0",
        "holds under the same rate condition, for any fixed P, Q (orthogonality is only needed for "
        "P^T G = 0 => G = 0); H is continuous across refreshes because it does not involve P",
        "b <= 4a",
        "adadiag_rates",
    ),
    Claim(
        "adafactor",
        "App. Hamiltonian, Adafactor; 'AdafacDiag ... in a similar manner'",
        "dH/dt <= 0 for H = L + (1/2)<M/sqrt(r s^T/1^T r), M>",
        "fails: dH/dt contains +(b/4a) Psi ||G~||^2 / 1^T r, unbounded when the gradient is large "
        "compared with r and M sits where G~ is small",
        "(b/4a)(1 + (||G~||^2 + eps m n) / 1^T r) <= 1",
        "adafactor",
    ),
    Claim(
        "hfac",
        "App. Hamiltonian, Hfac; 'HfacDiag ... in a similar manner'",
        "dH/dt <= 0 for H = L + (1/4)<u1^T/sqrt(r1^T), u1^T> + (1/4)<1v^T/sqrt(1s^T), 1v^T>",
        "fails: the -G 1 1^T/n part of W' contributes +(n/2) sum g_r^2/sqrt(r) (and the column "
        "analogue), which beats -sum G^2/sqrt(V^) when s is large compared with 1^T r",
        "b <= 4a and max_j s_j <= 1^T r (paper's ODE); in general "
        "(c/2)(sqrt(kappa_r s_j) + sqrt(kappa_s r_i)) <= gamma sqrt(1^T r)",
        "hfac",
    ),
    Claim(
        "adafactor_ode_vs_algorithm",
        "App. Hamiltonian, Adafactor vs Algorithm AdafacDiag",
        "the Adafactor ODE is the continuous form of Algorithm AdafacDiag",
        "fails: the algorithm's M is an EMA of clip(G~/sqrt(V^)) and W moves by -P M, the ODE's M is an "
        "EMA of G~ and W moves by -P M/sqrt(V^). The algorithm's own limit has H = L + <sqrt(V^) M, M>/(2a), "
        "and its clipping breaks the cross-term cancellation",
        "use momentum_form='update'; dH/dt <= 0 there if clipping is inactive (gamma = 1) or <G~, M> >= 0, "
        "and (b/4a)(rho_i/r_i + sigma_j/s_j - 1^T rho/1^T r - 1) <= 1",
        "adafactor_update_clip",
    ),
    Claim(
        "hfac_ode_vs_algorithm",
        "App. Hamiltonian, Hfac vs Algorithm HfacDiag",
        "the Hfac ODE is the continuous form of Algorithm HfacDiag",
        "fails in two constants: the algorithm divides by sqrt(r 1^T/n), sqrt(1 s^T/m) (the ODE by sqrt(r 1^T)), "
        "and multiplies phi, psi by beta_1-hat (-> 1 as eta -> 0). With normalization='algorithm' the claim "
        "fails whenever clipping is active (gamma < c)",
        "(c/2)(sqrt(n s_j) + sqrt(m r_i)) <= gamma sqrt(1^T r), b <= 4a",
        "hfac_algorithm_clip",
    ),
    Claim(
        "weight_decay",
        "Algorithm 1 (decoupled lambda W) with the Hamiltonian analysis",
        "the analysis covers the algorithm with weight decay",
        "fails: W' = ... - lambda W adds -lambda <G, W> to dH/dt, of either sign",
        "lambda = 0, or <grad L(W), W> >= 0 along the trajectory",
        "weight_decay",
    ),
)


# ----------------------------------------------------------------------------- sufficient conditions


def sufficient_condition(
    system: System, state: ODEState, G: Array, G_rot: Array, *, xp: Namespace | None = None
) -> bool:
    r"""Whether the proven sufficient condition for ``dH/dt <= 0`` holds at this state.

    * momentum: always;  Adam family: ``b <= 4a``;
    * Adafactor gradient form: ``q (1 + 1^T rho / 1^T r) <= 1`` (``q = b / 4a``);
    * Adafactor update form: ``(1 - gamma) <G~, M> >= 0`` and
      ``q (rho_i/r_i + sigma_j/s_j - 1^T rho / 1^T r - 1) <= 1`` for all ``i, j``;  none: always;
    * Hfac: ``q <= 1`` and ``(c/2)(sqrt(kappa_r s_j) + sqrt(kappa_s r_i)) <= gamma sqrt(1^T r)`` for all ``i, j``;

    and in every family ``lambda = 0`` or ``<G, W> >= 0``.  Sufficient, not necessary.
    """
    xp = namespace(G, xp=xp)
    q = system.b / (4 * system.a)
    tiny = 1e-12
    ok = not system.weight_decay or float(xp.sum(G * state.W)) >= 0
    if system.family == "adam":
        return ok and q <= 1.0
    if isinstance(state, AdafactorODEState):
        rho, sigma, R, S = factored(state, G_rot, system.eps, xp)
        if system.momentum_form == "gradient":
            return ok and q * (1.0 + float(xp.sum(rho) / R)) <= 1.0 + tiny
        if system.momentum_form == "update":
            assert state.M is not None
            gamma = float(clip_factor(G_rot / S, system.clip_threshold, xp))
            growth = rho[:, None] / state.r[:, None] + sigma[None, :] / state.s[None, :] - xp.sum(rho) / R - 1.0
            return (
                ok and (1.0 - gamma) * float(xp.sum(G_rot * state.M)) >= 0 and q * float(xp.max(growth)) <= 1.0 + tiny
            )
        return ok
    if isinstance(state, HfacODEState):
        m, n = G_rot.shape
        kr, ks = normalization_constants(system, m, n)
        _, _, R, S = factored(state, G_rot, system.eps, xp)
        gamma = float(clip_factor(G_rot / S, system.clip_threshold, xp))
        lhs = 0.5 * system.momentum_scale * (sqrt(kr * state.s, xp)[None, :] + sqrt(ks * state.r, xp)[:, None])
        return ok and q <= 1.0 and float(xp.max(lhs)) <= gamma * math.sqrt(float(R)) * (1.0 + tiny)
    return ok


# ----------------------------------------------------------------------------- evaluation


class ClaimEvaluation(NamedTuple):
    """``dH/dt`` in closed form, by finite differences of ``H`` along ``f``, and the sufficient condition."""

    dhdt: float
    dhdt_numeric: float
    condition_holds: bool


def _step_state(state: ODEState, direction: ODEState, tau: float) -> ODEState:
    values = {}
    for name in state._fields:
        x, d = getattr(state, name), getattr(direction, name)
        values[name] = None if x is None else x + tau * d
    return type(state)(**values)


def directional_derivative(
    system: System, problem: Problem, state: ODEState, basis: Basis, *, rel_step: float = 1e-3
) -> float:
    r"""``<grad H(y), f(y)> = d/dtau H(y + tau f(y))`` at ``tau = 0`` by 5-point central differences.

    ``(-H(2 tau) + 8 H(tau) - 8 H(-tau) + H(-2 tau)) / (12 tau)``, error ``O(tau^4)``.  ``tau`` is
    ``rel_step`` times the smallest of ``||y|| / ||f||`` and, for every second moment
    (``V``, ``r``, ``s``), ``min x / |x'|``: so no entry of ``V`` moves by more than a
    fraction ``2 rel_step`` of itself and the square roots stay smooth and positive.
    Uses only ``H`` and ``f``: independent of the closed form it checks.
    """
    xp = namespace(state.W)
    G = problem.grad(state.W)
    f = vector_field(system, state, rotate(G, *basis, xp), basis, xp=xp)
    y_norm = math.sqrt(sum(float(xp.sum(x * x)) for x in state if x is not None))
    f_norm = math.sqrt(sum(float(xp.sum(x * x)) for x in f if x is not None))
    if f_norm == 0:
        return 0.0
    scale = max(y_norm, 1e-12) / f_norm
    for name in ("V", "r", "s"):
        x, dx = getattr(state, name, None), getattr(f, name, None)
        if x is not None and dx is not None:
            speed = xp.abs(dx) / x
            top = float(xp.max(speed))
            if top > 0:
                scale = min(scale, 1.0 / top)
    tau = rel_step * scale

    def H_at(s: float) -> float:
        moved = _step_state(state, f, s)
        return float(hamiltonian(system, moved, problem.loss(moved.W), xp=xp))

    return (-H_at(2 * tau) + 8 * H_at(tau) - 8 * H_at(-tau) + H_at(-2 * tau)) / (12 * tau)


def evaluate_at(system: System, problem: Problem, state: ODEState, basis: Basis | None = None) -> ClaimEvaluation:
    """Closed-form and finite-difference ``dH/dt`` at ``state``, and :func:`sufficient_condition` there."""
    xp = namespace(state.W)
    basis = identity_basis() if basis is None else basis
    G = problem.grad(state.W)
    G_rot = rotate(G, *basis, xp)
    closed = float(hamiltonian_rate(system, state, G, G_rot, xp=xp))
    return ClaimEvaluation(
        closed, directional_derivative(system, problem, state, basis), sufficient_condition(system, state, G, G_rot)
    )


def random_state(
    system: System,
    W: Array,
    *,
    seed: int = 0,
    spread: float = 2.0,
    on_manifold: bool = False,
    xp: Namespace | None = None,
) -> ODEState:
    r"""A random state around parameter ``W`` (for property tests of a system).

    First moments are standard normal; second moments are log-normal,
    ``exp(spread * N(0, 1))``, so they span several orders of magnitude.
    ``on_manifold=True`` rescales ``s`` so that ``1_n^T s = 1_m^T r`` (the invariant
    manifold of the factored families).  Deterministic in ``seed``.
    """
    xp = namespace(W, xp=xp)
    rng = np.random.default_rng(seed)
    m, n = W.shape

    def normal(*shape: int) -> Array:
        return xp.asarray(rng.standard_normal(shape))

    def positive(*shape: int) -> np.ndarray:
        return np.asarray(np.exp(spread * rng.standard_normal(shape)))

    if system.family == "momentum":
        return MomentumODEState(W=W, M=normal(m, n))
    if system.family == "adam":
        return AdamODEState(W=W, M=normal(m, n), V=xp.asarray(positive(m, n)))
    r, s = positive(m), positive(n)
    if on_manifold:
        s = s * (r.sum() / s.sum())
    if system.family == "adafactor":
        M = None if system.momentum_form == "none" else normal(m, n)
        return AdafactorODEState(W=W, M=M, r=xp.asarray(r), s=xp.asarray(s))
    return HfacODEState(W=W, u=normal(m), v=normal(n), r=xp.asarray(r), s=xp.asarray(s))


# ----------------------------------------------------------------------------- counterexamples


class Counterexample(NamedTuple):
    """A concrete state where a claim fails: evaluate with :func:`evaluate_at`."""

    key: str
    system: System
    problem: Problem
    state: ODEState
    basis: Basis
    description: str


def quadratic_problem(W: Array, G: Array, *, name: str = "quadratic") -> Problem:
    """``L(V) = 1/2 ||V - C||^2`` with ``C = W - G``, so that ``grad L(W) = G`` exactly."""
    xp = namespace(W, G)
    C = W - G

    def loss(V: Array) -> Array:
        R = V - C
        return 0.5 * xp.sum(R * R)

    def grad(V: Array) -> Array:
        return V - C

    return custom_problem(loss, grad, W, name=name, optimal_value=0.0, description="1/2||W - C||^2")


def _rotation(theta: float) -> np.ndarray:
    c, s = math.cos(theta), math.sin(theta)
    return np.array([[c, -s], [s, c]])


def counterexample(key: str, *, xp: Namespace | None = None) -> Counterexample:
    """The concrete state behind ``key`` in :data:`COUNTEREXAMPLES` (float64, in namespace ``xp``)."""
    try:
        build = COUNTEREXAMPLES[key]
    except KeyError:
        raise ValueError(f"unknown counterexample {key!r}; choose one of {', '.join(COUNTEREXAMPLES)}") from None
    return build(_namespace(xp))


def _arr(xp: Namespace, x: Any) -> Array:
    return xp.asarray(np.asarray(x, dtype=np.float64))


def _adam_rates(xp: Namespace, name: str = "adam") -> Counterexample:
    # G = 0 (at the minimum), M = 1, V = 1 >> eps^2:  dH/dt = -sum M^2/D (1 - (b/4a) sqrt(V)/D) > 0 for b > 4a
    system = make_system(name, a=1.0, b=8.0)
    W = _arr(xp, np.arange(6.0).reshape(2, 3) / 6)
    G = _arr(xp, np.zeros((2, 3)))
    basis = identity_basis() if name == "adam" else Basis(_arr(xp, _rotation(0.3)), None)
    state = AdamODEState(W=W, M=_arr(xp, np.ones((2, 3))), V=_arr(xp, np.ones((2, 3))))
    return Counterexample(
        f"{name}_rates",
        system,
        quadratic_problem(W, G),
        state,
        basis,
        "b = 8 > 4a = 4 at a minimum (G = 0) with M = V = 1: dH/dt = +6 (1 - 2 sqrt(V)/(sqrt(V)+eps)) ~ +6",
    )


def _adafactor(xp: Namespace, name: str = "adafactor") -> Counterexample:
    # M lives where G~ is zero, G~ is large where M is zero: the +q Psi ||G~||^2 / 1^T r term wins
    system = make_system(name, a=1.0, b=1.0)
    P = np.eye(2) if name == "adafactor" else _rotation(0.7)
    G_rot = np.array([[0.0, 0.0], [0.0, 3.0]])
    W = _arr(xp, [[0.5, -0.25], [1.0, 0.0]])
    G = _arr(xp, P @ G_rot)
    basis = identity_basis() if name == "adafactor" else Basis(_arr(xp, P), None)
    state = AdafactorODEState(W=W, M=_arr(xp, [[1.0, 0.0], [0.0, 0.0]]), r=_arr(xp, [1.0, 1.0]), s=_arr(xp, [1.0, 1.0]))
    return Counterexample(
        name,
        system,
        quadratic_problem(W, G),
        state,
        basis,
        "a = b = 1, M = e1 e1^T, G~ = 3 e2 e2^T, r = s = 1: (1/4)(1 + 9/2) > 1, dH/dt = sqrt(2)(1.375 - 1) ~ +0.53",
    )


def _hfac(xp: Namespace, name: str = "hfac") -> Counterexample:
    # u = v = 0 and s >> 1^T r: the +(n/2) sum g_r^2 / sqrt(r) term beats -sum G~^2 / sqrt(V^)
    system = make_system(name, a=1.0, b=1.0)
    P = np.eye(2) if name == "hfac" else _rotation(-0.4)
    G_rot = np.ones((2, 2))
    W = _arr(xp, [[0.25, 0.5], [-0.5, 1.0]])
    basis = identity_basis() if name == "hfac" else Basis(_arr(xp, P), None)
    state = HfacODEState(
        W=W, u=_arr(xp, [0.0, 0.0]), v=_arr(xp, [0.0, 0.0]), r=_arr(xp, [1.0, 1.0]), s=_arr(xp, [100.0, 100.0])
    )
    return Counterexample(
        name,
        system,
        quadratic_problem(W, _arr(xp, P @ G_rot)),
        state,
        basis,
        "a = b = 1, G~ = 1 1^T, u = v = 0, r = 1, s = 100 (> 1^T r = 2): dH/dt = -4/sqrt(50) + 2 + 2/10 ~ +1.63",
    )


def _adafactor_update_clip(xp: Namespace) -> Counterexample:
    # clipping active (gamma < 1) and M against G~: -(1 - gamma)<G~, M> > 0 dominates -sum S M^2
    system = make_system("adafactor", a=1.0, b=1.0, momentum_form="update", clip_threshold=1.0)
    G = np.array([[4.0, -2.0, 1.0], [1.0, 3.0, -2.0]])
    W = _arr(xp, np.zeros((2, 3)))
    sq = G * G
    r, s = sq.sum(axis=1), sq.sum(axis=0)
    state = AdafactorODEState(W=W, M=_arr(xp, -0.01 * G), r=_arr(xp, r / 16), s=_arr(xp, s / 16))
    return Counterexample(
        "adafactor_update_clip",
        system,
        quadratic_problem(W, _arr(xp, G)),
        state,
        identity_basis(),
        "Algorithm-form Adafactor with d = 1: r, s 16x below the sums of G~^2, so RMS(U) ~ 4.1 and gamma ~ 0.24; "
        "M = -0.01 G~ gives -(1 - gamma)<G~, M> > 0",
    )


def _hfac_algorithm_clip(xp: Namespace) -> Counterexample:
    # Algorithm normalisation, c = 1, consistent r, s (1^T r = 1^T s), uniform G~ with RMS(U) = 2 > d = 1
    system = make_system("hfac", a=1.0, b=1.0, normalization="algorithm", momentum_scale=1.0, clip_threshold=1.0)
    m, n = 2, 4
    G = 2.0 * np.ones((m, n))
    R = float(m * n)
    state = HfacODEState(
        W=_arr(xp, np.zeros((m, n))),
        u=_arr(xp, np.zeros(m)),
        v=_arr(xp, np.zeros(n)),
        r=_arr(xp, np.full(m, R / m)),
        s=_arr(xp, np.full(n, R / n)),
    )
    return Counterexample(
        "hfac_algorithm_clip",
        system,
        quadratic_problem(state.W, _arr(xp, G)),
        state,
        identity_basis(),
        "Algorithm-form Hfac (sqrt(r/n), c = 1, d = 1) on the invariant manifold: G~ = 2, V^ = 1, "
        "gamma = 1/2 < c, u = v = 0: dH/dt = (c - gamma) sum G~^2 > 0",
    )


def _weight_decay(xp: Namespace) -> Counterexample:
    system = make_system("momentum_sgd", a=1.0, weight_decay=0.1)
    W = _arr(xp, [[1.0, 2.0, 0.0], [0.0, -1.0, 1.0]])
    G = -W  # <G, W> < 0: the decay pushes W against the gradient flow
    state = MomentumODEState(W=W, M=_arr(xp, np.zeros((2, 3))))
    return Counterexample(
        "weight_decay",
        system,
        quadratic_problem(W, G),
        state,
        identity_basis(),
        "momentum SGD, lambda = 0.1, M = 0, G = -W: dH/dt = -lambda <G, W> = 0.1 ||W||^2 = 0.7",
    )


COUNTEREXAMPLES: dict[str, Any] = {
    "adam_rates": lambda xp: _adam_rates(xp, "adam"),
    "adadiag_rates": lambda xp: _adam_rates(xp, "adadiag"),
    "adafactor": lambda xp: _adafactor(xp, "adafactor"),
    "adafacdiag": lambda xp: _adafactor(xp, "adafacdiag"),
    "hfac": lambda xp: _hfac(xp, "hfac"),
    "hfacdiag": lambda xp: _hfac(xp, "hfacdiag"),
    "adafactor_update_clip": _adafactor_update_clip,
    "hfac_algorithm_clip": _hfac_algorithm_clip,
    "weight_decay": _weight_decay,
}
"""Counterexample key -> builder ``xp -> Counterexample``."""
