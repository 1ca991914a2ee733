"""Figures: one :func:`~.checks.check` run (``H(t)``, ``L(t)``, ``||grad L||(t)``, the step size) and one
:func:`~.discrete.discrete_limit` (the error against ``h``, log-log, with a slope-1 guide).

matplotlib is optional (the ``plot`` extra); it is imported lazily, with the
non-interactive Agg backend (``adadiag_ref._cli.pyplot``), and a clear error is
raised when it is missing.
"""

from __future__ import annotations

import numpy as np

from .._cli import pyplot
from .checks import CheckResult
from .discrete import DiscreteLimit

__all__ = ["plot_check", "plot_discrete_limit"]


def _positive(x: np.ndarray) -> np.ndarray:
    """Values for a log axis: non-positive entries become NaN (a gap, not a crash)."""
    out = np.asarray(x, dtype=np.float64).copy()
    out[~(out > 0)] = np.nan
    return out


def plot_check(result: CheckResult, path: str) -> str:
    """Draw ``result``'s trajectory to ``path`` (PNG, PDF, SVG by extension) and return ``path``.

    Top: ``H(t) - L*`` and ``L(W(t)) - L*`` on a log axis, steps where ``H`` rose marked
    in red, basis refreshes as dotted lines.  Middle: ``||grad L(W(t))||`` (log).  Bottom:
    ``-dH/dt`` (log), ``+dH/dt`` in red where it is positive (where the claim fails), and
    the accepted step sizes.
    """
    if result.trajectory is None:
        raise ValueError("this result carries no trajectory")
    plt = pyplot()
    tr = result.trajectory
    shift = result.optimal_value or 0.0
    fig, axes = plt.subplots(3, 1, figsize=(8.0, 9.0), sharex=True, constrained_layout=True)
    ax_h, ax_g, ax_s = axes

    ax_h.semilogy(tr.t, _positive(tr.H - shift), color="C0", lw=1.6, label="H(t) - L*")
    ax_h.semilogy(tr.t, _positive(tr.L - shift), color="C1", lw=1.2, ls="--", label="L(W(t)) - L*")
    rises = np.nonzero(np.diff(tr.H) > 0)[0] + 1
    if rises.size:
        ax_h.semilogy(
            tr.t[rises], _positive(tr.H[rises] - shift), "o", ms=3, color="C3", label=f"H rose ({rises.size} steps)"
        )
    ax_h.set_ylabel("Hamiltonian / loss")
    ax_h.legend(loc="upper right", fontsize=8)

    ax_g.semilogy(tr.t, _positive(tr.grad_norm), color="C2", lw=1.4)
    ax_g.set_ylabel("||grad L(W(t))||")

    ax_s.semilogy(tr.t, _positive(-tr.dHdt), color="C4", lw=1.2, label="-dH/dt (closed form)")
    if np.any(tr.dHdt > 0):
        ax_s.semilogy(tr.t, _positive(tr.dHdt), color="C3", lw=1.4, label="+dH/dt where > 0 (claim fails)")
    if tr.step_sizes.size:
        ax_s.semilogy(tr.t[1:], _positive(tr.step_sizes), color="0.4", lw=1.0, ls=":", label="step size h")
    ax_s.set_ylabel("|dH/dt|, h")
    ax_s.set_xlabel("ODE time t")
    ax_s.legend(loc="upper right", fontsize=8)

    for ax in axes:
        ax.grid(True, which="both", alpha=0.25)
        for k, t_ref in enumerate(tr.refresh_times):
            ax.axvline(t_ref, color="0.6", lw=0.8, ls=":", label="basis refresh" if (k == 0 and ax is ax_g) else None)
    if tr.refresh_times.size:
        ax_g.legend(loc="upper right", fontsize=8)
    fig.suptitle(
        f"{result.system} on {result.problem} with {result.integrator}: {result.verdict}\n"
        f"max H increase {result.max_h_increase:.2e} (error est. {result.local_error_estimate:.2e}), "
        f"||grad L|| {result.grad_norm0:.2e} -> {result.grad_norm_end:.2e}",
        fontsize=10,
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_discrete_limit(result: DiscreteLimit, path: str) -> str:
    """Draw ``max |W_h(T) - W(T)|`` against ``h`` (log-log) with a line of slope 1 through the finest point, to
    ``path`` (PNG, PDF, SVG by extension); returns ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.5), constrained_layout=True)
    ax.loglog(result.hs, _positive(result.errors), "o-", color="C0", lw=1.6, label=f"fitted order {result.order:.3f}")
    guide = result.errors[-1] * result.hs / result.hs[-1]
    ax.loglog(result.hs, guide, color="0.5", lw=1.0, ls="--", label="order 1")
    ax.set_xlabel("h (= lr; beta = 1 - a h)")
    ax.set_ylabel("max |W_h(T) - W(T)|")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="lower right", fontsize=9)
    refresh = "no refresh" if result.refresh_period is None else f"refresh every {result.refresh_period:g}"
    bias = "bias-corrected" if result.bias_correction else "no bias correction"
    ax.set_title(
        f"{result.optimizer} -> {result.system.describe()}\nT = {result.t_end:g}, {refresh}, {bias}", fontsize=9
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
