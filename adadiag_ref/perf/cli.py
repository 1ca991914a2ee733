"""CLI subcommands ``bench`` and ``memory`` (wired into ``adadiag-ref`` by the main CLI)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

from .._cli import ErrorParser, fail, int_list, output_file, parse_and_run, plot_file, positive_int
from ..memory import LLAMA_CONFIGS, PAPER_GB, PAPER_MEMORY_TABLE, PAPER_ROWS, dtype_nbytes, state_nbytes

__all__ = ["add_parser", "main", "run_bench", "run_gpu_bench", "run_memory"]


#: bench options that measure the CPU only: refused with ``--gpu`` (``dest``, as typed).
_CPU_ONLY = (("steady", "--steady"), ("refresh_routes", "--refresh-routes"), ("refresh_scaling", "--refresh-scaling"),
             ("plot", "--plot"), ("threads", "--threads"), ("retain_freed_memory", "--retain-freed-memory"),
             ("no_functional", "--no-functional"))  # fmt: skip


def run_gpu_bench(args: argparse.Namespace) -> int:
    """``bench --gpu``: the options and the device checked before any work (one error line, exit 2), then
    :func:`adadiag_ref.perf.gpu.run`.  Needs neither numba nor threadpoolctl."""
    conflict = next((flag for dest, flag in _CPU_ONLY if getattr(args, dest, None)), None)
    if conflict:
        return fail(f"--gpu cannot be combined with {conflict} (a CPU measurement); run them separately")
    from . import gpu

    missing = gpu.missing_requirement()
    if missing:
        return fail(missing)
    gpu.run(args.model, quick=args.quick, reps=args.reps, period=args.period, rule=args.rule,
            use_torch=not args.no_torch, refresh=not args.no_refresh, json_path=args.json)  # fmt: skip
    return 0


def run_bench(args: argparse.Namespace) -> int:
    if args.gpu:  # decided first: the GPU bench needs neither numba nor threadpoolctl
        return run_gpu_bench(args)
    if args.json:
        return fail(f"--json {args.json} writes the tables of --gpu; add --gpu")
    # the in-place engine (the roofline rows and the thread policy) is numba code, and BLAS threads are set
    # through threadpoolctl: say what is missing before any work
    if args.plot and not args.refresh_scaling:
        return fail(f"--plot {args.plot} draws the --refresh-scaling plot; add --refresh-scaling")
    missing = [name for name in ("numba", "threadpoolctl") if importlib.util.find_spec(name) is None]
    if missing:
        return fail(f'bench needs {" and ".join(missing)}: pip install "adadiag-ref[bench]"')
    if args.retain_freed_memory:
        from .allocator import retain_freed_memory

        if not retain_freed_memory():
            print("adadiag-ref: warning: --retain-freed-memory needs glibc; the allocator is unchanged",
                  file=sys.stderr)  # fmt: skip
    if args.steady:
        from .steady import run as run_steady

        run_steady(args.model, quick=args.quick, reps=args.reps, use_torch=not args.no_torch, rule=args.rule)
        return 0
    if args.refresh_routes or args.refresh_scaling:  # the refresh alone (adadiag_ref.perf.refresh)
        from .refresh import run_routes, run_scaling

        if args.refresh_routes:
            run_routes(args.model, quick=args.quick, reps=args.reps, period=args.period, threads=args.threads)
        if args.refresh_scaling:
            sides = (64, 128) if args.quick else tuple(args.sides)
            run_scaling(sides, reps=args.reps, plot=args.plot, threads=args.threads)
        return 0
    from .bench import run

    run(args.model, quick=args.quick, reps=args.reps, period=args.period, use_torch=not args.no_torch,
        refresh=not args.no_refresh, functional=not args.no_functional, rule=args.rule)  # fmt: skip
    return 0


def run_memory(args: argparse.Namespace) -> int:
    models = args.model or list(LLAMA_CONFIGS)
    unit = {"paper": PAPER_GB, "GB": 1e9, "GiB": 2.0**30}[args.unit]
    cols = list(LLAMA_CONFIGS)
    print(f"optimizer-state memory, {args.dtype}, rule={args.rule}, G = {unit:.4g} bytes")
    header = f"{'optimizer':26s}" + "".join(f"{m:>13s}" for m in models)
    print(header + ("   paper" if args.rule == "paper" and args.dtype in ("bf16", "bfloat16") else ""))
    for label, (name, opts) in PAPER_ROWS.items():
        vals = [state_nbytes(m, name, dtype=args.dtype, rule=args.rule, **opts) / unit for m in models]
        line = f"{label:26s}" + "".join(f"{v:12.2f}G" for v in vals)
        if args.rule == "paper" and args.dtype in ("bf16", "bfloat16") and args.unit == "paper":
            paper = [PAPER_MEMORY_TABLE[label][cols.index(m)] for m in models]
            match = all(round(v, 2) == p for v, p in zip(vals, paper))
            line += "   " + " ".join(f"{p:.2f}" for p in paper) + ("  match" if match else "  MISMATCH")
        print(line)
    print(f"{'GaLore rank-r=m/4':26s}" + "".join(f"{'n/a':>13s}" for _ in models)
          + "   not an optimizer of this library (see docs/performance.md)")  # fmt: skip
    return 0


def _dtype(text: str) -> str:
    """argparse ``type=``: a dtype name :func:`~adadiag_ref.memory.dtype_nbytes` knows."""
    try:
        dtype_nbytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_parser(subparsers: Any) -> None:
    """Register ``bench`` and ``memory`` on an argparse ``subparsers`` object."""
    b = subparsers.add_parser("bench", help="step-time benchmark against the measured roofline and PyTorch")
    b.add_argument("--model", default="llama-60m", choices=["llama-60m", "llama-130m"])
    b.add_argument("--quick", action="store_true", help="tiny shapes, a few seconds (smoke test)")
    b.add_argument("--reps", type=positive_int, default=5, help="timed repetitions per measurement (median)")
    b.add_argument("--period", type=positive_int, default=200, help="refresh period T for the amortised cost")
    b.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparisons")
    b.add_argument("--no-refresh", action="store_true", help="skip the basis-refresh timing")
    b.add_argument("--no-functional", action="store_true", help="skip the functional ar.update timings")
    b.add_argument("--steady", action="store_true",
                   help="only the steady-state (non-refresh) ratios and their targets (perf/steady.py)")  # fmt: skip
    b.add_argument("--rule", default="paper", choices=["paper", "all"],
                   help="paper: rotate only the transformer blocks' matrices (embedding/head unrotated)")  # fmt: skip
    b.add_argument(
        "--refresh-routes",
        action="store_true",
        help="only the basis refresh: every route (basis_method and the evaluated candidates), "
        "amortised share, worst-step latency and accuracy",
    )
    b.add_argument("--refresh-scaling", action="store_true", help="only the refresh time against the matrix side")
    b.add_argument("--sides", type=int_list(2), default="256,512,1024,2048",
                   help="matrix sides for --refresh-scaling (distinct integers >= 2)")  # fmt: skip
    b.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="BLAS and numba threads for --refresh-routes/--refresh-scaling (default: every core)",
    )
    b.add_argument(
        "--retain-freed-memory",
        action="store_true",
        help="glibc keeps freed memory in the process (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2^31-1), so the "
        "functional rows reuse pages instead of faulting fresh ones (adadiag_ref.perf.allocator)",
    )
    b.add_argument("--plot", default=None, type=plot_file, help="save the --refresh-scaling log-log plot here (PNG)")
    b.add_argument(
        "--gpu",
        action="store_true",
        help="the GPU path on the current CUDA device (needs CuPy): the CuPy core's step for five optimizers, "
        "torch and optax peers, bandwidth and GEMM bounds, the refresh (adadiag_ref.perf.gpu)",
    )
    b.add_argument("--json", metavar="PATH", type=output_file, help="with --gpu: write the tables as JSON")
    b.set_defaults(func=run_bench)
    m = subparsers.add_parser("memory", help="optimizer-state memory (the paper's table) from the state layout")
    m.add_argument("--model", action="append", choices=list(LLAMA_CONFIGS), help="repeatable; default all four")
    m.add_argument("--dtype", default="bf16", type=_dtype, help="bf16 (paper), fp16, fp32, fp64")
    m.add_argument("--rule", default="paper", choices=["paper", "all"])
    m.add_argument("--unit", default="paper", choices=["paper", "GB", "GiB"], help="paper: G = 1.024e9 bytes")
    m.set_defaults(func=run_memory)


def main(argv: list[str] | None = None) -> int:
    parser = ErrorParser(prog="adadiag-ref")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parse_and_run(parser, argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
