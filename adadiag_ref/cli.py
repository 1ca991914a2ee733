"""The ``adadiag-ref`` command.

Subcommands: ``report`` (the main job), and, where the modules are present,
``ode``, ``golden``, ``replay``, ``bench`` and ``memory``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from . import __version__
from ._cli import ErrorParser, add_progress_flags, parse_and_run

# modules that contribute subcommands through add_parser(subparsers)
_SUBCOMMAND_MODULES = (
    "adadiag_ref.ode.cli",
    "adadiag_ref.golden.cli",
    "adadiag_ref.golden.conform",
    "adadiag_ref.perf.cli",
    "adadiag_ref.reproduce.cli",
)


def _report(args: argparse.Namespace) -> int:
    from .report import (
        check_options,
        golden_summary,
        memory_summary,
        ode_plot_path,
        ode_summary,
        plot_curves,
        plot_ode,
        run_report,
    )

    try:  # every option is checked before the run, not after it
        check_options(args.steps, args.plot, ode=not args.no_ode, backends=args.backend)
    except ValueError as exc:
        print(f"adadiag-ref: error: {exc}", file=sys.stderr)
        return 2
    rows = run_report(steps=args.steps, backends=args.backend or None, progress=args.progress)
    if not rows:  # e.g. cupy installed but no GPU
        print("adadiag-ref: error: none of the requested backends could run here", file=sys.stderr)
        return 2
    if args.plot:
        plot_curves(rows, args.plot)
        print(f"loss curves, every backend, refreshes marked: {args.plot}")
    if not args.no_ode:
        print()
        ode_rows = ode_summary(progress=args.progress)
        if args.plot:
            plot_ode(ode_rows, ode_plot_path(args.plot))
            print(f"Hamiltonian along every ODE: {ode_plot_path(args.plot)}")
    print()
    ok = golden_summary(progress=args.progress)
    print()
    memory_summary()
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = ErrorParser(
        prog="adadiag-ref",
        description="Reference implementation of AdaDiag, AdaDiag++, AdafacDiag, HfacDiag and their baselines.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="run every optimizer on a small matrix problem, per installed backend")
    report.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    report.add_argument(
        "--backend",
        action="append",
        choices=["numpy", "torch", "jax", "array_api_strict", "cupy"],
        help="restrict to backend(s) (repeatable; default: every installed one)",
    )
    report.add_argument(
        "--plot", metavar="PNG", help="draw the loss curves of every backend to PNG and the ODE's H(t) to PNG-ode.png"
    )
    report.add_argument("--no-ode", action="store_true", help="skip the ODE (Hamiltonian) section")
    add_progress_flags(report)
    report.set_defaults(func=_report)
    for module_name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # that part of the library is not present
            raise
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand.  Usage and input errors: one line ``adadiag-ref: error: ...`` on stderr, exit 2."""
    return parse_and_run(build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
