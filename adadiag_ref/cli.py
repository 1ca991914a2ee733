"""The ``adadiag-ref`` command.

Subcommands: ``report`` (the main job), and, where the modules are present,
``ode``, ``golden``, ``replay``, ``bench`` and ``memory``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# modules that contribute subcommands through add_parser(subparsers)
_SUBCOMMAND_MODULES = (
    "adadiag_ref.ode.cli",
    "adadiag_ref.golden.cli",
    "adadiag_ref.perf.cli",
    "adadiag_ref.reproduce.cli",
)


def _report(args: argparse.Namespace) -> int:
    from .report import golden_summary, memory_summary, plot_curves, run_report

    rows = run_report(steps=args.steps, backends=args.backend or None)
    if args.plot:
        plot_curves(rows, args.plot)
        print(f"loss curves written to {args.plot}")
    print()
    ok = golden_summary()
    print()
    memory_summary()
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adadiag-ref",
        description="Reference implementation of AdaDiag, AdaDiag++, AdafacDiag, HfacDiag and their baselines.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="run every optimizer on a small matrix problem, per installed backend")
    report.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    report.add_argument(
        "--backend", action="append", choices=["numpy", "torch", "jax", "cupy"], help="restrict to backend(s)"
    )
    report.add_argument("--plot", metavar="PNG", help="also draw the loss curves (needs matplotlib)")
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
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
