"""Two-sided refresh (AdaDiag++): the reference canonicalisation loop against the fast steps, and its share at T.

For each LLaMA-60M work shape and dtype, times ``ar.refresh_basis`` of ``adadiag_pp`` (``P`` and the full
``n x n`` ``Q``) with ``basis_method="svd"`` (the reference loop completes ``Q``'s ``n - m`` null-space columns
by rebuilding an ``n x n`` residual per column) and ``"auto"`` (the default: the same canonical rules by the
projector's pivoted Cholesky), in alternation, median of ``--reps``; and one functional ``ar.update`` step of
the same parameter.  Prints, from the same run: the speed-up, the refresh's amortised share of the optimizer's
time at ``T`` (``(t_refresh / T) / (t_step + t_refresh / T)``; the paper claims under 10 % at T = 200) and the
largest difference between the two routes' bases.

Run: ``python benchmarks/two_sided_refresh.py [--reps 3] [--period 200] [--dtypes float32 float64]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

import adadiag_ref as ar

SHAPES = [(512, 512), (512, 1376), (1376, 512)]


def _median_seconds(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall time of each zero-argument function, called in alternation after one warm-up call each."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(shape: tuple[int, int], dtype: str, reps: int, period: int) -> dict[str, float]:
    """One row of the table: both routes' refresh times, the step time, the shares at ``period`` and ``max |dQ|``."""
    rng = np.random.default_rng(shape[0] + shape[1])
    G = rng.standard_normal(shape).astype(dtype)
    W = rng.standard_normal(shape).astype(dtype)
    cfgs = {method: ar.make_config("adadiag_pp", basis_method=method) for method in ("svd", "auto")}
    states = {method: ar.init(W, cfg) for method, cfg in cfgs.items()}
    refreshed = {method: ar.refresh_basis(states[method], G, cfg) for method, cfg in cfgs.items()}
    times = _median_seconds({m: partial(ar.refresh_basis, states[m], G, cfgs[m]) for m in cfgs}, reps)
    step = _median_seconds({"step": partial(ar.update, refreshed["auto"], G, cfgs["auto"], W)}, 5)["step"]
    row = {f"{m}_s": t for m, t in times.items()} | {"step_s": step}
    row |= {f"share_{m}": (t / period) / (step + t / period) for m, t in times.items()}
    row["max_dq"] = float(np.max(np.abs(refreshed["auto"].Q - refreshed["svd"].Q)))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--period", type=int, default=200, help="T, the refresh period")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    args = parser.parse_args()
    print(f"{'shape':>11s} {'dtype':>8s} {'svd s':>8s} {'auto s':>8s} {'speed-up':>9s} {'step ms':>8s} "
          f"{'share svd':>10s} {'share auto':>11s} {'max |dQ|':>9s}")  # fmt: skip
    for dtype in args.dtypes:
        for shape in SHAPES:
            r = measure(shape, dtype, args.reps, args.period)
            print(f"{'x'.join(map(str, shape)):>11s} {dtype:>8s} {r['svd_s']:8.2f} {r['auto_s']:8.3f} "
                  f"{r['svd_s'] / r['auto_s']:8.1f}x {r['step_s'] * 1e3:8.1f} {r['share_svd']:10.1%} "
                  f"{r['share_auto']:11.1%} {r['max_dq']:9.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
