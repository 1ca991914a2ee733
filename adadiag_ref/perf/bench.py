"""``adadiag-ref bench``: step times against a roofline measured in the same run, and against PyTorch.

For the parameter set of a LLaMA model (attention q/k/v/o, MLP gate/up/down,
norms, embedding and head) it measures, all in one process:

* the roofline: float32 GEMM throughput at the model's shapes (the peak is the
  best shape) and memory bandwidth (a two-thread STREAM triad ``a = b + s c``);
* each optimizer's non-refresh step, as a median, and its ratio to its lower
  bound ``GEMM flops / peak + elementwise bytes / bandwidth``;
* torch.optim.AdamW (foreach and fused) and AdaDiag written directly in torch
  ops on the same CPU, and the torch adapter when it is installed;
* one basis refresh of every matrix (SVD and Gram routes) and its cost
  amortised over T steps, as a percentage of the average step.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..memory import LLAMA_CONFIGS, LlamaConfig, ParamSpec, llama_parameters

QUICK = LlamaConfig(hidden=64, intermediate=172, layers=2, heads=2, vocab=1000)


def _setup_threads() -> int:
    """Thread policy (docs/performance.md): numba's pool uses the non-spinning workqueue layer."""
    import numba

    config: Any = numba.config
    if config.THREADING_LAYER in ("default", ""):
        config.THREADING_LAYER = "workqueue"
    return os.cpu_count() or 1


def median_time(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- roofline


def _triad_kernel() -> Any:
    import numba

    @numba.njit(parallel=True, cache=True)
    def triad(a, b, c, s):  # type: ignore[no-untyped-def]
        for i in numba.prange(a.shape[0]):
            a[i] = b[i] + s * c[i]

    return triad


def measure_bandwidth(n: int, reps: int) -> float:
    """STREAM triad over three float32 arrays of ``n`` elements; bytes/s (12 n bytes per pass)."""
    triad = _triad_kernel()
    a, b, c = np.zeros(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
    t = median_time(lambda: triad(a, b, c, np.float32(3.0)), max(reps, 5), warmup=2)
    return 12.0 * n / t


def measure_gemm(shapes: list[tuple[int, int]], reps: int) -> dict[tuple[int, int], float]:
    """FLOP/s of ``P^T G`` (``m x m`` times ``m x n``, float32) for each distinct work shape."""
    rng = np.random.default_rng(0)
    rates = {}
    for m, n in sorted(set(shapes)):
        P = rng.standard_normal((m, m), dtype=np.float32)
        G = rng.standard_normal((m, n), dtype=np.float32)
        out = np.empty((m, n), np.float32)
        t = median_time(lambda P=P, G=G, out=out: np.matmul(P.T, G, out=out), max(reps, 3))  # type: ignore[misc]
        rates[(m, n)] = 2.0 * m * m * n / t
    return rates


# ----------------------------------------------------------------------------- runs


def _work_specs(specs: list[ParamSpec]) -> list[tuple[ParamSpec, tuple[int, int]]]:
    from .engine import work_shape

    return [(s, work_shape(s.shape)) for s in specs]


def bench_functional(name: str, specs: list[ParamSpec], reps: int) -> float:
    """The reference functional path: ``ar.update`` over every parameter (float32, bases already set)."""
    import adadiag_ref as ar

    cfg = ar.make_config(name, update_freq=None)
    rng = np.random.default_rng(1)
    items: list[list[Any]] = []
    for s in specs:
        w = rng.standard_normal(s.shape, dtype=np.float32)
        g = rng.standard_normal(s.shape, dtype=np.float32)
        items.append([ar.init(w, cfg), g, w])

    def one() -> None:
        for it in items:
            delta, it[0] = ar.update(it[0], it[1], cfg, it[2])
            np.add(it[2], delta, out=it[2])

    t = median_time(one, reps)
    items.clear()
    return t


def bench_numpy_adamw_unfused(size: int, reps: int) -> float:
    """AdamW in NumPy, in place with ``out=`` but one pass per operation (the unfused baseline)."""
    rng = np.random.default_rng(2)
    W, G = rng.standard_normal(size, dtype=np.float32), rng.standard_normal(size, dtype=np.float32)
    M, V, tmp = np.zeros(size, np.float32), np.zeros(size, np.float32), np.empty(size, np.float32)
    b1, b2, lr, eps, wd = np.float32(0.9), np.float32(0.999), np.float32(1e-3), np.float32(1e-8), np.float32(0.0)

    def one() -> None:
        np.multiply(M, b1, out=M)
        np.multiply(G, 1 - b1, out=tmp)
        np.add(M, tmp, out=M)
        np.multiply(G, G, out=tmp)
        np.multiply(tmp, 1 - b2, out=tmp)
        np.multiply(V, b2, out=V)
        np.add(V, tmp, out=V)
        np.sqrt(V, out=tmp)
        np.add(tmp, eps, out=tmp)
        np.divide(M, tmp, out=tmp)
        np.multiply(W, 1 - lr * wd, out=W)
        np.multiply(tmp, lr, out=tmp)
        np.subtract(W, tmp, out=W)

    return median_time(one, reps)


def _torch_params(specs: list[ParamSpec], torch: Any) -> list[Any]:
    gen = torch.Generator().manual_seed(3)
    params = []
    for s in specs:
        p = torch.nn.Parameter(torch.randn(s.shape, generator=gen))
        p.grad = torch.randn(s.shape, generator=gen)
        params.append(p)
    return params


def bench_torch_adamw(specs: list[ParamSpec], reps: int, **kw: Any) -> float:
    import torch

    params = _torch_params(specs, torch)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, **kw)
    t = median_time(opt.step, reps)
    del opt, params
    return t


def bench_torch_adadiag(specs: list[ParamSpec], reps: int) -> float:
    """AdaDiag (non-refresh step) written directly in torch ops, in place, on the work frames."""
    import torch

    from .engine import coefficients

    gen = torch.Generator().manual_seed(4)
    mats, vecs = [], []
    for _, (m, n) in _work_specs(specs):
        W, G = torch.randn(m, n, generator=gen), torch.randn(m, n, generator=gen)
        state = (W, G, torch.zeros(m, n), torch.zeros(m, n))
        if m == 1:
            vecs.append(state)
            continue
        P = torch.linalg.qr(torch.randn(m, m, generator=gen))[0].contiguous()
        mats.append((*state, P, torch.empty(m, n), torch.empty(m, n)))
    counter = [0]
    lr, eps = 1e-3, 1e-8

    @torch.no_grad()
    def one() -> None:
        counter[0] += 1
        b1, c1, b2, c2 = (float(x) for x in coefficients(counter[0], (0.9, 0.999), np.float32))
        for W, G, M, V, P, Gt, D in mats:
            torch.mm(P.T, G, out=Gt)
            M.mul_(b1).add_(Gt, alpha=c1)
            V.mul_(b2).addcmul_(Gt, Gt, value=c2)
            torch.sqrt(V, out=Gt).add_(eps)
            torch.div(M, Gt, out=Gt)
            torch.mm(P, Gt, out=D)
            W.add_(D, alpha=-lr)
        for W, G, M, V in vecs:
            M.mul_(b1).add_(G, alpha=c1)
            V.mul_(b2).addcmul_(G, G, value=c2)
            W.addcdiv_(M, V.sqrt().add_(eps), value=-lr)

    t = median_time(one, reps)
    mats.clear()
    vecs.clear()
    return t


def bench_torch_adapter(specs: list[ParamSpec], reps: int) -> float | None:
    """The library's torch adapter (``adadiag_ref.adapters.pytorch.AdaDiag``), non-refresh steps."""
    try:
        import torch

        from ..adapters.pytorch import AdaDiag  # type: ignore[import-not-found]
    except Exception:
        return None
    from .. import linalg

    params = _torch_params(specs, torch)
    opt = AdaDiag(params, lr=1e-3, update_freq=None)
    previous = linalg.set_refresh_method("auto")
    try:
        opt.step()  # t = 1 refreshes the bases; every later step is a non-refresh step
    finally:
        linalg.set_refresh_method(previous)
    t = median_time(opt.step, reps, warmup=0)
    del opt, params
    return t


def bench_refresh(specs: list[ParamSpec], method: str, reps: int) -> float:
    """One one-sided basis refresh of every matrix (``ar.refresh_basis``) with ``method``."""
    import adadiag_ref as ar
    from adadiag_ref import linalg

    cfg = ar.make_config("adadiag")
    rng = np.random.default_rng(5)
    items = []
    for s in specs:
        if len(s.shape) < 2:
            continue
        g = rng.standard_normal(s.shape, dtype=np.float32)
        items.append((ar.init(g, cfg), g))
    previous = linalg.set_refresh_method(method)
    try:
        return median_time(lambda: [ar.refresh_basis(st, g, cfg) for st, g in items], reps, warmup=0)
    finally:
        linalg.set_refresh_method(previous)


# ----------------------------------------------------------------------------- driver


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy

    return f"{cpu}, {os.cpu_count()} cores, numpy {numpy.__version__}, {platform.python_version()}"


def run(
    model: str = "llama-60m",
    *,
    quick: bool = False,
    reps: int = 5,
    period: int = 200,
    use_torch: bool = True,
    refresh: bool = True,
    functional: bool = True,
    out: Callable[[str], None] = print,
) -> dict:
    """Run the benchmark and print the tables; returns the measurements."""
    ncpu = _setup_threads()
    config = QUICK if quick else LLAMA_CONFIGS[model]
    specs = llama_parameters(config)
    label = "quick (tiny shapes)" if quick else model
    if use_torch:
        try:
            import torch

            torch.set_num_threads(ncpu)
        except ImportError:
            use_torch = False
    from .engine import AdaDiagEngine, AdamWEngine

    size = sum(math.prod(s.shape) for s in specs)
    work = [ws for _, ws in _work_specs(specs) if ws[0] > 1]
    out(f"adadiag-ref bench: {label}, {len(specs)} parameters, {size / 1e6:.2f}M elements, float32")
    out(f"machine: {machine_description()}")
    bw = measure_bandwidth((1 << 22) if quick else (1 << 25), reps)
    rates = measure_gemm(work, reps)
    peak = max(rates.values())
    out(f"roofline: triad {bw / 1e9:.1f} GB/s; GEMM peak {peak / 1e9:.1f} GFLOP/s "
        f"(per shape: {', '.join(f'{m}x{n} {r / 1e9:.0f}' for (m, n), r in sorted(rates.items()))})")  # fmt: skip
    res: dict[str, Any] = {"bandwidth": bw, "gemm_peak": peak}
    rows: list[tuple[str, float, float | None, str]] = []

    # AdamW
    eng = AdamWEngine(specs)
    adamw_bound = eng.bytes_moved() / bw
    res["adamw_engine"] = median_time(eng.step, reps)
    del eng
    res["adamw_numpy_unfused"] = bench_numpy_adamw_unfused(size, reps)
    if functional:
        res["adamw_functional"] = bench_functional("adamw", specs, max(2, reps // 2))
    if use_torch:
        res["torch_adamw_foreach"] = bench_torch_adamw(specs, reps, foreach=True)
        res["torch_adamw_fused"] = bench_torch_adamw(specs, reps, fused=True)
    for key, text in [("adamw_engine", "AdamW numba fused in place (engine)"),
                      ("adamw_numpy_unfused", "AdamW numpy in place, unfused"),
                      ("adamw_functional", "AdamW ar.update (functional reference)"),
                      ("torch_adamw_foreach", "torch.optim.AdamW(foreach=True)"),
                      ("torch_adamw_fused", "torch.optim.AdamW(fused=True)")]:  # fmt: skip
        if key in res:
            rows.append((text, res[key], adamw_bound, "bandwidth bound"))

    # AdaDiag
    eng2 = AdaDiagEngine(specs)
    gemm_bound = eng2.flops() / peak
    elem_bound = eng2.bytes_moved() / bw
    adadiag_bound = gemm_bound + elem_bound
    res["adadiag_engine"] = median_time(eng2.step, reps)
    res["adadiag_gemm_only"] = median_time(lambda: eng2.step(elementwise=False), reps)
    eng2.items.clear()
    if functional:
        res["adadiag_functional"] = bench_functional("adadiag", specs, max(2, reps // 2))
    if use_torch:
        res["torch_adadiag_direct"] = bench_torch_adadiag(specs, reps)
        adapter = bench_torch_adapter(specs, max(2, reps // 2))
        if adapter is not None:
            res["torch_adadiag_adapter"] = adapter
    rows.append(("AdaDiag numba + BLAS in place (engine)", res["adadiag_engine"], adadiag_bound, "GEMM + bytes"))
    rows.append(("AdaDiag engine, GEMMs only", res["adadiag_gemm_only"], gemm_bound, "GEMM bound"))
    for key, text in [("adadiag_functional", "AdaDiag ar.update (functional reference)"),
                      ("torch_adadiag_direct", "AdaDiag direct torch ops"),
                      ("torch_adadiag_adapter", "AdaDiag torch adapter")]:  # fmt: skip
        if key in res:
            rows.append((text, res[key], adadiag_bound, "GEMM + bytes"))
    res.update(adamw_bound=adamw_bound, adadiag_bound=adadiag_bound, gemm_bound=gemm_bound, elem_bound=elem_bound)

    out("")
    out(f"{'non-refresh step':44s} {'median ms':>10s} {'bound ms':>9s} {'ratio':>6s}  bound")
    for text, t, bound, kind in rows:
        ratio = f"{t / bound:6.2f}" if bound else "     -"
        out(f"{text:44s} {t * 1e3:10.1f} {bound * 1e3 if bound else 0:9.1f} {ratio}  {kind}")
    out(f"  AdaDiag bound = {gemm_bound * 1e3:.1f} ms GEMM ({gemm_bound / adadiag_bound:.0%}) "
        f"+ {elem_bound * 1e3:.1f} ms elementwise")  # fmt: skip
    if "torch_adamw_fused" in res:
        out(f"  AdamW engine / torch fused = {res['adamw_engine'] / res['torch_adamw_fused']:.2f}; "
            f"torch foreach / bound = {res['torch_adamw_foreach'] / adamw_bound:.2f}")  # fmt: skip
    if "torch_adadiag_adapter" in res:
        out(f"  torch adapter / direct torch = {res['torch_adadiag_adapter'] / res['torch_adadiag_direct']:.2f}")

    if refresh:
        out("")
        out(f"{'refresh (all matrices, one-sided)':44s} {'median s':>10s} {'amortised T=' + str(period):>16s}")
        step = res["adadiag_engine"]
        for method in ("svd", "auto"):
            t = bench_refresh(specs, method, 1 if not quick else reps)
            pct = (t / period) / (step + t / period)
            res[f"refresh_{method}"] = t
            res[f"refresh_{method}_pct"] = pct
            out(f"{'refresh, method=' + method:44s} {t:10.3f} {pct:15.2%}")
    return res
