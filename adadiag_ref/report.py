"""``adadiag-ref report``: the main job.

1. Every optimizer on the ill-conditioned matrix least squares
   ``L(W) = 0.5 ||A W B - C||_F^2`` (m x n parameter, where rotations matter),
   on every installed backend: the loss at a few checkpoints and the median wall
   time of one eager ``step``.
2. The shipped golden fixtures verified against the live core.
3. The paper's memory table reproduced from the library's state layout.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import OPTIMIZERS, init, make_config, step
from ._xp import to_numpy

__all__ = ["LeastSquares", "ReportRow", "available_backends", "least_squares_problem", "run_report"]

DEFAULT_LR = {"adam": 3e-2, "adafactor": 3e-2, "hfac": 1e-2}


class LeastSquares(NamedTuple):
    """``L(W) = 0.5 ||A W B - C||_F^2`` with ``grad L = A^T (A W B - C) B^T``."""

    A: np.ndarray
    B: np.ndarray
    C: np.ndarray
    W0: np.ndarray


def least_squares_problem(m: int = 16, n: int = 24, condition: float = 100.0, seed: int = 0) -> LeastSquares:
    """A seeded instance with condition number ``condition`` in both A and B."""
    rng = np.random.default_rng(seed)

    def conditioned(k: int) -> np.ndarray:
        U = np.linalg.qr(rng.standard_normal((k, k)))[0]
        V = np.linalg.qr(rng.standard_normal((k, k)))[0]
        return (U * np.geomspace(1.0, 1.0 / np.sqrt(condition), k)) @ V.T

    A, B = conditioned(m), conditioned(n)
    W_star = rng.standard_normal((m, n))
    return LeastSquares(A, B, A @ W_star @ B, np.zeros((m, n)))


def available_backends() -> dict[str, Any]:
    """Array namespaces that import here (numpy always; torch, jax, cupy if present)."""
    backends: dict[str, Any] = {"numpy": np}
    try:
        from array_api_compat import torch as xp_torch

        importlib.import_module("torch")
        backends["torch"] = xp_torch
    except ImportError:
        pass
    try:
        jax = importlib.import_module("jax")
        jax.config.update("jax_enable_x64", True)
        backends["jax"] = importlib.import_module("jax.numpy")
    except ImportError:
        pass
    try:
        cupy = importlib.import_module("cupy")
        if cupy.cuda.runtime.getDeviceCount() > 0:
            backends["cupy"] = cupy
    except Exception:
        pass
    return backends


class ReportRow(NamedTuple):
    backend: str
    optimizer: str
    losses: tuple[float, ...]
    step_ms: float
    curve: tuple[float, ...] = ()


def _run_one(name: str, problem: LeastSquares, xp: Any, steps: int, checkpoints: Sequence[int]) -> ReportRow:
    cfg = make_config(name, lr=DEFAULT_LR[make_config(name).family], update_freq=20)
    A, B, C = (xp.asarray(a) for a in (problem.A, problem.B, problem.C))
    W = xp.asarray(problem.W0)

    def loss_and_grad(W: Any) -> tuple[float, Any]:
        R = A @ W @ B - C
        return 0.5 * float(xp.sum(R * R)), xp.matrix_transpose(A) @ R @ xp.matrix_transpose(B)

    state = init(W, cfg)
    losses: list[float] = []
    times: list[float] = []
    curve: list[float] = []
    for t in range(1, steps + 1):
        loss, G = loss_and_grad(W)
        curve.append(loss)
        if t in checkpoints:
            losses.append(loss)
        start = time.perf_counter()
        W, state = step(state, G, cfg, W)
        to_numpy(W[:1, :1])  # synchronise asynchronous backends before stopping the clock
        times.append(time.perf_counter() - start)
    return ReportRow("", name, tuple(losses), 1e3 * statistics.median(times), tuple(curve))


def run_report(
    steps: int = 200,
    backends: Sequence[str] | None = None,
    out: Callable[[str], None] = print,
    progress: bool | None = None,
) -> list[ReportRow]:
    """Run all optimizers on every backend and print the loss table."""
    problem = least_squares_problem()
    checkpoints = sorted({1, steps // 10 or 1, steps // 2 or 1, steps})
    available = available_backends()
    chosen = list(available) if backends is None else [b for b in backends if b in available]
    missing = [] if backends is None else [b for b in backends if b not in available]
    if missing:
        out(f"skipping backends that are not installed: {', '.join(missing)}")
    show = sys.stderr.isatty() if progress is None else progress
    rows: list[ReportRow] = []
    total = len(chosen) * len(OPTIMIZERS)
    out(f"problem: 0.5*||A W B - C||^2, W {problem.W0.shape[0]}x{problem.W0.shape[1]}, cond(A)=cond(B)=100, T=20")
    header = f"{'backend':8} {'optimizer':14}" + "".join(f" {'L@' + str(c):>11}" for c in checkpoints) + "   ms/step"
    out(header)
    out("-" * len(header))
    for b in chosen:
        for name in OPTIMIZERS:
            if show:
                print(f"\r[{len(rows) + 1}/{total}] {b} {name}      ", end="", file=sys.stderr, flush=True)
            row = _run_one(name, problem, available[b], steps, checkpoints)._replace(backend=b)
            rows.append(row)
            if show:
                print("\r" + " " * 40 + "\r", end="", file=sys.stderr, flush=True)
            out(f"{b:8} {name:14}" + "".join(f" {v:11.4e}" for v in row.losses) + f"   {row.step_ms:7.3f}")
    return rows


def plot_curves(rows: Sequence[ReportRow], path: str) -> None:
    """Loss against step for every optimizer (first backend), log scale, written to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SystemExit("--plot needs matplotlib: pip install 'adadiag-ref[plot]'") from exc
    backend = rows[0].backend
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for row in rows:
        if row.backend == backend:
            style = "-" if "diag" in row.optimizer else "--"
            ax.semilogy(range(1, len(row.curve) + 1), row.curve, style, label=row.optimizer)
    ax.set_xlabel("step t")
    ax.set_ylabel("L(W_t) = 0.5 ||A W B - C||^2")
    ax.set_title(f"adadiag-ref report ({backend}): rotated (solid) vs baselines (dashed)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def golden_summary(out: Callable[[str], None] = print) -> bool:
    """Verify the shipped golden fixtures against the live core; print one line (and any failure)."""
    from .golden import verify

    results = verify()
    failed = [r for r in results if not r.passed]
    out(f"golden fixtures: {len(results) - len(failed)}/{len(results)} cases match the live core")
    for r in failed:
        out("  " + r.summary())
    return not failed


def memory_summary(out: Callable[[str], None] = print) -> None:
    """The paper's memory table (LLaMA, bf16) from :func:`adadiag_ref.state_nbytes`."""
    from .memory import LLAMA_CONFIGS, PAPER_GB, paper_memory_table

    table = paper_memory_table()
    out(f"optimizer-state memory, bf16, G = {PAPER_GB:.4g} bytes (adadiag-ref memory for details)")
    out(f"{'optimizer':26}" + "".join(f"{m:>12}" for m in LLAMA_CONFIGS))
    for label, row in table.items():
        out(f"{label:26}" + "".join(f"{row[m] / PAPER_GB:11.2f}G" for m in LLAMA_CONFIGS))
