r"""``discrete_limit(...)``: the discrete optimizer converges to its flow at order 1, in one call.

With learning rate ``eta = h``, ``beta_1 = 1 - a h``, ``beta_2 = 1 - b h`` and a basis refresh every
``k = T_r / h`` steps, ``N = T / h`` steps of the core's :func:`~adadiag_ref.optim.core.step` approximate
``W(T)`` of the optimizer's flow with refreshes at ``t = 0, T_r, 2 T_r, ...``:

* without bias correction the limit is the autonomous :class:`~.terms.SystemTerm` and the discrete run
  starts from the flow's initial moments (``moments="gradient"``, :func:`~.systems.initial_state`),
  written into the optimizer state: the iterates are then semi-implicit Euler steps of the flow;
* with bias correction the limit is :func:`~.terms.bias_corrected_term`, started at ``t0 = 1e-9``
  (the rates ``a / (1 - e^{-a t})`` are infinite at 0) from the moments the optimizer holds after its
  first step (the bias-corrected EMAs forget their zero start: ``beta_hat_1 = 0``), which this
  function takes from one core step with ``lr = 0``, so the flow and the optimizer start alike for
  every family.

The flow is integrated by DOPRI5 at ``rtol = 1e-12``, ``atol = 1e-14`` (its error then sits three
orders below the finest discrete error), and ``error(h) = max_ij |W_h(T) - W(T)|_ij``.  The order is
the least-squares slope of ``log error`` against ``log h``; semi-implicit Euler is first order, so
it is 1 up to the ``O(h^2)`` terms of the error's expansion.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._xp import to_numpy
from ..config import AdafactorConfig, BaseConfig, HfacConfig, make_config
from ..optim import core
from .controllers import PIController
from .integrate import BasisSchedule, SaveAt, integrate
from .problems import Problem
from .solvers import Dopri5
from .systems import ALIASES, Basis, System, make_system
from .terms import SystemTerm, bias_corrected_term

__all__ = ["DiscreteLimit", "discrete_limit", "flow_of_config"]

BIAS_CORRECTED_T0 = 1e-9
"""Start of the bias-corrected flow: its rates are ``~ 1/t`` at 0; the offset moves ``W(T)`` by ``O(1e-9)``."""

_CORE_NAMES = {"adam": "adamw"}


class DiscreteLimit(NamedTuple):
    """What :func:`discrete_limit` measured.

    Attributes:
        optimizer: the core optimizer's name; system: the flow it converges to.
        hs: the step sizes ``h`` (= ``lr``), largest first; errors: ``max |W_h(T) - W(T)|`` for each.
        order: least-squares slope of ``log error`` against ``log h`` over every ``h``.
        local_orders: ``log2``-type slopes between consecutive ``h`` (the fit's stability).
        t_end: ``T``; refresh_period: ``T_r`` (``None``: never refreshed); bias_correction: which limit.
        W_flow: the flow's ``W(T)`` (host array); flow_steps: the accepted DOPRI5 steps it took.
    """

    optimizer: str
    system: System
    hs: np.ndarray
    errors: np.ndarray
    order: float
    local_orders: np.ndarray
    t_end: float
    refresh_period: float | None
    bias_correction: bool
    W_flow: np.ndarray
    flow_steps: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the flow's ``W(T)`` left out)."""
        return {
            "optimizer": self.optimizer,
            "system": self.system.describe(),
            "hs": [float(h) for h in self.hs],
            "errors": [float(e) for e in self.errors],
            "order": self.order,
            "local_orders": [float(p) for p in self.local_orders],
            "t_end": self.t_end,
            "refresh_period": self.refresh_period,
            "bias_correction": self.bias_correction,
            "flow_steps": self.flow_steps,
        }


def flow_of_config(cfg: BaseConfig, a: float, b: float) -> System:
    """The flow whose semi-implicit Euler discretisation is the optimizer of ``cfg`` (rates ``a``, ``b``).

    Adam family: the same ``eps`` and weight decay.  Adafactor family: Algorithm AdafacDiag's form
    (``momentum_form="update"``, or ``"none"`` without momentum) with the same clipping threshold.
    Hfac family: Algorithm HfacDiag's normalisation with ``momentum_scale = 1`` (the limit of its
    ``beta_1``).  Adafactor options that have no flow (``relative_step``, ``scale_parameter``, the
    ``"adafactor"`` beta-2 schedule) raise ``ValueError``.
    """
    options: dict[str, Any] = {"a": a, "b": b, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if isinstance(cfg, AdafactorConfig):
        if cfg.relative_step or cfg.scale_parameter or cfg.beta2_schedule != "bias_corrected":
            raise ValueError(
                "relative_step, scale_parameter and beta2_schedule='adafactor' have no continuous-time limit "
                "with lr = h, beta = 1 - a h"
            )
        options.update(momentum_form="update" if cfg.momentum else "none", clip_threshold=cfg.clip_threshold)
    elif isinstance(cfg, HfacConfig):
        options.update(normalization="algorithm", momentum_scale=1.0, clip_threshold=cfg.clip_threshold)
    return make_system(ALIASES.get(cfg.name, cfg.name), **options)


def _steps(length: float, h: float, what: str) -> int:
    """``length / h`` as an integer; ``ValueError`` when ``h`` does not divide ``length``."""
    count = round(length / h)
    if count < 1 or abs(count * h - length) > 1e-9 * length:
        raise ValueError(f"h = {h!r} must divide {what} = {length!r} (a whole number of steps)")
    return count


def _config(optimizer: str, h: float, a: float, b: float, refresh: int | None, options: dict[str, Any]) -> BaseConfig:
    """The core config of step ``h``: ``lr = h``, ``betas = (1 - a h, 1 - b h)``, ``update_freq = refresh``."""
    if not (0 < a * h < 1 and 0 < b * h < 1):
        raise ValueError(f"need 0 < a h < 1 and 0 < b h < 1 (betas in (0, 1)), got a h = {a * h}, b h = {b * h}")
    return make_config(optimizer, lr=h, betas=(1 - a * h, 1 - b * h), update_freq=refresh, **options)


def _flow_start(
    optimizer: str, problem: Problem, term: SystemTerm, a: float, b: float, bias_correction: bool, floor: float,
    refresh: bool, options: dict[str, Any],
) -> tuple[Any, Any, Basis]:  # fmt: skip
    """``(optimizer state at step 0, flow's y0, flow's basis)``: the two start alike (module docstring)."""
    W0 = problem.W0
    G0 = problem.grad(W0)
    # the limit h -> 0 of the first step's moments (Hfac's scale beta_1 = 1 - a h tends to 1); lr = 0 keeps W0
    cfg = _config(optimizer, 1e-12 / max(a, b), a, b, 1 if refresh else None, options)
    state = core.init(W0, cfg)
    if bias_correction:
        _, after_one = core.step(state, G0, cfg, W0, lr=0.0)
        basis = Basis(after_one.P, after_one.Q)
        moments = {name: getattr(after_one, name) for name in term.layout.names if name != "W"}
        y0 = term.pack(term.unpack(term.initial_state(basis))._replace(**moments))
        return state, y0, basis
    if refresh:
        state = core.refresh_basis(state, G0, cfg)
    basis = Basis(state.P, state.Q)
    y0 = term.initial_state(basis, moments="gradient", floor=floor)
    start = term.unpack(y0)
    state = state._replace(**{name: getattr(start, name) for name in term.layout.names if name != "W"})
    return state, y0, basis


def discrete_limit(
    optimizer: str,
    problem: Problem,
    *,
    t_end: float = 1.0,
    hs: Sequence[float] = (0.02, 0.01, 0.005, 0.0025),
    a: float = 1.0,
    b: float = 1.0,
    refresh_period: float | None = None,
    bias_correction: bool = True,
    floor: float = 1e-4,
    rtol: float = 1e-12,
    atol: float = 1e-14,
    **options: Any,
) -> DiscreteLimit:
    r"""Run the core optimizer ``optimizer`` at every ``h`` in ``hs`` and measure its distance to the flow.

    For each ``h``: ``T / h`` steps of :func:`~adadiag_ref.optim.core.step` with ``lr = h``,
    ``betas = (1 - a h, 1 - b h)``, ``update_freq = T_r / h`` (``T_r = refresh_period``; ``None``: no
    refresh) and ``bias_correction``; ``options`` are further config options (``eps``,
    ``weight_decay``, ``clip_threshold``, ``momentum``, ...).  The flow (:func:`flow_of_config`) is
    integrated once, with refreshes at ``0, T_r, 2 T_r, ...`` (module docstring for the start).

    Every ``h`` must divide ``t_end`` and ``refresh_period``.  Returns a :class:`DiscreteLimit`; the
    errors halve as ``h`` halves (order 1) for every optimizer of the library.  ``problem`` needs
    ``m <= n`` for rotated optimizers (pass ``W^T`` otherwise).  A non-finite discrete run raises
    ``FloatingPointError`` (its ``h`` is outside the stable range: take smaller steps).
    """
    optimizer = _CORE_NAMES.get(optimizer, optimizer)
    hs = sorted((float(h) for h in hs), reverse=True)
    if len(hs) < 2 or not all(h > 0 and math.isfinite(h) for h in hs):
        raise ValueError(f"need at least two finite step sizes h > 0, got {hs!r}")
    counts = [_steps(float(t_end), h, "t_end") for h in hs]
    refreshes = [None if refresh_period is None else _steps(float(refresh_period), h, "refresh_period") for h in hs]
    system = flow_of_config(_config(optimizer, hs[0], a, b, refreshes[0], options), a, b)
    term: SystemTerm = bias_corrected_term(system, problem) if bias_correction else SystemTerm(system, problem)
    options = {"bias_correction": bias_correction, **options}
    state0, y0, basis = _flow_start(
        optimizer, problem, term, a, b, bias_correction, floor, refresh_period is not None, options
    )
    t0 = BIAS_CORRECTED_T0 if bias_correction else 0.0
    schedule = BasisSchedule.every(refresh_period, 0.0, t_end) if refresh_period is not None else None
    flow = integrate(
        term, Dopri5(), t0, float(t_end), y0, basis, dt0=1e-6 * float(t_end),
        controller=PIController(rtol=rtol, atol=atol), saveat=SaveAt(steps=False), basis_schedule=schedule,
    )  # fmt: skip
    if not flow.success:
        raise RuntimeError(f"the flow's integration stopped at t = {flow.t_final:.6g}: {flow.status}")
    W_flow = np.asarray(to_numpy(term.unpack(flow.y_final).W), dtype=np.float64)
    errors = []
    for h, count, refresh in zip(hs, counts, refreshes, strict=True):
        cfg = _config(optimizer, h, a, b, refresh, options)
        W, state = problem.W0, state0
        for _ in range(count):
            W, state = core.step(state, problem.grad(W), cfg, W, check=False)
        error = float(np.max(np.abs(np.asarray(to_numpy(W), dtype=np.float64) - W_flow)))
        if not math.isfinite(error):
            raise FloatingPointError(f"the discrete run with h = {h:g} is not finite at T = {t_end:g}")
        errors.append(error)
    log_h, log_e = np.log(hs), np.log(np.maximum(errors, 1e-300))
    order = float(np.polyfit(log_h, log_e, 1)[0])
    local = np.diff(log_e) / np.diff(log_h)
    return DiscreteLimit(
        optimizer=optimizer,
        system=system,
        hs=np.asarray(hs),
        errors=np.asarray(errors),
        order=order,
        local_orders=local,
        t_end=float(t_end),
        refresh_period=refresh_period,
        bias_correction=bias_correction,
        W_flow=W_flow,
        flow_steps=flow.n_steps,
    )
