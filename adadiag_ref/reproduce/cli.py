"""``adadiag-ref reproduce``: the paper's AdamW comparison at CPU scale (docs/reproduction.md)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
from typing import Any

from .._cli import add_progress_flags, cpu_name, int_at_least, int_list, output_file, plot_file, positive_int
from ..config import OPTIMIZERS

DEFAULT_LR_GRID = {"charlm": (1e-2, 3e-3, 1e-3), "digits": (3e-2, 1e-2, 3e-3)}
QUICK_LR_GRID = (1e-2, 3e-3)
DEFAULT_STEPS = {"charlm": 500, "digits": 300}
QUICK_STEPS = 30


def _names(text: str) -> list[str]:
    # the registry's names (those of the torch adapter's classes), read without importing torch: the parser runs
    # this on the default too, so a core-only install reaches run()'s one-line requirement error
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown optimizer(s) {unknown}; choose from {', '.join(OPTIMIZERS)}")
    return names


def missing_requirement(task: str) -> str | None:
    """What ``reproduce --task task`` lacks on this install (torch; scikit-learn for ``digits``), as the one-line
    error with the install command, or ``None``."""
    needed = ["torch", *(["sklearn"] if task == "digits" else [])]
    missing = [{"sklearn": "scikit-learn"}.get(m, m) for m in needed if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f'reproduce needs {" and ".join(missing)}: pip install "adadiag-ref[reproduce]"'


_seeds = int_list(0)


def _lrs(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a comma list of learning rates, got {text!r}") from exc
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"learning rates must be positive and finite, got {text!r}")
    return values


def add_parser(sub: Any) -> None:
    """Register ``reproduce`` on the ``adadiag-ref`` subparsers."""
    p = sub.add_parser("reproduce", help="train a small model with AdamW and the AdaDiag optimizers; speed-ups")
    p.add_argument(
        "--task",
        choices=["charlm", "digits"],
        default="charlm",
        help="charlm: LLaMA-style character model on stdlib source; digits: CNN on sklearn digits",
    )
    p.add_argument(
        "--optimizers",
        type=_names,
        default="adamw,adadiag,adadiag_pp,adafacdiag,hfacdiag",
        help="comma list (default adamw,adadiag,adadiag_pp,adafacdiag,hfacdiag); adamw always runs",
    )
    p.add_argument("--seeds", type=_seeds, default="0,1", help="comma list of distinct seeds >= 0 (default 0,1)")
    p.add_argument("--steps", type=int_at_least(2), help=f"training steps per run (default {DEFAULT_STEPS})")
    p.add_argument(
        "--lr-grid",
        type=_lrs,
        help="comma list of peak learning rates swept on the first seed, the "
        f"same for every optimizer (default {DEFAULT_LR_GRID})",
    )
    p.add_argument("--quick", action="store_true", help=f"tiny model, {QUICK_STEPS} steps: a CI smoke run")
    p.add_argument("--update-freq", type=positive_int, help="basis refresh period T (default max(1, steps // 50))")
    p.add_argument("--batch", type=positive_int, help="minibatch size (default charlm 16 x 64 characters, digits 64)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--jobs", type=positive_int, default=1, help="runs in parallel processes (default 1; same numbers)")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model, the batches and the optimizer live (default cpu; cuda: torch's current CUDA "
        "device, runs not bit-reproducible)",
    )
    p.add_argument("--json", metavar="PATH", type=output_file, help="write the results as JSON")
    p.add_argument("--plot", metavar="PNG", type=plot_file, help="draw the validation-loss curves (needs matplotlib)")
    add_progress_flags(p)
    p.set_defaults(func=run)  # fmt: skip


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf: a diverged run's losses are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def _machine(device: str = "cpu") -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "num_threads": torch.get_num_threads(),
            "nproc": os.cpu_count(), "cpu": cpu_name(), "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run the comparison, print the table, write JSON and plot."""
    # counts, output paths and the plot's matplotlib are checked by the parser (adadiag_ref._cli); the libraries
    # here, before a run of minutes
    missing = missing_requirement(args.task)
    if missing:
        raise ValueError(missing)
    import torch

    from .train import deterministic

    device = getattr(args, "device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise ValueError(f"--device cuda needs a CUDA device, and torch sees none ({build}); install a CUDA build "
                         "of torch (https://pytorch.org/get-started/locally/) or run with --device cpu")  # fmt: skip
    previous = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(args.threads)
    # bit-reproducible on the CPU; on CUDA, cuBLAS and some kernels (cross-entropy's NLL) have no deterministic
    # mode without CUBLAS_WORKSPACE_CONFIG, which the library does not set: there the flag would raise
    torch.use_deterministic_algorithms(deterministic(device))
    try:
        return _run(args)
    finally:  # leave the process as we found it (the CLI may be called in-process)
        torch.set_num_threads(previous[0])
        torch.use_deterministic_algorithms(previous[1])


def _run(args: argparse.Namespace) -> int:
    from .model import CharLMConfig
    from .train import RunConfig, compare

    optimizers = _names(args.optimizers) if isinstance(args.optimizers, str) else args.optimizers
    seeds = _seeds(args.seeds) if isinstance(args.seeds, str) else args.seeds
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS[args.task])
    grid = args.lr_grid or (QUICK_LR_GRID if args.quick else DEFAULT_LR_GRID[args.task])
    model = None
    if args.task == "charlm":
        from .data import VOCAB

        model = (CharLMConfig(len(VOCAB), hidden=32, layers=2, heads=2, intermediate=88, context=32) if args.quick
                 else CharLMConfig(len(VOCAB), context=64))  # fmt: skip
    batch = args.batch or (16 if args.task == "charlm" else 64)
    cfg = RunConfig(task=args.task, steps=steps, batch=batch, update_freq=args.update_freq, model=model,
                    eval_windows=16 if args.quick else 64, device=getattr(args, "device", "cpu"))  # fmt: skip
    start = time.perf_counter()
    result = compare(cfg, optimizers, seeds, grid, progress=getattr(args, "progress", None), jobs=args.jobs)
    result["wall_s"] = time.perf_counter() - start
    result["machine"] = _machine(cfg.device)
    result["quick"] = bool(args.quick)
    result["command"] = "adadiag-ref " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("adadiag-ref") else None
    _print_table(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(_finite_or_none(result), f, indent=1)
            f.write("\n")
        print(f"results written to {args.json}")
    if args.plot:
        from .plot import plot_comparison

        plot_comparison(result, args.plot)
        print(f"loss curves written to {args.plot}")
    return 0


def _print_table(result: dict[str, Any]) -> None:
    selected = result["selected_lr"]
    print(f"{'optimizer':<14} {'lr':>7} {'seed':>5} {'final val loss':>15} {'opt ms/step':>12} {'step ms':>9}")
    for r in result["runs"]:
        mark = "" if r["lr"] == selected[r["optimizer"]] else "  (sweep)"
        print(f"{r['optimizer']:<14} {r['lr']:>7g} {r['seed']:>5} {r['final_val_loss']:>15.4f} "
              f"{r['optimizer_ms_per_step']:>12.2f} {r['step_ms']:>9.1f}{mark}")  # fmt: skip
    print("speed-up over AdamW (median over seeds, then each seed's; None: did not reach AdamW's final loss):")
    for name, value in result["speedup"].items():
        print(f"  {name:<14} {format_speedup(value)}  seeds {format_seeds(result['speedup_per_seed'][name])}")


def format_speedup(value: float | None) -> str:
    """A speed-up with three decimals (``1.040x`` and ``1.400x`` stay apart), or ``None``."""
    return "None" if value is None else f"{value:.3f}x"


def format_seeds(values: list[float | None]) -> str:
    """Each seed's speed-up (three decimals) and, with several finite ones, their range: the spread behind a median."""
    text = ", ".join("None" if v is None else f"{v:.3f}" for v in values)
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) > 1:
        text += f" (range {min(finite):.3f}-{max(finite):.3f})"
    return text
