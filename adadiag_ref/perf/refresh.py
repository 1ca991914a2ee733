"""``adadiag-ref bench --refresh-routes`` / ``--refresh-scaling``: the basis refresh, route by route.

The refresh of a one-sided optimizer computes ``P_t`` from ``G_t`` (``m x n``
work frame, ``m <= n``) every ``T`` steps.  Its share of the optimizer's time,
amortised over ``T``, is ``(t_refresh / T) / (t_step + t_refresh / T)``.

``run_routes`` measures, in one run and for the rotated matrices of a LLaMA
parameter set (float32), the library's routes (``basis_method`` = ``svd``,
``gram``, ``auto``) and the candidates that were evaluated for them, each
finished by the same canonicalisation (:func:`~adadiag_ref.linalg.canonicalize_svd`),
so every route yields the same canonical basis up to its own rounding:

* ``svd+fast-canon``: NumPy's SVD, canonicalised with the fast routes' Gram-Schmidt;
* ``scipy-gesdd`` / ``scipy-gesvd``: the LAPACK driver choice (divide and conquer / QR iteration);
* ``qr+small-svd``: ``G^T = Q R``, then the SVD of the small ``m x m`` factor ``R^T``;
* ``gram-f32-eigh``: the Gram matrix accumulated in float64, its ``eigh`` in float32;
* ``gram-scipy-evr``: the float64 ``eigh`` with scipy's MRRR driver;
* ``warm-start``: one subspace iteration ``A P_{t-T}`` from the previous basis, then
  Rayleigh-Ritz (``eigh(Q^T A Q)``), with ``A = G G^T``.

Each route is timed on one matrix of every distinct shape (median of ``reps``,
routes in alternation so that a drifting machine biases none of them) and the
model's total is ``sum over shapes of count x time``.  The accuracy columns
compare each route's basis with the ``svd`` route's on the leading half of the
spectrum (``tests/test_fast_refresh.py`` states the bound, 1e-3).  The worst
step's latency is the step plus every refresh when all matrices refresh on the
same step (the library's schedule), and the step plus the slowest single matrix
when the refreshes are staggered over the ``T`` steps (one matrix per step; the
mean is the same).

``run_scaling`` times ``svd`` and ``gram`` on square ``n x n`` matrices for
growing ``n``, fits ``t ~ c n^p`` on a log-log scale and saves a plot.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import scipy.linalg
from threadpoolctl import threadpool_limits

from .._cli import pyplot
from ..linalg import canonical_svd, canonicalize_svd
from ..memory import LLAMA_CONFIGS, llama_parameters
from .bench import (
    QUICK,
    EngineSteps,
    _setup_threads,
    blas_threads,
    gradient_with_spectrum,
    interleaved_medians,
    median_time,
)
from .params import is_rotated, work_shape

__all__ = ["CANDIDATES", "leading_half_disagreement", "run_routes", "run_scaling"]

Route = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _canonical(U: np.ndarray, S: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """``P`` from any left singular vectors and values, by the canonical rules (the fast routes' Gram-Schmidt)."""
    P = canonicalize_svd(U, S, None, shape, compute_q=False, fast=True).P
    assert P is not None
    return np.asarray(P)


def _from_eigh(lam: np.ndarray, vecs: np.ndarray, G: np.ndarray) -> np.ndarray:
    """``P`` from an ascending eigendecomposition of ``G G^T`` (reversed: descending singular values)."""
    S = np.sqrt(np.clip(lam[::-1], 0.0, None)).astype(G.dtype)
    return _canonical(np.ascontiguousarray(vecs[:, ::-1]).astype(G.dtype), S, G.shape)  # type: ignore[arg-type]


def _library(method: str) -> Route:
    def route(G: np.ndarray, previous: np.ndarray) -> np.ndarray:
        return np.asarray(canonical_svd(G, compute_q=False, method=method).P)

    return route


def _numpy_svd_fast_canon(G: np.ndarray, previous: np.ndarray) -> np.ndarray:
    U, S, _ = np.linalg.svd(G, full_matrices=False)
    return _canonical(U, S, G.shape)  # type: ignore[arg-type]


def _scipy_svd(driver: str) -> Route:
    def route(G: np.ndarray, previous: np.ndarray) -> np.ndarray:
        U, S, _ = scipy.linalg.svd(G, full_matrices=False, lapack_driver=driver, check_finite=False)
        return _canonical(U, S, G.shape)  # type: ignore[arg-type]

    return route


def _qr_small_svd(G: np.ndarray, previous: np.ndarray) -> np.ndarray:
    R: np.ndarray = np.linalg.qr(G.T, mode="r")  # type: ignore[assignment]  # G = R^T Q^T: the left singular vectors of G are those of R^T
    U, S, _ = np.linalg.svd(R.T)
    return _canonical(U, S, G.shape)  # type: ignore[arg-type]


def _gram64(G: np.ndarray) -> np.ndarray:
    G64 = G.astype(np.float64)
    return G64 @ G64.T


def _gram_f32_eigh(G: np.ndarray, previous: np.ndarray) -> np.ndarray:
    lam, vecs = np.linalg.eigh(_gram64(G).astype(np.float32))
    return _from_eigh(lam.astype(np.float64), vecs, G)


def _gram_scipy_evr(G: np.ndarray, previous: np.ndarray) -> np.ndarray:
    lam, vecs = scipy.linalg.eigh(_gram64(G), driver="evr", check_finite=False)
    return _from_eigh(lam, vecs, G)


def _warm_start(G: np.ndarray, previous: np.ndarray) -> np.ndarray:
    A = _gram64(G)
    Q, _ = np.linalg.qr(A @ previous.astype(np.float64))  # one subspace iteration from the previous basis
    lam, Z = np.linalg.eigh(Q.T @ A @ Q)  # Rayleigh-Ritz on span(Q)
    return _from_eigh(lam, Q @ Z, G)


CANDIDATES: dict[str, Route] = {
    "svd": _library("svd"),
    "gram": _library("gram"),
    "auto": _library("auto"),
    "svd+fast-canon": _numpy_svd_fast_canon,
    "scipy-gesdd": _scipy_svd("gesdd"),
    "scipy-gesvd": _scipy_svd("gesvd"),
    "qr+small-svd": _qr_small_svd,
    "gram-f32-eigh": _gram_f32_eigh,
    "gram-scipy-evr": _gram_scipy_evr,
    "warm-start": _warm_start,
}
"""Every evaluated route: ``route(G, P_previous) -> P`` (canonical, ``G``'s dtype)."""


def _threads(threads: int | None) -> int | None:
    """The thread policy of ``adadiag-ref bench`` (BLAS and numba on every core), or ``threads`` of each."""
    ncpu = _setup_threads()
    if threads is not None:
        import numba

        numba.set_num_threads(min(threads, int(getattr(numba.config, "NUMBA_NUM_THREADS", threads))))
    threadpool_limits(limits=threads or ncpu, user_api="blas")  # for the rest of this (command-line) process
    return blas_threads()


def leading_half_disagreement(P: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """``(column, subspace)`` disagreement of two canonical bases on the leading half ``h = m // 2``.

    column: ``max |P[:, :h] - ref[:, :h]|``; subspace: ``||ref[:, :h]^T P[:, h:]||_2``, the
    sine of the largest principal angle between the two leading-half spans.
    """
    h = P.shape[0] // 2
    P64, ref64 = P.astype(np.float64), ref.astype(np.float64)
    column = float(np.max(np.abs(P64[:, :h] - ref64[:, :h])))
    subspace = float(np.linalg.norm(ref64[:, :h].T @ P64[:, h:], 2))
    return column, subspace


def _previous_basis(G: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The basis ``T`` steps earlier, modelled as that of ``G`` plus a 10 % perturbation (warm-start input)."""
    noisy = G + 0.1 * float(np.linalg.norm(G)) / math.sqrt(G.size) * rng.standard_normal(G.shape, dtype=np.float32)
    return np.asarray(canonical_svd(noisy, compute_q=False, method="gram").P)


def run_routes(
    model: str = "llama-60m",
    *,
    quick: bool = False,
    reps: int = 5,
    period: int = 200,
    routes: tuple[str, ...] = tuple(CANDIDATES),
    threads: int | None = None,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every route on the model's rotated matrices (one run); print and return the table."""
    threads = _threads(threads)
    config = QUICK if quick else LLAMA_CONFIGS[model]
    specs = llama_parameters(config)
    rotated = [s for s in specs if is_rotated(s, "paper")]
    shapes = Counter(work_shape(s.shape) for s in rotated)
    engine = EngineSteps("adadiag", specs, "paper")  # ar.Engine, the step a user's NumPy loop takes
    step_before = median_time(engine, max(reps, 3), warmup=2)
    out(f"refresh routes: {'quick (tiny shapes)' if quick else model}, {len(rotated)} rotated matrices "
        f"({', '.join(f'{c} x {m}x{n}' for (m, n), c in sorted(shapes.items()))}), float32, T = {period}")  # fmt: skip
    out(f"AdaDiag engine step (median of {max(reps, 3)}): {step_before * 1e3:.1f} ms; OpenBLAS threads: {threads}")
    res: dict[str, Any] = {"period": period, "shapes": dict(shapes)}
    step = step_before
    for spectrum in ("decaying", "flat"):
        rng = np.random.default_rng(5)
        mats = {shape: gradient_with_spectrum(shape, spectrum, rng) for shape in shapes}
        previous = {shape: _previous_basis(G, rng) for shape, G in mats.items()}
        reference = {shape: CANDIDATES["svd"](G, previous[shape]) for shape, G in mats.items()}
        per_shape: dict[tuple[int, int], dict[str, float]] = {}
        for shape, G in mats.items():
            fns: dict[str, Callable[[], Any]] = {name: partial(CANDIDATES[name], G, previous[shape]) for name in routes}
            per_shape[shape] = interleaved_medians(fns, reps, warmup=1, pause=0.0)
        title = "sigma_i ~ 1/i" if spectrum == "decaying" else "Gaussian"
        step_after = median_time(engine, max(reps, 3), warmup=1)  # the machine drifts: step beside routes
        step = statistics.median([step_before, step_after])  # measured just before and just after the routes
        step_before = step_after
        out("")
        out(f"{spectrum} spectrum ({title}); AdaDiag engine step beside it: {step * 1e3:.1f} ms")
        out(f"{'route':16s} {'total s':>8s} {'amortised':>9s} {'vs svd':>7s} {'worst step, all':>16s} "
            f"{'staggered':>10s} {'column dP':>10s} {'subspace':>9s}")  # fmt: skip
        for name in routes:
            total = sum(count * per_shape[shape][name] for shape, count in shapes.items())
            slowest = max(per_shape[shape][name] for shape in shapes)
            pct = (total / period) / (step + total / period)
            errors = [
                leading_half_disagreement(CANDIDATES[name](G, previous[s]), reference[s]) for s, G in mats.items()
            ]
            column, subspace = max(e[0] for e in errors), max(e[1] for e in errors)
            svd_total = sum(c * per_shape[shape].get("svd", 0.0) for shape, c in shapes.items())
            ratio = f"{total / svd_total:7.2f}" if svd_total else "      -"
            out(f"{name:16s} {total:8.3f} {pct:9.2%} {ratio} {(step + total) * 1e3:13.0f} ms "
                f"{(step + slowest) * 1e3:7.0f} ms {column:10.1e} {subspace:9.1e}")  # fmt: skip
            res[f"{spectrum}_step"] = step
            res[f"{spectrum}_{name}"] = {
                "total_s": total,
                "amortised": pct,
                "per_shape_s": {f"{m}x{n}": per_shape[(m, n)][name] for m, n in shapes},
                "worst_step_s": step + total,
                "worst_step_staggered_s": step + slowest,
                "column": column,
                "subspace": subspace,
            }
    engine.close()
    return res


def run_scaling(
    sides: tuple[int, ...] = (256, 512, 1024, 2048),
    *,
    reps: int = 3,
    budget_s: float = 60.0,
    plot: str | Path | None = None,
    threads: int | None = None,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Refresh time of ``svd`` and ``gram`` on square float32 ``n x n`` gradients against ``n``.

    A (route, spectrum) series stops growing once one call took longer than
    ``budget_s / reps`` (the machine's patience, not a property of the route).
    Fits ``log t = p log n + c`` over the largest three sides of each series.
    """
    series: dict[str, list[tuple[int, float]]] = {}
    threads = _threads(threads)
    rng = np.random.default_rng(6)
    out(
        f"refresh scaling: square float32 gradients, sides {', '.join(map(str, sides))}, median of {reps}, "
        f"OpenBLAS threads: {threads}"
    )
    out(f"{'series':24s} " + " ".join(f"{n:>8d}" for n in sides) + "   fitted p")
    result: dict[str, Any] = {}
    for spectrum in ("flat", "decaying"):
        for method in ("svd", "gram"):
            key = f"{method}, {'Gaussian' if spectrum == 'flat' else '1/i'}"
            points: list[tuple[int, float]] = []
            for n in sides:
                G = gradient_with_spectrum((n, n), spectrum, rng)
                t0 = time.perf_counter()
                canonical_svd(G, compute_q=False, method=method)
                first = time.perf_counter() - t0
                if first > budget_s:
                    break
                runs = max(1, min(reps, int(budget_s / max(first, 1e-9))))
                t = min(first, median_time(partial(_library(method), G, G), runs, 0))
                points.append((n, t))
                if t * reps > budget_s:
                    break
            series[key] = points
            p = _fitted_exponent(points[-3:])
            cells = dict(points)
            row = " ".join(f"{cells[n]:8.3f}" if n in cells else f"{'-':>8s}" for n in sides)
            out(f"{key:24s} {row}   {p:5.2f}")
            result[key] = {"points": points, "exponent": p}
    out("theory: p = 3 for both (SVD ~ 4n^3 + canonicalisation; Gram: n^2 m product + eigh ~ 4/3 n^3")
    out("        + canonicalisation);")
    out("        the 1/i canonicalisation adds the pivoted Gram-Schmidt of its trailing cluster, also ~ n^3")
    if plot is not None:
        _plot(result, Path(plot))
        out(f"plot: {plot}")
    return result


def _fitted_exponent(points: list[tuple[int, float]]) -> float:
    """Slope ``p`` of ``log t = p log n + c`` (least squares); NaN with fewer than two points."""
    if len(points) < 2:
        return float("nan")
    return float(np.polyfit(np.log([n for n, _ in points]), np.log([t for _, t in points]), 1)[0])


def _plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for key, entry in result.items():
        pts = entry["points"]
        if not pts:
            continue
        ax.loglog([n for n, _ in pts], [t for _, t in pts], "o-", label=f"{key} (p = {entry['exponent']:.2f})")
    anchor = max((pts[-1] for entry in result.values() if (pts := entry["points"])), default=(512, 0.05))
    ns = np.array([64, 4096], dtype=float)
    ax.loglog(ns, anchor[1] * (ns / anchor[0]) ** 3, "k:", label="n^3 (theory, both routes)")
    ax.set_xlabel("matrix side n (n x n, float32)")
    ax.set_ylabel("one refresh (s)")
    ax.set_title("Basis refresh time against the matrix side")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
