"""The ODE targets of issue 48: a stiff-aware solver and events, timed and counted.

* ``rosenbrock``: ``ode.check`` of one system on the chained Rosenbrock problem (``2 x 3``, ``alpha = 100``) with
  DOPRI5 to a gradient tolerance (``grad_tol=1e-4``, ``t_end = 200``); target: the whole check under 10 s.
* ``hfac``: Hfac on the least-squares problem to ``T = 20``, DOPRI5 against ROS3P at the same tolerances;
  target: the implicit solver in at most a tenth of the explicit solver's steps.

CPU seconds (``time.process_time``) are quoted beside wall seconds: on a shared machine the wall clock measures
the neighbours too.  The table gives medians over ``--rounds``.  Run:
``python benchmarks/ode_targets.py [--rounds 3] [--systems adam,adadiag] [--skip-hfac]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from adadiag_ref import ode


def timed_check(*args: object, **kwargs: object) -> tuple[ode.CheckResult, float, float]:
    """``ode.check(*args, **kwargs)`` with its CPU and wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = ode.check(*args, **kwargs)  # type: ignore[arg-type]
    return result, time.process_time() - cpu, time.perf_counter() - wall


def rosenbrock(systems: list[str], rounds: int) -> None:
    problem = ode.rosenbrock_problem(2, 3)
    print("Rosenbrock 2x3, DOPRI5, grad_tol 1e-4 (t_end 200): median over rounds")
    print(f"{'system':14} {'verdict':10} {'t_final':>8} {'steps':>7} {'cpu s':>7} {'wall s':>7}")
    for name in systems:
        runs = [timed_check(ode.make_system(name), problem, "dopri5", 200.0, grad_tol=1e-4) for _ in range(rounds)]
        result = runs[0][0]
        cpu = statistics.median(r[1] for r in runs)
        wall = statistics.median(r[2] for r in runs)
        print(f"{name:14} {result.verdict:10} {result.t_final:8.2f} {result.n_steps:7d} {cpu:7.2f} {wall:7.2f}")


def hfac() -> None:
    system, problem = ode.make_system("hfac"), ode.least_squares_problem()
    print("Hfac, least squares 3x4, T = 20, rtol 1e-8, atol 1e-10")
    rows = {name: timed_check(system, problem, name, 20.0) for name in ("dopri5", "ros3p")}
    for name, (result, cpu, wall) in rows.items():
        print(
            f"{name:8} {result.verdict:10} steps {result.n_steps:6d} evals {result.n_evals:7d} "
            f"cpu {cpu:6.2f} s wall {wall:6.2f} s"
        )
    ratio = rows["ros3p"][0].n_steps / rows["dopri5"][0].n_steps
    print(f"steps ratio ros3p / dopri5: {ratio:.3f} (target <= 0.1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", default="adam,adadiag")
    parser.add_argument("--skip-hfac", action="store_true")
    args = parser.parse_args()
    rosenbrock(args.systems.split(","), args.rounds)
    if not args.skip_hfac:
        print()
        hfac()


if __name__ == "__main__":
    main()
