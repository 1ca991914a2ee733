"""``adadiag-ref ode``: integrate one optimizer's ODE on one problem and print a verdict.

::

    adadiag-ref ode --optimizer NAME --problem NAME --integrator NAME --t-end X [--json] [--plot out.png]
    adadiag-ref ode --optimizer NAME --discrete-limit [--hs 0.02,0.01,0.005] [--no-bias-correction] [--plot out.png]

``--discrete-limit`` runs :func:`~.discrete.discrete_limit` instead of :func:`~.checks.check`.  ``--import MODULE``
imports a module first (one that registers a family: its optimizers are then accepted by ``--optimizer``).

The main ``adadiag-ref`` command registers this subcommand with :func:`add_parser`;
``python -m adadiag_ref.ode.cli ...`` runs it on its own (:func:`main`).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from .._cli import (
    ErrorParser,
    add_progress_flags,
    fail,
    finite_nonnegative,
    finite_positive,
    int_at_least,
    parse_and_run,
    plot_file,
    positive_int,
)
from .checks import CheckResult, check
from .discrete import DiscreteLimit
from .problems import PROBLEMS, make_problem
from .solvers import SOLVERS
from .systems import ALIASES, SYSTEMS, make_system, systems

__all__ = ["add_parser", "build_parser", "format_discrete_limit", "format_report", "main", "run", "run_discrete_limit"]

_INTEGRATOR_CHOICES = [*SOLVERS, "sie", "dp5"]


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(func=run)
    # no argparse choices: a family registered at run time (--import) is known only when run() starts
    parser.add_argument(
        "--optimizer",
        required=True,
        help=f"which optimizer's ODE: {', '.join([*SYSTEMS, *ALIASES])} or a registered one",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        metavar="MODULE",
        action="append",
        default=[],
        help="import this module first (repeatable), e.g. one that registers a family with a Flow",
    )
    parser.add_argument("--problem", default="least_squares", choices=list(PROBLEMS), help="test problem")
    parser.add_argument("--integrator", default="dopri5", choices=_INTEGRATOR_CHOICES, help="time integrator")
    parser.add_argument("--t-end", type=finite_positive, default=10.0, help="final ODE time T (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument(
        "--trajectory",
        action="store_true",
        help="with --json: include the trajectory (t, H, L, ||grad L||, dH/dt at every saved state, step sizes)",
    )
    parser.add_argument(
        "--plot", metavar="PATH", type=plot_file, help="draw H(t) and ||grad L||(t) to this image (needs matplotlib)"
    )
    group = parser.add_argument_group("integration")
    group.add_argument(
        "--dt",
        type=finite_positive,
        help="fixed step (Euler types, rk4; default T/2000 or T/200); first step of dopri5, ros3p (default: automatic)",
    )
    group.add_argument("--rtol", type=finite_positive, default=1e-8, help="dopri5/ros3p relative tolerance (1e-8)")
    group.add_argument("--atol", type=finite_positive, default=1e-10, help="dopri5/ros3p absolute tolerance (1e-10)")
    group.add_argument("--max-steps", type=positive_int, default=1_000_000, help="give up after this many steps")
    group.add_argument("--order", action="store_true", help="also measure the observed order against DOP853")
    group.add_argument("--grad-tol", type=finite_positive, help="stop once ||grad L|| <= this (an event)")
    group.add_argument("--loss-threshold", type=float, help="stop once L <= this (an event)")
    add_progress_flags(group)
    limit = parser.add_argument_group("discrete limit (ode.discrete_limit)")
    limit.add_argument(
        "--discrete-limit",
        action="store_true",
        help="run the core optimizer at each --hs (lr = h, betas = 1 - a h, 1 - b h) against the flow; fit the order",
    )
    limit.add_argument("--hs", type=_step_sizes, default=(0.02, 0.01, 0.005, 0.0025), help="step sizes h, commas")
    limit.add_argument(
        "--no-bias-correction", action="store_true", help="the optimizer without bias correction (autonomous flow)"
    )
    sysg = parser.add_argument_group("system")
    sysg.add_argument("--a", type=finite_nonnegative, default=1.0, help="first-moment rate a (1 - beta1 = a * lr)")
    sysg.add_argument("--b", type=finite_nonnegative, default=1.0, help="second-moment rate b (1 - beta2 = b * lr)")
    sysg.add_argument("--eps", type=finite_nonnegative, help="smoothing term (default: the paper's, 1e-8 or 1e-30)")
    sysg.add_argument("--weight-decay", type=finite_nonnegative, default=0.0, help="decoupled weight decay lambda")
    sysg.add_argument("--clip-threshold", type=finite_positive, help="clipping threshold d (Adafactor, Hfac)")
    sysg.add_argument("--momentum-form", choices=["gradient", "update", "none"], help="Adafactor family: which ODE")
    sysg.add_argument("--normalization", choices=["paper", "algorithm"], help="Hfac family: sqrt(r) or sqrt(r/n)")
    sysg.add_argument("--momentum-scale", type=finite_nonnegative, help="Hfac family: factor c of phi and psi")
    sysg.add_argument("--refresh-every", type=finite_positive, help="refresh the basis every T time units")
    sysg.add_argument("--moments", choices=["gradient", "zero"], default="gradient", help="initial moments")
    sysg.add_argument("--floor", type=finite_nonnegative, default=1e-4, help="relative floor of initial second moments")
    sysg.add_argument("--seed", type=int_at_least(0), default=0, help="problem data seed (an integer >= 0)")


def _step_sizes(text: str) -> tuple[float, ...]:
    """argparse ``type=`` of ``--hs``: at least two comma-separated finite numbers > 0."""
    values = tuple(finite_positive(part) for part in text.split(",") if part.strip())
    if len(values) < 2:
        raise argparse.ArgumentTypeError(f"expected at least two step sizes separated by commas, got {text!r}")
    return values


def build_parser(prog: str = "adadiag-ref ode") -> argparse.ArgumentParser:
    """A standalone parser for the ``ode`` subcommand."""
    parser = ErrorParser(prog=prog, description=__doc__.split("\n")[0] if __doc__ else None)
    _configure(parser)
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ode`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``); sets ``func=run``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "ode",
        help="integrate an optimizer's ODE and check its Hamiltonian",
        description="Integrate one optimizer's continuous-time form on a test problem and check dH/dt <= 0.",
    )
    _configure(parser)
    return parser


def _system_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"a": args.a, "b": args.b, "weight_decay": args.weight_decay}
    for name in ("eps", "clip_threshold", "momentum_form", "normalization", "momentum_scale"):
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    return options


def _problem_options(name: str, seed: int) -> dict[str, Any]:
    accepted = inspect.signature(PROBLEMS[name]).parameters
    return {"seed": seed} if "seed" in accepted else {}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _invariants_text(result: CheckResult) -> str:
    if result.invariants_ok:
        return "ok"
    return "VIOLATED" if math.isfinite(result.h_end) else "VIOLATED (a state is not finite)"


def format_report(result: CheckResult, system_text: str, problem_text: str, total_time: float) -> str:
    """The human-readable report printed by ``adadiag-ref ode``."""
    lines = [
        f"adadiag-ref ode: {system_text} on {problem_text}, {result.integrator}, t in [0, {result.t_end:g}]",
        f"  verdict: {result.verdict.upper()} - {result.message}",
        f"  H(0) = {result.h0:.6g}   H(T) = {result.h_end:.6g}   L(T) = {result.loss_end:.6g}"
        + (f"   L* = {result.optimal_value:.6g}" if result.optimal_value is not None else ""),
        f"  largest H increase over a step: {result.max_h_increase:.3g} (relative {result.max_h_increase_rel:.3g})"
        + (
            f" at t = {result.t_max_h_increase:.4g}; local error estimate {result.local_error_estimate:.3g}"
            if result.max_h_increase > 0
            else ""
        ),
        f"  largest dH/dt on the trajectory: {result.max_dhdt:.3g} at t = {result.t_max_dhdt:.4g}",
        f"  energy balance: H(0) - H(T) = {result.energy_drop:.6g}, int -dH/dt = {result.energy_integral:.6g}, "
        f"residual {result.energy_residual:.2g} (relative {result.energy_residual_rel:.2g}, "
        f"tolerance {result.energy_tolerance:g})",
        f"  closed-form dH/dt vs finite differences of H: largest relative gap {result.rate_fd_error:.2g}"
        + (f" at t = {result.t_rate_fd_error:.4g}" if math.isfinite(result.rate_fd_error) else ""),
        f"  ||grad L||: {result.grad_norm0:.4g} -> {result.grad_norm_end:.4g} "
        f"(largest on the last 10%: {result.grad_norm_tail:.4g})",
        f"  invariants V, r, s >= 0: {_invariants_text(result)} (min {_fmt(result.min_second_moment)})",
        f"  well posed at t = 0: {'yes' if result.well_posed else 'NO'}",
    ]
    lines += [f"    note: {note}" for note in result.notes]
    if result.observed_order is not None:
        errs = ", ".join(f"{e:.2e}" for e in result.order_errors)
        fit = result.order_fit_range
        lines.append(
            f"  observed order: {result.observed_order:.3f} (errors {errs} vs DOP853; fitted over dt = "
            f"{fit[0]:.3g} .. {fit[-1]:.3g}"
            + (f"; refused dt = {', '.join(f'{d:.3g}' for d in result.order_refused)}" if result.order_refused else "")
            + ")"
        )
    lines += [f"  runtime warning (collected): {text}" for text in result.runtime_warnings]
    lines.append(
        f"  steps: {result.n_steps} accepted, {result.n_rejected} rejected, {result.n_evals} evaluations; "
        f"integration {result.wall_time:.3g} s, total {total_time:.3g} s"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Execute ``adadiag-ref ode`` for parsed ``args``.

    Exit status: 0 when the integration reached ``T`` (whatever the verdict), 1 when it
    stopped early, 2 for invalid options, 3 when the initial state is ill posed.
    """
    start = time.perf_counter()
    try:
        for module in args.imports:
            importlib.import_module(module)
    except ImportError as exc:
        return fail(f"ode: --import: {exc}")
    if ALIASES.get(args.optimizer, args.optimizer) not in systems():  # checked here: --import may register one
        try:
            make_system(args.optimizer)
        except ValueError as exc:
            return fail(f"ode: --optimizer: {exc}")
    if args.discrete_limit:
        return run_discrete_limit(args)
    try:
        system = make_system(args.optimizer, **_system_options(args))
        problem = make_problem(args.problem, **_problem_options(args.problem, args.seed))
    except ValueError as exc:
        return fail(f"ode: {exc}")
    result = check(
        system,
        problem,
        args.integrator,
        args.t_end,
        dt=args.dt,
        rtol=args.rtol,
        atol=args.atol,
        refresh_period=args.refresh_every,
        moments=args.moments,
        floor=args.floor,
        order=args.order,
        progress=args.progress,
        max_steps=args.max_steps,
        grad_tol=args.grad_tol,
        loss_threshold=args.loss_threshold,
    )
    plot_path = None
    if args.plot and result.trajectory is not None:
        from .plotting import plot_check

        try:
            plot_path = plot_check(result, args.plot)
        except RuntimeError as exc:
            return fail(f"ode: {exc}")
    total = time.perf_counter() - start
    described = system.describe()
    _print_result(
        args.json,
        lambda: {**result.to_dict(trajectory=args.trajectory), "system_description": described,
                 "problem_description": problem.description, "total_time": total},
        lambda: format_report(result, described, problem.description or problem.name, total),
        plot_path,
    )  # fmt: skip
    return 0 if result.status in ("success", "event") else 1 if result.status != "ill_posed" else 3


def _print_result(
    as_json: bool, payload: Callable[[], dict[str, Any]], report: Callable[[], str], plot_path: str | None
) -> None:
    """``payload()`` as one JSON object (``--json``), else the human-readable ``report()``: only the printed one is
    built (the trajectory's JSON can be long); either names the plot."""
    if as_json:
        print(json.dumps({**payload(), "plot": plot_path} if plot_path else payload(), indent=2, sort_keys=True))
    else:
        print(f"{report()}\n  plot: {plot_path}" if plot_path else report())


def _core_options(args: argparse.Namespace) -> dict[str, Any]:
    """The config options of ``--discrete-limit``'s optimizer from the system flags that the core shares."""
    options: dict[str, Any] = {"weight_decay": args.weight_decay}
    if args.eps is not None:
        options["eps"] = args.eps
    if args.clip_threshold is not None:
        options["clip_threshold"] = args.clip_threshold
    if args.momentum_form == "none":
        options["momentum"] = False
    return options


def format_discrete_limit(result: DiscreteLimit, problem_text: str) -> str:
    """The human-readable report of ``adadiag-ref ode --discrete-limit``."""
    refresh = "never" if result.refresh_period is None else f"every {result.refresh_period:g}"
    lines = [
        f"adadiag-ref ode --discrete-limit: {result.optimizer} -> {result.system.describe()} on {problem_text}",
        f"  T = {result.t_end:g}, basis refresh {refresh}, bias correction {'on' if result.bias_correction else 'off'};"
        f" flow by DOPRI5 at rtol 1e-12 ({result.flow_steps} steps)",
        "  h           max |W_h(T) - W(T)|   local order",
    ]
    for k, (h, error) in enumerate(zip(result.hs, result.errors, strict=True)):
        local = f"{result.local_orders[k - 1]:.3f}" if k else ""
        lines.append(f"  {h:<10.4g}  {error:<20.4g}  {local}")
    lines.append(f"  fitted order: {result.order:.3f} (least squares over h = {result.hs[-1]:g} .. {result.hs[0]:g})")
    return "\n".join(lines)


def run_discrete_limit(args: argparse.Namespace) -> int:
    """``adadiag-ref ode --discrete-limit``: :func:`~.discrete.discrete_limit` with the parsed options."""
    from .discrete import discrete_limit

    try:
        problem = make_problem(args.problem, **_problem_options(args.problem, args.seed))
        result = discrete_limit(
            args.optimizer,
            problem,
            t_end=args.t_end,
            hs=args.hs,
            a=args.a,
            b=args.b,
            refresh_period=args.refresh_every,
            bias_correction=not args.no_bias_correction,
            floor=args.floor,
            **_core_options(args),
        )
    except (ValueError, FloatingPointError, RuntimeError) as exc:
        return fail(f"ode: {exc}")
    plot_path = None
    if args.plot:
        from .plotting import plot_discrete_limit

        plot_path = plot_discrete_limit(result, args.plot)
    report = functools.partial(format_discrete_limit, result, problem.description or problem.name)
    _print_result(args.json, result.to_dict, report, plot_path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m adadiag_ref.ode.cli ARGS``: parse ``argv`` and :func:`run`."""
    return parse_and_run(build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
