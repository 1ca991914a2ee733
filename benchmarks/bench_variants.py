"""Development variants of ``adadiag-ref bench``: where the time of a step goes, and hand-written baselines.

Not part of the installed command: these rows time ``ar.Engine``'s AdaDiag step with and without its finiteness
check, beside two hand-written baselines, an unfused NumPy AdamW and AdaDiag written directly in torch ops.
The baselines restate the Adam moment update on purpose (they are what a user would write without the library);
they are timed, never used as a reference.

Run: ``python benchmarks/bench_variants.py [--model llama-60m|llama-130m] [--quick] [--reps N] [--rule paper|all]``.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from threadpoolctl import threadpool_limits

from adadiag_ref.memory import LLAMA_CONFIGS, llama_parameters
from adadiag_ref.perf.bench import (
    QUICK,
    EngineSteps,
    _setup_threads,
    _work_specs,
    bench_torch_adadiag,
    interleaved_medians,
    measure_bandwidth,
    measure_gemm,
    median_time,
)
from adadiag_ref.perf.params import adadiag_bytes, adadiag_flops, adamw_bytes, is_rotated


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


def run(model: str, *, quick: bool, reps: int, rule: str, use_torch: bool) -> dict[str, float]:
    """Time the variants and print them against the roofline of the same run."""
    ncpu = _setup_threads()
    specs = llama_parameters(QUICK if quick else LLAMA_CONFIGS[model])
    size = sum(math.prod(s.shape) for s in specs)
    work = [ws for s, ws in _work_specs([s for s in specs if is_rotated(s, rule)])]
    with threadpool_limits(limits=ncpu, user_api="blas"):
        bw = measure_bandwidth((1 << 22) if quick else (1 << 25), reps)
        peak = max(measure_gemm(work, reps).values())
        adamw_bound = adamw_bytes(specs) / bw
        gemm_bound, elem_bound = adadiag_flops(specs, rule) / peak, adadiag_bytes(specs, rule) / bw
        eng = EngineSteps("adadiag", specs, rule)

        def unchecked() -> None:
            for engine, grads, params in eng.parts:
                engine.step(grads, params, check=False)

        variants = {"adadiag_engine": eng, "adadiag_engine_unchecked": unchecked}  # in alternation: the VM drifts
        res = interleaved_medians(variants, reps, warmup=2, pause=0.0 if quick else 0.05)
        eng.close()
        res["adamw_numpy_unfused"] = bench_numpy_adamw_unfused(size, reps)
        if use_torch:
            import torch

            torch.set_num_threads(ncpu)
            res["torch_adadiag_direct"] = bench_torch_adadiag(specs, reps, rule)
    rows = [
        ("AdamW numpy in place, unfused", "adamw_numpy_unfused", adamw_bound),
        ("AdaDiag ar.Engine", "adadiag_engine", gemm_bound + elem_bound),
        ("AdaDiag ar.Engine, check=False", "adadiag_engine_unchecked", gemm_bound + elem_bound),
        ("AdaDiag direct torch ops", "torch_adadiag_direct", gemm_bound + elem_bound),
    ]
    print(f"{'non-refresh step (variants)':44s} {'median ms':>10s} {'bound ms':>9s} {'ratio':>6s}")
    for text, key, bound in rows:
        if key in res:
            print(f"{text:44s} {res[key] * 1e3:10.1f} {bound * 1e3:9.1f} {res[key] / bound:6.2f}")
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-60m", choices=["llama-60m", "llama-130m"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rule", default="paper", choices=["paper", "all"])
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    run(args.model, quick=args.quick, reps=args.reps, rule=args.rule, use_torch=not args.no_torch)


if __name__ == "__main__":
    main()
