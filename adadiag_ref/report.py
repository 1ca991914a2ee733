"""``adadiag-ref report``: the main job.

1. Every optimizer on the ill-conditioned matrix least squares
   ``L(W) = 0.5 ||A W B - C||_F^2`` (m x n parameter, where rotations matter),
   on every installed backend (NumPy, PyTorch, JAX, ``array_api_strict``, CuPy
   with a GPU): the loss at a few checkpoints, and the time of the backend's
   import, of the first step (first refresh, lazy set-up) and of a later
   step, apart from each other.  After the table every backend's loss curve
   is compared with the first backend's (:func:`compare_backends`): a line
   names each optimizer whose curves differ by more than
   :data:`CROSS_BACKEND_RTOL` and says why (:func:`sensitivity`: rounding
   amplified by the optimizer's own dynamics, or not).
2. The ODE form of every optimizer (``adadiag_ref.ode``): is the Hamiltonian
   ``H`` non-increasing (``dH/dt <= 0``) along the trajectory, and by how much
   did it rise on the worst step.
3. The shipped golden fixtures verified against the live core.
4. The paper's memory table reproduced from the library's state layout.

Long phases show a progress bar (tqdm) on a terminal.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm.auto import tqdm

from . import OPTIMIZERS, init, make_config, refresh_due, step
from ._cli import bar_disable, check_output_file, plot_problem, pyplot
from ._xp import to_numpy
from .memory import LLAMA_CONFIGS, PAPER_GB, paper_memory_table
from .optim.families import family_of

__all__ = [
    "BACKENDS",
    "CROSS_BACKEND_RTOL",
    "PERTURBATION",
    "Backend",
    "Disagreement",
    "LeastSquares",
    "ODERow",
    "ReportRow",
    "Sensitivity",
    "available_backends",
    "check_options",
    "compare_backends",
    "golden_summary",
    "least_squares_problem",
    "load_backends",
    "memory_summary",
    "ode_plot_path",
    "ode_summary",
    "plot_curves",
    "plot_ode",
    "run_report",
    "sensitivity",
]

UPDATE_FREQ = 20
"""Refresh period T of the report's runs: refreshes at t = 1, 21, 41, ..."""
BACKENDS = ("numpy", "torch", "jax", "array_api_strict", "cupy")
CROSS_BACKEND_RTOL = 1e-10
"""Largest relative loss difference ``|L_b(t) - L_ref(t)| / L_ref(t)`` between two backends that the report
accepts silently, at any step.  Measured over the default 200 steps (docs/golden.md, "Cross-backend
sensitivity"): at most 2.1e-13 for seven of the eight optimizers (500x headroom); AdafacDiag++ amplifies
rounding by about 1.1x per step and crosses it near step 110 on every backend, as do the other rotated
optimizers after 250-500 steps; the report then says so (:func:`compare_backends`)."""
PERTURBATION = 1e-15
"""Size of the change of ``W_1`` with which :func:`compare_backends` measures how far NumPy alone drifts
(about 5 ulp of the solution's O(1) entries: a rounding error, not a different problem)."""
AMPLIFICATION_MARGIN = 1e3
"""A backend's deviation counts as amplified rounding while it stays within this factor of the perturbed NumPy
run's drift so far (another library's rounding is not exactly a 1e-15 change of W_1; measured on the report's
problem, the ratio stays at most 57: docs/golden.md)."""
ODE_T_END = 10.0
ODE_REFRESH_PERIOD = 5.0


class LeastSquares(NamedTuple):
    """``L(W) = 0.5 ||A W B - C||_F^2`` with ``grad L = A^T (A W B - C) B^T``."""

    A: np.ndarray
    B: np.ndarray
    C: np.ndarray
    W0: np.ndarray


def least_squares_problem(m: int = 16, n: int = 24, condition: float = 100.0, seed: int = 0) -> LeastSquares:
    """A seeded instance with condition number ``condition`` in both A and B (``C = A W* B``, so ``L* = 0``)."""
    rng = np.random.default_rng(seed)

    def conditioned(k: int) -> np.ndarray:
        U = np.linalg.qr(rng.standard_normal((k, k)))[0]
        V = np.linalg.qr(rng.standard_normal((k, k)))[0]
        return (U * np.geomspace(1.0, 1.0 / np.sqrt(condition), k)) @ V.T

    A, B = conditioned(m), conditioned(n)
    W_star = rng.standard_normal((m, n))
    return LeastSquares(A, B, A @ W_star @ B, np.zeros((m, n)))


class Backend(NamedTuple):
    """An array namespace that imported here, the seconds its import took, and a note for the report."""

    name: str
    xp: Any
    load_s: float
    note: str = ""


def _load(name: str) -> Backend | None:
    start = time.perf_counter()
    note = ""
    try:
        if name == "numpy":
            xp: Any = np
        elif name == "torch":
            importlib.import_module("torch")
            xp = importlib.import_module("array_api_compat.torch")
        elif name == "jax":
            jax = importlib.import_module("jax")
            if not jax.config.read("jax_enable_x64"):
                # JAX computes in float32 unless x64 is on; float64 is the golden mode, so switch it on and say so
                jax.config.update("jax_enable_x64", True)
                note = "jax_enable_x64 switched on for this run (JAX defaults to float32; float64 is the golden mode)"
            xp = importlib.import_module("jax.numpy")
        elif name == "array_api_strict":
            xp = importlib.import_module("array_api_strict")
        elif name == "cupy":
            xp = importlib.import_module("cupy")
            if xp.cuda.runtime.getDeviceCount() == 0:
                return None
        else:
            raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    except ImportError:
        return None
    except Exception:  # cupy without a driver raises its own errors: no GPU, no backend
        if name != "cupy":
            raise
        return None
    return Backend(name, xp, time.perf_counter() - start, note)


def load_backends(names: Sequence[str] | None = None) -> dict[str, Backend]:
    """Import the requested backends (default: all of :data:`BACKENDS`) and time each import."""
    loaded = (_load(name) for name in (BACKENDS if names is None else names))
    return {b.name: b for b in loaded if b is not None}


def available_backends() -> dict[str, Any]:
    """Array namespaces that import here (numpy always; torch, jax, array_api_strict, cupy with a GPU if present)."""
    return {name: b.xp for name, b in load_backends().items()}


class ReportRow(NamedTuple):
    """One optimizer on one backend: losses at the checkpoints, timings (ms) and the loss after every step."""

    backend: str
    optimizer: str
    losses: tuple[float, ...]
    step_ms: float
    """Median over the steps after the first that do not refresh the basis."""
    curve: tuple[float, ...] = ()
    first_ms: float = math.nan
    """The first step: the first refresh (an SVD) and whatever the backend sets up lazily."""
    refresh_ms: float = math.nan
    """Median over the later refresh steps."""
    refresh_steps: tuple[int, ...] = ()


def _ms(value: float, width: int, decimals: int) -> str:
    """A time column; ``-`` where there was nothing to time (e.g. no later refresh step)."""
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:{width}.{decimals}f}"


def _median_ms(times: Sequence[float]) -> float:
    return 1e3 * statistics.median(times) if times else math.nan


def _run_one(
    name: str,
    problem: LeastSquares,
    xp: Any,
    steps: int,
    checkpoints: Sequence[int],
    params: list[np.ndarray] | None = None,
) -> ReportRow:
    """One run of the report; ``params`` (if given) receives ``W_{t+1}`` after every step, as NumPy arrays."""
    cfg = make_config(name, lr=family_of(make_config(name)).report_lr, update_freq=UPDATE_FREQ)
    A, B, C = (xp.asarray(a) for a in (problem.A, problem.B, problem.C))
    W = xp.asarray(problem.W0)

    def loss_and_grad(W: Any) -> tuple[float, Any]:
        R = A @ W @ B - C
        return 0.5 * float(xp.sum(R * R)), xp.matrix_transpose(A) @ R @ xp.matrix_transpose(B)

    state = init(W, cfg)
    losses: list[float] = []
    curve: list[float] = []
    first = 0.0
    plain: list[float] = []
    refresh: list[float] = []
    refreshes: list[int] = []
    for t in range(1, steps + 1):
        loss, G = loss_and_grad(W)
        curve.append(loss)
        if t in checkpoints:
            losses.append(loss)
        refreshing = refresh_due(t - 1, cfg)
        start = time.perf_counter()
        W, state = step(state, G, cfg, W)
        to_numpy(W[:1, :1])  # synchronise asynchronous backends before stopping the clock
        elapsed = time.perf_counter() - start
        if refreshing:
            refreshes.append(t)
        if params is not None:
            params.append(np.array(to_numpy(W), copy=True))
        if t == 1:
            first = elapsed
        else:
            (refresh if refreshing else plain).append(elapsed)
    return ReportRow(
        "", name, tuple(losses), _median_ms(plain), tuple(curve), 1e3 * first, _median_ms(refresh), tuple(refreshes)
    )


def _relative_deviation(curve: Sequence[float], reference: Sequence[float]) -> np.ndarray:
    """``|L(t) - L_ref(t)| / |L_ref(t)|`` per step (the report's loss is positive: ``L* = 0`` is never reached)."""
    ref = np.asarray(reference, dtype=np.float64)
    return np.abs(np.asarray(curve, dtype=np.float64) - ref) / np.maximum(np.abs(ref), np.finfo(np.float64).tiny)


class Sensitivity(NamedTuple):
    """How far a NumPy run drifts from itself when ``W_1`` changes by ``delta`` (:func:`sensitivity`)."""

    optimizer: str
    delta: float
    loss_deviation: tuple[float, ...]
    """``|L'(t) - L(t)| / L(t)`` for ``t = 1..steps`` (``L'``: the perturbed run)."""
    param_deviation: tuple[float, ...]
    """``max |W'_{t+1} - W_{t+1}| / max |W_{t+1}|`` after step ``t = 1..steps``."""

    def first_above(self, tol: float) -> int | None:
        """The first step whose loss deviation exceeds ``tol``; ``None`` if none does."""
        above = np.nonzero(np.asarray(self.loss_deviation) > tol)[0]
        return int(above[0]) + 1 if above.size else None

    def growth_per_step(self, saturation: float = 1e-4) -> float:
        """Finite-time growth factor of the parameter deviation: ``exp`` of the least-squares slope of
        ``log(param_deviation)`` over the steps before it first exceeds ``saturation`` (beyond that the
        perturbation is no longer small and stops growing).  ``> 1``: rounding is amplified; ``< 1``: damped.
        """
        dev = np.asarray(self.param_deviation)
        above = np.nonzero(dev > saturation)[0]
        dev = dev[: above[0] if above.size else dev.size]
        keep = dev > 0
        if keep.sum() < 2:
            return math.nan
        t = np.arange(1, dev.size + 1)[keep]
        return float(np.exp(np.polyfit(t, np.log(dev[keep]), 1)[0]))


def sensitivity(
    name: str, steps: int = 200, delta: float = PERTURBATION, seed: int = 1, problem: LeastSquares | None = None
) -> Sensitivity:
    """Run optimizer ``name`` twice in NumPy on the report's problem, from ``W_1`` and from ``W_1 + delta Z``.

    ``Z`` is a standard normal matrix (``numpy.random.default_rng(seed)``); the solution's entries are standard
    normal draws too, so ``delta`` is relative to the problem's scale.  The same code path as the report's runs
    (same config, loss and gradient).  Whatever separates two backends' results by rounding separates these two
    runs as well: where this drift is as large as a cross-backend difference, the difference is the optimizer's
    own amplification of rounding, not a backend's defect.  Cost: two runs of ``steps`` steps.
    """
    problem = least_squares_problem() if problem is None else problem
    Z = np.random.default_rng(seed).standard_normal(problem.W0.shape)
    base: list[np.ndarray] = []
    moved: list[np.ndarray] = []
    ref = _run_one(name, problem, np, steps, (), base)
    perturbed = _run_one(name, problem._replace(W0=problem.W0 + delta * Z), np, steps, (), moved)
    params = tuple(
        float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), np.finfo(np.float64).tiny))
        for a, b in zip(base, moved, strict=True)
    )
    loss = tuple(float(x) for x in _relative_deviation(perturbed.curve, ref.curve))
    return Sensitivity(name, delta, loss, params)


class Disagreement(NamedTuple):
    """An optimizer whose loss curves differ between backends by more than the tolerance (:func:`compare_backends`)."""

    optimizer: str
    reference: str
    """The backend compared against (the report's first)."""
    deviations: dict[str, float]
    """Largest relative loss difference over the steps, per backend above the tolerance."""
    first_step: int
    """The first step at which any backend exceeds the tolerance."""
    drift: Sensitivity
    """NumPy against NumPy with ``W_1`` changed by :data:`PERTURBATION`."""
    amplified: bool
    """True when the perturbed NumPy run drifts as far: rounding amplified by the optimizer's dynamics."""


def compare_backends(
    rows: Sequence[ReportRow], out: Callable[[str], None] = print, rtol: float = CROSS_BACKEND_RTOL
) -> list[Disagreement]:
    """Compare every backend's loss curve with the first backend's; print each optimizer that differs and why.

    ``rows`` are :func:`run_report`'s (the report's problem).  A backend differs when
    ``|L_b(t) - L_ref(t)| / L_ref(t) > rtol`` at some step.  For each such optimizer the NumPy run is repeated
    with ``W_1`` changed by :data:`PERTURBATION` (:func:`sensitivity`).  The difference is
    called amplified rounding (a property of the optimizer's dynamics on this problem) when that run also
    exceeds ``rtol`` and, at every step where a backend exceeds ``rtol``, the backend's deviation is at most
    :data:`AMPLIFICATION_MARGIN` times the perturbed run's largest drift so far; otherwise the line says the
    difference is not explained by rounding (a defect in a backend or in the core's use of it).  One more line
    says that the other optimizers (or all) agree, with the largest deviation among them.  Nothing is printed
    with a single backend.  Returns the disagreements.
    """
    backends = list(dict.fromkeys(r.backend for r in rows))
    if len(backends) < 2:
        return []
    reference = backends[0]
    curves = {r.optimizer: r.curve for r in rows if r.backend == reference}
    found: list[Disagreement] = []
    largest = (0.0, "", "")
    for name in dict.fromkeys(r.optimizer for r in rows):
        devs = {r.backend: _relative_deviation(r.curve, curves[name]) for r in rows if r.optimizer == name}
        del devs[reference]
        above = {b: d for b, d in devs.items() if d.max() > rtol}
        for b, d in devs.items():
            if b not in above and d.max() >= largest[0]:
                largest = (float(d.max()), name, b)
        if not above:
            continue
        first = min(int(np.nonzero(d > rtol)[0][0]) + 1 for d in above.values())
        drift = sensitivity(name, steps=len(curves[name]))
        envelope = np.maximum.accumulate(np.asarray(drift.loss_deviation))
        amplified = drift.first_above(rtol) is not None and all(
            np.all(d[d > rtol] <= AMPLIFICATION_MARGIN * envelope[d > rtol]) for d in above.values()
        )
        found.append(
            Disagreement(name, reference, {b: float(d.max()) for b, d in above.items()}, first, drift, amplified)
        )
    for dis in found:
        drifted = max(dis.drift.loss_deviation)
        out(
            f"DIFFERS {dis.optimizer}: the loss on {', '.join(dis.deviations)} differs from {dis.reference}'s by up "
            f"to {max(dis.deviations.values()):.1e} (relative; tolerance {rtol:.0e}), first at step {dis.first_step}"
        )
        if dis.amplified:
            out(
                f"  why: this optimizer amplifies rounding on this problem (not a backend defect): NumPy alone, "
                f"with W_1 changed by {dis.drift.delta:.0e}, drifts by up to {drifted:.1e}, above the tolerance "
                f"from step {dis.drift.first_above(rtol)} (docs/golden.md, cross-backend sensitivity)"
            )
        else:
            out(
                f"  why: NOT explained by rounding: NumPy alone, with W_1 changed by {dis.drift.delta:.0e}, drifts "
                f"by at most {drifted:.1e}; a defect in a backend or in the core's use of it"
            )
    if len(found) < len(curves):
        others = "every optimizer's" if not found else "the other optimizers'"
        worst_line = f" (largest {largest[0]:.1e}: {largest[1]} on {largest[2]})" if largest[1] else ""
        out(
            f"backends agree: {others} loss on {', '.join(backends[1:])} within {rtol:.0e} (relative) of "
            f"{reference}'s at every step{worst_line}"
        )
    return found


@contextlib.contextmanager
def _single_torch_thread(backend: str) -> Iterator[None]:
    """torch on one thread while it runs the report's 16 x 24 problem, restored afterwards.

    At this size threads only add overhead, and torch's spinning OpenMP workers next to NumPy's BLAS threads
    made a step 100x slower on a loaded 2-core machine (0.1 ms -> 30 ms).
    """
    if backend != "torch":
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ode_plot_path(plot: str | Path) -> Path:
    """Where ``--plot report.png`` puts the ODE figure: ``report-ode.png`` next to it."""
    path = Path(plot)
    return path.with_name(f"{path.stem}-ode{path.suffix}")


def check_options(steps: int, plot: str | None = None, ode: bool = True, backends: Sequence[str] | None = None) -> None:
    """Check the report's options before any work; raises ``ValueError`` with the reason.

    ``steps`` must be a positive integer; ``plot`` (and the ODE figure next to it)
    needs matplotlib, a file type it writes and an existing, writable folder; of the
    requested ``backends`` at least one must be installed.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {steps!r}")
    if backends and not any(importlib.util.find_spec(b) is not None for b in backends):
        raise ValueError(f"none of the requested backends is installed: {', '.join(backends)}")
    if plot is None:
        return
    problem = plot_problem(plot)
    if problem:
        raise ValueError(f"--plot {plot}: {problem}")
    for target in [plot, *([str(ode_plot_path(plot))] if ode else [])]:
        check_output_file(target, "--plot")


def run_report(
    steps: int = 200,
    backends: Sequence[str] | None = None,
    out: Callable[[str], None] = print,
    progress: bool | None = None,
) -> list[ReportRow]:
    """Run all optimizers on every backend and print the loss and timing table.

    ``progress``: a progress bar on stderr (``None``: only on a terminal).
    """
    check_options(steps)
    problem = least_squares_problem()
    checkpoints = sorted({1, steps // 10 or 1, steps // 2 or 1, steps})
    loaded = load_backends(backends)
    missing = [] if backends is None else [b for b in backends if b not in loaded]
    if missing:
        out(f"skipping backends that are not installed: {', '.join(missing)}")
    out(
        f"problem: 0.5*||A W B - C||^2, W {problem.W0.shape[0]}x{problem.W0.shape[1]}, cond(A)=cond(B)=100, "
        f"float64, T={UPDATE_FREQ} (refreshes at t = 1, {1 + UPDATE_FREQ}, {1 + 2 * UPDATE_FREQ}, ...)"
    )
    out("backends (import time): " + ", ".join(f"{b.name} {b.load_s:.2f} s" for b in loaded.values()))
    out(
        "times: 'first ms' = step 1 (the first SVD, lazy set-up, JIT compilation); 'ms/step' = median of the later "
        "steps without a refresh; 'ms/refresh' = median of the later refresh steps"
    )
    for b in loaded.values():
        if b.note:
            out(f"note: {b.note}")
    if "torch" in loaded:
        out("note: torch runs on one thread here (a 16 x 24 problem: threads only add overhead)")
    header = (
        f"{'backend':16} {'optimizer':14}"
        + "".join(f" {'L@' + str(c):>11}" for c in checkpoints)
        + f" {'first ms':>9} {'ms/step':>8} {'ms/refresh':>10}"
    )
    out(header)
    out("-" * len(header))
    rows: list[ReportRow] = []
    with tqdm(
        total=len(loaded) * len(OPTIMIZERS), desc="optimizers x backends", unit="run", disable=bar_disable(progress)
    ) as bar:
        for b in loaded.values():
            for name in OPTIMIZERS:
                bar.set_postfix_str(f"{b.name} {name}")
                with _single_torch_thread(b.name):
                    row = _run_one(name, problem, b.xp, steps, checkpoints)._replace(backend=b.name)
                rows.append(row)
                bar.update()
                with tqdm.external_write_mode():
                    out(
                        f"{b.name:16} {name:14}"
                        + "".join(f" {v:11.4e}" for v in row.losses)
                        + f" {_ms(row.first_ms, 9, 2)} {_ms(row.step_ms, 8, 3)} {_ms(row.refresh_ms, 10, 3)}"
                    )
    compare_backends(rows, out)
    return rows


_BACKEND_STYLE = {"numpy": "-", "torch": "--", "jax": ":", "array_api_strict": "-.", "cupy": (0, (5, 1, 1, 1))}


def plot_curves(rows: Sequence[ReportRow], path: str | Path) -> None:
    """One figure for every backend: the loss curves (left) and each backend's deviation from NumPy (right).

    Colour = optimizer, line style = backend; the refresh steps are dotted vertical lines.
    """
    plt = pyplot()
    fig, (ax, ax_dev) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    names = list(dict.fromkeys(r.optimizer for r in rows))
    colour = {name: f"C{i}" for i, name in enumerate(names)}
    reference = {r.optimizer: np.asarray(r.curve) for r in rows if r.backend == rows[0].backend}
    for row in rows:
        curve = np.asarray(row.curve)
        ts = np.arange(1, curve.size + 1)
        label = row.optimizer if row.backend == rows[0].backend else None
        ax.semilogy(ts, curve, ls=_BACKEND_STYLE.get(row.backend, "-"), color=colour[row.optimizer], label=label)
        if row.backend != rows[0].backend:
            dev = np.abs(curve - reference[row.optimizer]) / np.abs(reference[row.optimizer])
            dev[dev == 0] = np.nan  # exact agreement: no point on a log axis
            ax_dev.semilogy(ts, dev, ls=_BACKEND_STYLE.get(row.backend, "-"), color=colour[row.optimizer])
    refreshes = max((r.refresh_steps for r in rows), key=len, default=())
    for k, t in enumerate(refreshes):
        for a in (ax, ax_dev):
            a.axvline(t, color="0.5", lw=0.8, ls=":", label="basis refresh" if k == 0 and a is ax else None)
    for b in dict.fromkeys(r.backend for r in rows):  # legend entries for the line styles
        ax.plot([], [], color="k", ls=_BACKEND_STYLE.get(b, "-"), label=f"backend: {b}")
    ax.set_xlabel("step t")
    ax.set_ylabel("L(W_t) = 0.5 ||A W B - C||^2")
    ax.set_title("loss, every optimizer on every backend")
    ax.legend(ncol=2, fontsize=7)
    ax_dev.set_xlabel("step t")
    ax_dev.set_ylabel(f"|L_backend - L_{rows[0].backend}| / L_{rows[0].backend}")
    ax_dev.set_title(f"deviation from {rows[0].backend} (gaps: identical)")
    for a in (ax, ax_dev):
        a.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class ODERow(NamedTuple):
    """One optimizer's ODE check (:func:`adadiag_ref.ode.check`) on the ODE test problem."""

    optimizer: str
    result: Any  # adadiag_ref.ode.CheckResult


def ode_summary(
    out: Callable[[str], None] = print,
    progress: bool | None = None,
    t_end: float = ODE_T_END,
    refresh_period: float = ODE_REFRESH_PERIOD,
) -> list[ODERow]:
    """Integrate every optimizer's ODE (DOPRI5) and report whether ``H`` is non-increasing.

    ``max step increase`` is ``max_k H(t_{k+1}) - H(t_k)`` over the accepted steps (0: monotone);
    ``max dH/dt`` is the largest closed-form rate at step ends and midpoints (``<= 0``: the claim holds
    on this trajectory).  Rotated systems refresh their basis every ``refresh_period``.  An optimizer whose
    family was registered without a continuous-time form gets a line saying so and no row.
    """
    from . import ode

    problem = ode.make_problem("least_squares")
    out(
        f"ODE (Hamiltonian descent): {problem.description or problem.name}, dopri5 (rtol 1e-8), t in [0, {t_end:g}], "
        f"basis refreshed every {refresh_period:g}; H must be non-increasing (dH/dt <= 0)"
    )
    header = (
        f"{'optimizer':14} {'verdict':13} {'H(0)':>10} {'H(T)':>10} {'max step rise':>13} {'max dH/dt':>10} "
        f"{'steps':>6} {'dH/dt<=0':>8}"
    )
    out(header)
    out("-" * len(header))
    rows: list[ODERow] = []
    with tqdm(OPTIMIZERS, desc="ODE checks", unit="system", disable=bar_disable(progress)) as bar:
        for name in bar:
            bar.set_postfix_str(name)
            skipped = ode.no_system_reason(name)
            if skipped is not None:
                with tqdm.external_write_mode():
                    out(f"{name:14} skipped: {skipped}")
                continue
            r = ode.check(ode.make_system(name), problem, "dopri5", t_end=t_end, refresh_period=refresh_period)
            rows.append(ODERow(name, r))
            with tqdm.external_write_mode():
                out(
                    f"{name:14} {r.verdict:13} {r.h0:10.4g} {r.h_end:10.4g} {r.max_h_increase:13.3g} "
                    f"{r.max_dhdt:10.3g} {r.n_steps:6d} {'yes' if r.max_dhdt <= 0 else 'NO':>8}"
                )
    return rows


def plot_ode(rows: Sequence[ODERow], path: str | Path) -> None:
    """``H(t) - L*`` of every optimizer's ODE on one log axis, steps where ``H`` rose in red, refreshes dotted."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    rose = False
    for i, row in enumerate(rows):
        tr = row.result.trajectory
        if tr is None:
            continue
        shifted = np.asarray(tr.H) - (row.result.optimal_value or 0.0)
        shifted[shifted <= 0] = np.nan
        ax.semilogy(tr.t, shifted, color=f"C{i}", label=f"{row.optimizer}: {row.result.verdict}")
        up = np.nonzero(np.diff(tr.H) > 0)[0] + 1
        if up.size:
            ax.semilogy(tr.t[up], shifted[up], "o", ms=3, color="red", label=None if rose else "H rose on this step")
            rose = True
    refresh_times = [
        t for row in rows if row.result.trajectory is not None for t in row.result.trajectory.refresh_times
    ]
    for k, t in enumerate(sorted(set(refresh_times))):
        ax.axvline(t, color="0.5", lw=0.8, ls=":", label="basis refresh" if k == 0 else None)
    ax.set_xlabel("ODE time t")
    ax.set_ylabel("H(t) - L*")
    ax.set_title("Hamiltonian along each optimizer's ODE (non-increasing = the paper's claim)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def golden_summary(out: Callable[[str], None] = print, progress: bool | None = None) -> bool:
    """Verify the shipped golden fixtures against the live core; print one line (and any failure)."""
    from .golden import load_cases
    from .golden.verify import verify_case

    cases = load_cases()
    results = [verify_case(c) for c in tqdm(cases, desc="golden fixtures", unit="case", disable=bar_disable(progress))]
    failed = [r for r in results if not r.passed]
    out(f"golden fixtures: {len(results) - len(failed)}/{len(results)} cases match the live core")
    for r in failed:
        out("  " + r.summary())
    return not failed


def memory_summary(out: Callable[[str], None] = print) -> None:
    """The paper's memory table (LLaMA, bf16) from :func:`adadiag_ref.state_nbytes`."""
    table = paper_memory_table()
    out(f"optimizer-state memory, bf16, G = {PAPER_GB:.4g} bytes (adadiag-ref memory for details)")
    out(f"{'optimizer':26}" + "".join(f"{m:>12}" for m in LLAMA_CONFIGS))
    for label, row in table.items():
        out(f"{label:26}" + "".join(f"{row[m] / PAPER_GB:11.2f}G" for m in LLAMA_CONFIGS))
