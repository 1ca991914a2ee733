"""``adadiag-ref bench``: step times against a roofline measured in the same run, and against PyTorch.

For the parameter set of a LLaMA model (attention q/k/v/o, MLP gate/up/down,
norms, embedding and head) it measures, all in one process:

* the roofline: float32 GEMM throughput at the model's shapes (the peak is the
  best shape) and memory bandwidth (a two-thread STREAM triad ``a = b + s c``);
* each optimizer's non-refresh step, as a median, and its ratio to its lower
  bound ``GEMM flops / peak + elementwise bytes / bandwidth``, for what a user
  runs: ``ar.Engine`` (:class:`EngineSteps`), the functional core ``ar.update``, the in-place
  core ``ar.update_in_place``, torch.optim.AdamW (foreach and fused) and the
  torch adapter when torch is installed;
* one basis refresh of every rotated matrix (SVD, ``auto`` and Gram routes) on
  gradients with a decaying spectrum (``sigma_i ~ 1/i``) and on Gaussian ones
  (flat spectrum, the worst case), amortised over T steps as a percentage of
  the average step.

Parameter rule (``rule="paper"``, the default): as in the paper's memory table
(``adadiag_ref.memory``), AdaDiag rotates only the transformer blocks' matrices
(attention q/k/v/o, MLP gate/up/down); embedding, LM head and norms take the
unrotated baseline (AdamW's elementwise update).  ``rule="all"`` rotates every
matrix.

BLAS threads are set through threadpoolctl for the run and restored after it.
Development variants (an unfused NumPy AdamW, AdaDiag written directly in torch
ops) live in ``benchmarks/bench_variants.py`` of the source tree.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

import adadiag_ref as ar

from .._cli import cpu_name
from ..memory import LLAMA_CONFIGS, ParamSpec, llama_parameters
from .params import (
    BETAS,
    EPS,
    LR,
    QUICK,
    adadiag_bytes,
    adadiag_flops,
    adamw_bytes,
    gradient_with_spectrum,
    is_rotated,
    torch_direct_adadiag,
    torch_params,
    work_shape,
)


def _setup_threads() -> int:
    """Thread policy (docs/performance.md): numba's pool uses the non-spinning workqueue layer."""
    import numba

    config: Any = numba.config
    if config.THREADING_LAYER in ("default", ""):
        config.THREADING_LAYER = "workqueue"
    return os.cpu_count() or 1


def blas_threads() -> int | None:
    """Threads of the BLAS libraries loaded in this process (threadpoolctl); None when none is loaded."""
    counts = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    return max(counts) if counts else None


def import_torch_adapter() -> Any:
    """``adadiag_ref.adapters.pytorch``, also from a source checkout.

    ``adapters/`` is installed as ``adadiag_ref.adapters`` (``package-dir`` in
    pyproject.toml); an older editable install, or running from the repository
    root (where ``./adadiag_ref`` shadows the installed mapping), leaves that
    name unresolved.  Then the package is registered from the ``adapters/``
    folder next to ``adadiag_ref`` (the same idea as ``tests/_adapter_import.py``).
    """
    try:
        return importlib.import_module("adadiag_ref.adapters.pytorch")
    except ModuleNotFoundError as exc:
        if exc.name not in ("adadiag_ref.adapters", "adadiag_ref.adapters.pytorch"):
            raise
    folder = Path(ar.__file__).resolve().parent.parent / "adapters"
    spec = importlib.util.spec_from_file_location(
        "adadiag_ref.adapters", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None or not folder.is_dir():
        raise ModuleNotFoundError("adadiag_ref.adapters is neither installed nor next to the package")
    module = importlib.util.module_from_spec(spec)
    sys.modules["adadiag_ref.adapters"] = module
    spec.loader.exec_module(module)
    ar.adapters = module  # type: ignore[attr-defined]
    return importlib.import_module("adadiag_ref.adapters.pytorch")


def call_times(fn: Callable[[], Any], reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_time(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """Median of :func:`call_times`."""
    return statistics.median(call_times(fn, reps, warmup))


FIRST_CALL_FACTOR = 5.0
"""A row whose first (warm-up, untimed) call took this many times its median gets a note under the table."""
SPREAD_FACTOR = 3.0
"""A row whose slowest timed call took this many times its fastest gets a note: the machine was not steady."""


class CallLog:
    """``fn`` wrapped so that the seconds of every call, warm-up calls included, are kept in ``seconds``.

    The table's rows are timed through one (``warmup`` untimed calls, then the timed ones), so that
    :meth:`note` can say when a row's first call cost far more than its median (lazy set-up, first page
    faults, thread-pool start) or when its timed calls spread widely, instead of printing a bare ratio."""

    def __init__(self, fn: Callable[[], Any], warmup: int) -> None:
        self.fn, self.warmup = fn, warmup
        self.seconds: list[float] = []

    def __call__(self) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn()
        finally:
            self.seconds.append(time.perf_counter() - t0)

    def note(self, median: float) -> str | None:
        """What the reader of a row with this ``median`` (seconds) should know, or ``None``."""
        notes = []
        if self.warmup and self.seconds and self.seconds[0] >= FIRST_CALL_FACTOR * median:
            first = self.seconds[0]
            notes.append(f"first call {first * 1e3:.1f} ms, {first / median:.0f}x the median (a warm-up call, "
                         f"not in the median)")  # fmt: skip
        timed = self.seconds[self.warmup :]
        if timed and max(timed) >= SPREAD_FACTOR * min(timed):
            notes.append(f"timed calls from {min(timed) * 1e3:.1f} to {max(timed) * 1e3:.1f} ms (the machine "
                         f"was not steady: rerun on an idle one)")  # fmt: skip
        return "; ".join(notes) or None


# ----------------------------------------------------------------------------- roofline


def _triad_kernel() -> Any:
    import numba

    @numba.njit(parallel=True, cache=True)
    def triad(a, b, c, s):  # type: ignore[no-untyped-def]
        for i in numba.prange(a.shape[0]):
            a[i] = a[i] + b[i] + s * c[i]

    return triad


class Roofline:
    """The machine's roofline, measured on demand on operands made once: the in-place triad bandwidth over three
    float32 arrays of ``n`` entries and the float32 GEMM rate ``P^T G`` at each distinct work shape.

    The triad is ``a += b + s c`` (read a, b, c; write a; 16 bytes per entry), in place like every optimizer
    pass, so the write costs no extra read-for-ownership: STREAM's ``a = b + s c`` moves 16 bytes per element
    through the caches while counting 12, which understates the bandwidth available to in-place kernels by a
    quarter.  Measuring again on the same arrays costs no fresh pages, so a benchmark can take the roofline
    right before each row it divides (on a shared VM the bandwidth moves by 2x within a minute)."""

    def __init__(self, n: int, shapes: list[tuple[int, int]], reps: int) -> None:
        self.n, self.reps = n, reps
        self.arrays = tuple(np.ones(n, np.float32) for _ in range(3)) if n else ()
        self.triad: Any = _triad_kernel() if n else None  # built once: the measurement repeats before every row
        rng = np.random.default_rng(0)
        self.operands = {
            (m, k): (rng.standard_normal((m, m), dtype=np.float32), rng.standard_normal((m, k), dtype=np.float32),
                     np.empty((m, k), np.float32))
            for m, k in sorted(set(shapes))
        }  # fmt: skip

    def bandwidth(self) -> float:
        """Bytes/s of the in-place triad (median of at least 9 passes after 2 warm-up passes)."""
        triad, (a, b, c) = self.triad, self.arrays
        return 16.0 * self.n / median_time(lambda: triad(a, b, c, np.float32(1e-3)), max(self.reps, 9), warmup=2)

    def gemm_rates(self) -> dict[tuple[int, int], float]:
        """FLOP/s of ``P^T G`` (``m x m`` times ``m x n``) for each work shape (median of at least 3 calls)."""
        rates = {}
        for (m, k), (P, G, out) in self.operands.items():
            t = median_time(lambda P=P, G=G, out=out: np.matmul(P.T, G, out=out), max(self.reps, 3))  # type: ignore[misc]
            rates[(m, k)] = 2.0 * m * m * k / t
        return rates

    def measure(self) -> tuple[float, float]:
        """``(bandwidth, GEMM peak)``: the triad's bytes/s and the best GEMM rate over the shapes."""
        return self.bandwidth(), max(self.gemm_rates().values())


def measure_bandwidth(n: int, reps: int) -> float:
    """In-place triad bandwidth over three float32 arrays of ``n`` entries, bytes/s (:class:`Roofline`)."""
    return Roofline(n, [], reps).bandwidth()


def interleaved_times(
    fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 1, pause: float = 0.3
) -> dict[str, list[float]]:
    """The times of ``reps`` rounds, each calling every function once in turn, after ``warmup`` calls of each.

    Round ``r`` of every function ran within the same stretch of time, so ratios formed round by round are
    not biased by a machine whose load drifts.  ``pause`` seconds of sleep follow every call, so that one
    library's spinning thread pool (torch's OpenMP threads spin for up to ~200 ms after a parallel region)
    does not slow the next call down."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            time.sleep(pause)
    return times


def interleaved_medians(
    fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 1, pause: float = 0.3
) -> dict[str, float]:
    """Median times of several functions measured in alternation (:func:`interleaved_times`)."""
    return {name: statistics.median(ts) for name, ts in interleaved_times(fns, reps, warmup, pause).items()}


def measure_gemm(shapes: list[tuple[int, int]], reps: int) -> dict[tuple[int, int], float]:
    """FLOP/s of ``P^T G`` (``m x m`` times ``m x n``, float32) for each distinct work shape (:class:`Roofline`)."""
    return Roofline(0, shapes, reps).gemm_rates()


# ----------------------------------------------------------------------------- runs


def _work_specs(specs: list[ParamSpec]) -> list[tuple[ParamSpec, tuple[int, int]]]:
    return [(s, work_shape(s.shape)) for s in specs]


class FunctionalSteps:
    """The core stepping every parameter of ``specs`` (float32, bases already set), kept across calls.

    ``in_place=False``: ``delta, S = ar.update(S, G, cfg, W)`` (the functional reference), then ``W += delta``;
    ``in_place=True``: ``S = ar.update_in_place(S, G, cfg, W)``.  Unrotated parameters under ``rule`` use
    ``adamw`` (the unrotated baseline).  Calling the object runs one step of every parameter and returns the
    seconds spent inside the core's calls: the caller's ``W += delta`` lies outside the timed window, because
    the bounds count the arrays that ``update`` itself reads and writes.

    The states persist between calls and ``warmup`` steps run at construction: a steady state.  The first
    steps of a fresh process are not representative here: until the output pool (:mod:`adadiag_ref.buffers`)
    holds a step's worth of blocks and the VM has backed that memory once, the first touches of those pages
    cost more than the arithmetic (measured before the pool: 2.0 s, 0.7 s, 0.3 s, then 0.15-0.2 s per AdamW
    step on llama-60m).
    """

    def __init__(
        self, name: str, specs: list[ParamSpec], rule: str = "paper", in_place: bool = False, warmup: int = 3
    ) -> None:
        self.in_place = in_place
        cfg = ar.make_config(name, update_freq=None)
        base = ar.make_config("adamw", update_freq=None)
        rng = np.random.default_rng(1)
        self.items: list[list[Any]] = []
        for s in specs:
            w = rng.standard_normal(s.shape, dtype=np.float32)
            g = rng.standard_normal(s.shape, dtype=np.float32)
            c = cfg if is_rotated(s, rule) else base
            self.items.append([ar.init(w, c), g, w, c])
        for _ in range(warmup):
            self()

    def __call__(self) -> float:
        elapsed = 0.0
        for it in self.items:
            t0 = time.perf_counter()
            if self.in_place:
                it[0] = ar.update_in_place(it[0], it[1], it[3], it[2])
                elapsed += time.perf_counter() - t0
            else:
                delta, it[0] = ar.update(it[0], it[1], it[3], it[2])
                elapsed += time.perf_counter() - t0
                np.add(it[2], delta, out=it[2])
        return elapsed

    def close(self) -> None:
        """Drop the states and arrays (the memory of a large model)."""
        self.items.clear()


class EngineSteps:
    """What a user's NumPy training loop runs: :class:`adadiag_ref.Engine` stepping every parameter of ``specs``
    (float32, ``lr``, betas and ``eps`` of :mod:`.params`, no weight decay, the default finiteness check), kept
    across calls.  The matrices that ``optimizer`` rotates under ``rule`` (:func:`.params.is_rotated`) form one
    engine of ``optimizer``, the rest one engine of ``adamw`` (a param group each, as in the torch adapter).

    ``update_freq=None``: the basis comes from step 1's refresh, taken in the ``warmup`` steps at construction, so
    every timed call is a steady, non-refresh step of the same gradients.  Calling the object runs one step.
    """

    def __init__(self, optimizer: str, specs: list[ParamSpec], rule: str = "paper", warmup: int = 1) -> None:
        groups: dict[str, list[ParamSpec]] = {}
        for s in specs:
            groups.setdefault(optimizer if is_rotated(s, rule) else "adamw", []).append(s)
        rng = np.random.default_rng(1)
        self.parts: list[tuple[Any, list[np.ndarray], list[np.ndarray]]] = []
        for name, members in groups.items():
            cfg = ar.make_config(name, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, update_freq=None)
            params = [rng.standard_normal(s.shape, dtype=np.float32) for s in members]
            grads = [rng.standard_normal(s.shape, dtype=np.float32) for s in members]
            self.parts.append((ar.Engine(params, cfg, names=[s.name for s in members]), grads, params))
        for _ in range(warmup):
            self()

    def __call__(self) -> None:
        for engine, grads, params in self.parts:
            engine.step(grads, params)

    def close(self) -> None:
        """Drop the engines and their arrays (the memory of a large model)."""
        self.parts.clear()


def bench_functional(
    name: str, specs: list[ParamSpec], reps: int, rule: str = "paper", in_place: bool = False
) -> float:
    """Median over ``reps`` steady-state steps of :class:`FunctionalSteps` (time inside the core's calls)."""
    steps = FunctionalSteps(name, specs, rule, in_place)
    times = [steps() for _ in range(reps)]
    steps.close()
    return statistics.median(times)


def torch_adamw(specs: list[ParamSpec], **kw: Any) -> Any:
    import torch

    return torch.optim.AdamW(torch_params(specs), lr=1e-3, weight_decay=0.0, **kw)


def bench_torch_adadiag(specs: list[ParamSpec], reps: int, rule: str = "paper") -> float:
    """Median time of AdaDiag's non-refresh step written directly in torch ops on the CPU
    (:func:`~adadiag_ref.perf.params.torch_direct_adadiag`: the yardstick of the torch adapter)."""
    return median_time(torch_direct_adadiag(specs, rule, device="cpu"), reps)


def torch_adapter_steps(specs: list[ParamSpec], rule: str = "paper") -> dict[str, Callable[[], None]]:
    """The torch adapter (``adadiag_ref.adapters.pytorch.AdaDiag``) and the core called on the same tensors.

    Returns ``{"adapter": step, "core": step}``, both after the t = 1 refresh (Gram route), so every call is a
    non-refresh step.  Unrotated parameters under ``rule`` are stepped by the adapter's ``AdamW`` (the
    unrotated baseline).  ``core``: ``ar.update`` + ``W.add_(delta)`` per parameter on the very tensors (and
    states) the adapter uses, i.e. the adapter minus its own bookkeeping.
    """
    import torch

    pytorch = import_torch_adapter()
    params = torch_params(specs)
    rotated = [p for p, s in zip(params, specs) if is_rotated(s, rule)]
    others = [p for p, s in zip(params, specs) if not is_rotated(s, rule)]
    opts = [pytorch.AdaDiag(rotated, lr=1e-3, update_freq=None)] if rotated else []
    if others:
        opts.append(pytorch.AdamW(others, lr=1e-3, update_freq=None))

    def adapter_step() -> None:
        for opt in opts:
            opt.step()

    adapter_step()  # t = 1 refreshes the bases (basis_method="auto"); every later step is a non-refresh step

    work = []
    for opt in opts:
        for index, group in enumerate(opt.param_groups):
            cfg = opt.config(index)
            for p in group["params"]:
                work.append([p, pytorch.to_core_state(opt.state[p], cfg), cfg])

    @torch.no_grad()
    def core_step() -> None:
        for item in work:
            p, state, cfg = item
            delta, item[1] = ar.update(state, p.grad, cfg, p, lr=1e-3)
            p.add_(delta)

    return {"adapter": adapter_step, "core": core_step}


def torch_adapter_ratio(
    specs: list[ParamSpec], reps: int, rule: str = "paper", warmup: int = 2, pause: float = 0.3
) -> dict[str, Any]:
    """The torch adapter against AdaDiag written directly in torch ops, measured in alternation.

    Both are built once; after ``warmup`` calls of each, ``reps`` rounds call the adapter's step and the
    direct step once each (:func:`interleaved_times`); the ratio is formed per round and its median
    reported, so a load change on a shared machine shifts both sides of a ratio alike.  Returns
    ``{"adapter": median s, "direct": median s, "ratio": median of the per-round ratios, "ratios": [...]}``.
    """
    fns = {
        "adapter": torch_adapter_steps(specs, rule)["adapter"],
        "direct": torch_direct_adadiag(specs, rule, device="cpu"),
    }
    times = interleaved_times(fns, reps, warmup=warmup, pause=pause)
    ratios = [a / d for a, d in zip(times["adapter"], times["direct"], strict=True)]
    return {
        "adapter": statistics.median(times["adapter"]),
        "direct": statistics.median(times["direct"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
    }


def bench_refresh(
    specs: list[ParamSpec], method: str, reps: int, spectrum: str = "decaying", rule: str = "paper"
) -> float:
    """One one-sided basis refresh of every rotated matrix (``ar.refresh_basis``) with ``method``."""
    cfg = ar.make_config("adadiag", basis_method=method)
    rng = np.random.default_rng(5)
    items = []
    for s in specs:
        if not is_rotated(s, rule):
            continue
        g = gradient_with_spectrum(s.shape, spectrum, rng)
        items.append((ar.init(g, cfg), g))
    return median_time(lambda: [ar.refresh_basis(st, g, cfg) for st, g in items], reps, warmup=0)


# ----------------------------------------------------------------------------- driver


def _torch_threads(ncpu: int) -> bool:
    """Whether torch is installed; if it is, it runs on ``ncpu`` threads from now on."""
    try:
        import torch
    except ImportError:
        return False
    torch.set_num_threads(ncpu)
    return True


def machine_description() -> str:
    cpu = cpu_name(platform.processor() or platform.machine())
    return f"{cpu}, {os.cpu_count()} cores, numpy {np.__version__}, {platform.python_version()}"


def run(
    model: str = "llama-60m",
    *,
    quick: bool = False,
    reps: int = 5,
    period: int = 200,
    use_torch: bool = True,
    refresh: bool = True,
    functional: bool = True,
    rule: str = "paper",
    out: Callable[[str], None] = print,
) -> dict:
    """Run the benchmark and print the tables; returns the measurements.

    BLAS uses every core during GEMMs (docs/performance.md): its thread count is
    set through threadpoolctl for the run and restored afterwards."""
    ncpu = _setup_threads()
    with threadpool_limits(limits=ncpu, user_api="blas"):
        threads = blas_threads()
        config = QUICK if quick else LLAMA_CONFIGS[model]
        specs = llama_parameters(config)
        label = "quick (tiny shapes)" if quick else model
        use_torch = use_torch and _torch_threads(ncpu)
        size = sum(math.prod(s.shape) for s in specs)
        rotated = [s for s in specs if is_rotated(s, rule)]
        work = [ws for s, ws in _work_specs(rotated)]
        out(f"adadiag-ref bench: {label}, {len(specs)} parameters, {size / 1e6:.2f}M elements, float32")
        out(f"parameter rule {rule!r}: AdaDiag rotates {len(rotated)} matrices "
            f"({sum(math.prod(s.shape) for s in rotated) / 1e6:.2f}M elements"
            + ("; the transformer blocks' q/k/v/o/gate/up/down, as in the paper's memory table); embedding, "
               "LM head and norms take the unrotated AdamW update" if rule == "paper" else ")"))  # fmt: skip
        out(f"machine: {machine_description()}")
        out(f"threads: BLAS {threads if threads is not None else '?'} (GEMMs); numba elementwise passes between "
            f"GEMMs and the flat AdamW pass: workqueue x{ncpu} (never during a GEMM); torch x{ncpu}")  # fmt: skip
        bw = measure_bandwidth((1 << 22) if quick else (1 << 25), reps)
        rates = measure_gemm(work, reps)
        peak = max(rates.values())
        out(f"roofline: in-place triad {bw / 1e9:.1f} GB/s; GEMM peak {peak / 1e9:.1f} GFLOP/s "
            f"(per shape: {', '.join(f'{m}x{n} {r / 1e9:.0f}' for (m, n), r in sorted(rates.items()))})")  # fmt: skip
        res: dict[str, Any] = {"bandwidth": bw, "gemm_peak": peak, "blas_threads": threads, "rule": rule}
        rows: list[tuple[str, str, float, float, str]] = []  # key in res, text, seconds, bound, kind

        # AdamW
        # every row but the functional ones (FunctionalSteps warms up on its own) is timed through a CallLog
        logs: dict[str, CallLog] = {}
        eng = EngineSteps("adamw", specs)
        adamw_bound = adamw_bytes(specs) / bw
        logs["adamw_engine"] = CallLog(eng, warmup=1)
        if use_torch:  # the engine and torch's fused AdamW in alternation: a fair head-to-head on a drifting VM
            fused = torch_adamw(specs, fused=True)
            logs["torch_adamw_fused"] = CallLog(fused.step, warmup=1)
            res.update(interleaved_medians({key: logs[key] for key in ("adamw_engine", "torch_adamw_fused")}, reps,
                                           warmup=1, pause=0.01 if quick else 0.3))  # fmt: skip
            del fused
        else:
            res["adamw_engine"] = median_time(logs["adamw_engine"], reps, warmup=1)
        eng.close()
        if functional:
            res["adamw_functional"] = bench_functional("adamw", specs, max(2, reps // 2))
            res["adamw_in_place"] = bench_functional("adamw", specs, max(2, reps // 2), in_place=True)
        if use_torch:
            logs["torch_adamw_foreach"] = CallLog(torch_adamw(specs, foreach=True).step, warmup=1)
            res["torch_adamw_foreach"] = median_time(logs["torch_adamw_foreach"], reps, warmup=1)
        for key, text in [("adamw_engine", "AdamW ar.Engine (what a NumPy loop runs)"),
                          ("adamw_functional", "AdamW ar.update (functional reference)"),
                          ("adamw_in_place", "AdamW ar.update_in_place (NumPy)"),
                          ("torch_adamw_foreach", "torch.optim.AdamW(foreach=True)"),
                          ("torch_adamw_fused", "torch.optim.AdamW(fused=True)")]:  # fmt: skip
            if key in res:
                rows.append((key, text, res[key], adamw_bound, "bandwidth bound"))

        # AdaDiag
        eng2 = EngineSteps("adadiag", specs, rule)
        gemm_bound = adadiag_flops(specs, rule) / peak
        elem_bound = adadiag_bytes(specs, rule) / bw
        adadiag_bound = gemm_bound + elem_bound

        logs["adadiag_engine"] = CallLog(eng2, warmup=2)
        res["adadiag_engine"] = median_time(logs["adadiag_engine"], reps, warmup=2)
        eng2.close()
        if functional:
            res["adadiag_functional"] = bench_functional("adadiag", specs, max(2, reps // 2), rule)
            res["adadiag_in_place"] = bench_functional("adadiag", specs, max(2, reps // 2), rule, in_place=True)
        if use_torch:
            try:
                steps = torch_adapter_steps(specs, rule)
            except ModuleNotFoundError as exc:  # pragma: no cover - adapters folder missing
                out(f"  torch adapter not importable: {exc}")
            else:  # the adapter's and the core's steps, through CallLogs
                for key, name in (("torch_adadiag_adapter", "adapter"), ("torch_adadiag_core", "core")):
                    logs[key] = CallLog(steps[name], warmup=1)
                    res[key] = median_time(logs[key], max(3, reps // 2), warmup=1)
        for key, text in [("adadiag_engine", "AdaDiag ar.Engine (what a NumPy loop runs)"),
                          ("adadiag_functional", "AdaDiag ar.update (functional reference)"),
                          ("adadiag_in_place", "AdaDiag ar.update_in_place (NumPy)"),
                          ("torch_adadiag_adapter", "AdaDiag torch adapter (opt.step)"),
                          ("torch_adadiag_core", "AdaDiag core ar.update on torch tensors")]:  # fmt: skip
            if key in res:
                rows.append((key, text, res[key], adadiag_bound, "GEMM + bytes"))
        res.update(adamw_bound=adamw_bound, adadiag_bound=adadiag_bound, gemm_bound=gemm_bound, elem_bound=elem_bound)

        res["calls_s"] = {key: list(log.seconds) for key, log in logs.items()}
        out("")
        out(f"{'non-refresh step':44s} {'median ms':>10s} {'bound ms':>9s} {'ratio':>6s}  bound")
        notes: list[str] = []
        for key, text, t, bound, kind in rows:
            note = logs[key].note(t) if key in logs else None
            if note:
                notes.append(f"  [{len(notes) + 1}] {text}: {note}")
            mark = f"  [{len(notes)}]" if note else ""
            out(f"{text:44s} {t * 1e3:10.1f} {bound * 1e3:9.1f} {t / bound:6.2f}  {kind}{mark}")
        for line in notes:
            out(line)
        out(f"  AdaDiag bound = {gemm_bound * 1e3:.1f} ms GEMM ({gemm_bound / adadiag_bound:.0%}) "
            f"+ {elem_bound * 1e3:.1f} ms elementwise")  # fmt: skip
        if "torch_adamw_fused" in res:
            out(f"  AdamW engine / torch fused = {res['adamw_engine'] / res['torch_adamw_fused']:.2f}; "
                f"torch foreach / bound = {res['torch_adamw_foreach'] / adamw_bound:.2f}")  # fmt: skip
        if "torch_adadiag_adapter" in res:
            adapter_ratio = res["torch_adadiag_adapter"] / res["torch_adadiag_core"]
            out(f"  torch adapter / core on the same tensors = {adapter_ratio:.2f}")

        if refresh:
            out("")
            out(f"refresh of the {len(rotated)} rotated matrices (one-sided, P only), amortised over T={period} "
                f"against the engine step")  # fmt: skip
            out(f"{'gradient spectrum, method':44s} {'median s':>10s} {'amortised':>10s}")
            step = res["adadiag_engine"]
            for spectrum in ("decaying", "flat"):
                for method in ("svd", "auto", "gram"):
                    t = bench_refresh(specs, method, reps if quick else max(1, reps // 3), spectrum, rule)
                    pct = (t / period) / (step + t / period)
                    res[f"refresh_{spectrum}_{method}"] = t
                    res[f"refresh_{spectrum}_{method}_pct"] = pct
                    text = f"{spectrum} ({'sigma_i ~ 1/i' if spectrum == 'decaying' else 'Gaussian'}), {method}"
                    out(f"{text:44s} {t:10.3f} {pct:10.2%}")
        return res
