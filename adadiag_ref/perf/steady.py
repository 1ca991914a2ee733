"""Steady-state (non-refresh) step targets: ``adadiag-ref bench --steady``.

Measures, in one process and against the roofline measured right before each
row (float32 GEMM peak at the model's work shapes, in-place triad bandwidth;
:class:`~adadiag_ref.perf.bench.Roofline`), the ratios of what a user runs for speed, each a median over rounds:

==============================================  ================================================  ======
ratio                                           bound                                             target
==============================================  ================================================  ======
``ar.Engine`` AdaDiag step (what a NumPy loop    ``4 m^2 n`` flops / peak + 9 (rotated) or 7       <= 1.15
runs, :class:`~.bench.EngineSteps`)             (unrotated) arrays per element / bandwidth
``ar.Engine`` AdamW step (every param)          7 arrays per element / bandwidth                  <= 3
torch adapter ``opt.step``                      AdaDiag written directly in torch ops (not a      <= 1.1
                                                bound: both called in alternation, a ratio per
                                                round, the median)
==============================================  ================================================  ======

The reference (``ar.update``, ``ar.step``, ``ar.replay``) tries no route: it is the paper's arithmetic in
array-API code, and its speed is not a target (``adadiag-ref bench`` prints it beside the engine's rows).  The
engine rows keep their engines, parameters and gradients across rounds and are warmed up first (a steady state,
as a training loop sees it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from threadpoolctl import threadpool_limits

from ..memory import LLAMA_CONFIGS, llama_parameters
from . import bench
from .allocator import free_page_reporting, freed_memory_retained
from .params import adadiag_bytes, adadiag_flops, adamw_bytes, is_rotated

__all__ = ["TARGETS", "run"]

#: (key, label, target) of every ratio printed by :func:`run`, in order.
TARGETS: tuple[tuple[str, str, float], ...] = (
    ("engine_step", "ar.Engine AdaDiag step / GEMM + bytes bound", 1.15),
    ("adamw_engine", "ar.Engine AdamW step / bandwidth bound", 3.0),
    ("torch_adapter", "torch adapter / AdaDiag in torch ops", 1.1),
)

#: Seconds of sleep before each timed row (:func:`_after_pause`).
PAUSE = 0.3


def _measure(roofline: bench.Roofline, seen: list[tuple[float, float]]) -> tuple[float, float]:
    """``(bandwidth, GEMM peak)`` measured now, also appended to ``seen``."""
    seen.append(roofline.measure())
    return seen[-1]


def _after_pause(fn: Callable[[], Any]) -> Any:
    """``fn()`` after a short sleep: OpenBLAS's threads spin for a while after a GEMM, and on a machine with few
    cores they would take the cores that the next row's numba passes need."""
    time.sleep(PAUSE)
    return fn()


def run(
    model: str = "llama-60m",
    *,
    quick: bool = False,
    reps: int = 5,
    use_torch: bool = True,
    rule: str = "paper",
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure the steady-state ratios (module docstring) and print them with their targets; returns them."""
    ncpu = bench._setup_threads()
    with threadpool_limits(limits=ncpu, user_api="blas"):  # BLAS on every core for the run, restored after it
        threads = bench.blas_threads()
        config = bench.QUICK if quick else LLAMA_CONFIGS[model]
        specs = llama_parameters(config)
        use_torch = use_torch and bench._torch_threads(ncpu)
        rotated = [s for s in specs if is_rotated(s, rule)]
        work = [ws for _, ws in bench._work_specs(rotated)]
        out(f"adadiag-ref bench --steady: {'quick (tiny shapes)' if quick else model}, rule {rule!r}, float32")
        out(f"machine: {bench.machine_description()}; OpenBLAS threads {threads if threads is not None else '?'}")
        reported_before = free_page_reporting()
        out("allocator: " + ("glibc keeps freed memory (--retain-freed-memory)" if freed_memory_retained()
                             else "the C library's defaults (fresh pages for large outputs)"))  # fmt: skip
        eng = bench.EngineSteps("adadiag", specs, rule)
        adamw = bench.EngineSteps("adamw", specs, rule)
        # every round runs each row once and divides it by the roofline measured right before it (the VM's bandwidth
        # drifts within seconds): a ratio per row and round, the median over rounds
        rounds: dict[str, list[float]] = {}
        times: dict[str, list[float]] = {}
        roofline = bench.Roofline((1 << 22) if quick else (1 << 25), work, 3)
        for r in range(reps):
            row: dict[str, float] = {}
            bounds: dict[str, float] = {}
            seen: list[tuple[float, float]] = []  # this round's rooflines, for its summary line
            bw, peak = _measure(roofline, seen)
            row["engine_step"] = bench.median_time(eng, 3, warmup=1)
            # the GEMMs at the peak + the elementwise bytes
            bounds["engine_step"] = adadiag_flops(specs, rule) / peak + adadiag_bytes(specs, rule) / bw
            bw, peak = _measure(roofline, seen)
            row["adamw_engine"] = _after_pause(lambda: bench.median_time(adamw, 3, warmup=1))
            bounds["adamw_engine"] = adamw_bytes(specs) / bw
            for key, t in row.items():
                times.setdefault(key, []).append(t)
                rounds.setdefault(key, []).append(t / bounds[key])
            bws, peaks = [b for b, _ in seen], [p for _, p in seen]
            out(f"  round {r + 1}/{reps}: triad {min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f} GB/s, GEMM peak "
                f"{min(peaks) / 1e9:.1f}-{max(peaks) / 1e9:.1f} GFLOP/s (measured before each row)")  # fmt: skip
        eng.close()
        adamw.close()
        med = {key: statistics.median(v) for key, v in times.items()}
        ratios = {key: statistics.median(v) for key, v in rounds.items()}
        if use_torch:
            # adapter and direct torch in alternation, a ratio per round, the median (bench.torch_adapter_ratio)
            pair = bench.torch_adapter_ratio(specs, max(3, reps), rule, pause=0.01 if quick else 0.3)
            med["torch_adapter"] = pair["adapter"]
            ratios["torch_adapter"] = pair["ratio"]
            rounds["torch_adapter"] = pair["ratios"]
        res: dict[str, Any] = {"times": med, "ratios": ratios, "rounds": rounds}
        reported_after = free_page_reporting()
        if reported_before is not None and reported_after is not None:
            res["reported_mib"] = (reported_after - reported_before) / 1024
            out(f"free memory the kernel reported to its hypervisor during the run: {res['reported_mib']:.0f} MiB "
                "(re-touching it faults; see adadiag_ref.perf.allocator)")  # fmt: skip

        out("")
        # the spread beside the median: on a shared machine a target within it is within the noise of the run
        out(f"{'steady-state ratio (median over rounds)':48s} {'median ms':>10s} {'ratio':>6s} {'rounds min-max':>15s} "
            f"{'target':>7s}")  # fmt: skip
        for key, label, target in TARGETS:
            if key not in ratios:
                continue
            mark = "ok" if ratios[key] <= target else "over"
            spread = f"{min(rounds[key]):.2f}-{max(rounds[key]):.2f}"
            out(f"{label:48s} {med[key] * 1e3:10.1f} {ratios[key]:6.2f} {spread:>15s} {target:6.2f}  {mark}")
        return res
