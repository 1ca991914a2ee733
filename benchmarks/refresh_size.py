"""Refresh time per side length: the measurement behind the default ``max_basis_dim`` (docs/reliability.md).

For each side ``n`` and dtype, times one basis refresh of an ``n x n`` Gaussian
gradient: ``canonical_svd(G)`` with ``P`` only (one-sided) and with ``P`` and ``Q``
(two-sided), best of ``--repeat`` runs, and fits ``t = c n^3`` to the largest
sizes to extrapolate (least squares over the sides >= 1024: ``c = sum t n^3 / sum n^6``).
Run: ``python benchmarks/refresh_size.py [--sides 256 512 ...] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from adadiag_ref.linalg import canonical_svd


def time_refresh(n: int, dtype: type, two_sided: bool, repeat: int) -> float:
    rng = np.random.default_rng(n)
    G = rng.standard_normal((n, n)).astype(dtype)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        canonical_svd(G, compute_p=True, compute_q=two_sided)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sides", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    parser.add_argument("--json", help="also write the rows and fits to this file")
    args = parser.parse_args()
    rows = []
    for dtype in (np.dtype(d).type for d in args.dtypes):
        for n in args.sides:
            for two_sided in (False, True):
                repeat = args.repeat if n <= 2048 else 1  # best of ``repeat``: the least disturbed run
                seconds = time_refresh(n, dtype, two_sided, repeat)
                row = {"n": n, "dtype": np.dtype(dtype).name, "two_sided": two_sided, "seconds": round(seconds, 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    fits = []
    for dtype in args.dtypes:
        for two_sided in (False, True):
            sel = [r for r in rows if r["dtype"] == dtype and r["two_sided"] == two_sided]
            big = [r for r in sel if r["n"] >= 1024] or [max(sel, key=lambda r: r["n"])]
            # least squares for t = c n^3 (the O(n^3) SVD dominates at these sides)
            c = sum(r["seconds"] * r["n"] ** 3 for r in big) / sum(r["n"] ** 6 for r in big)
            fit = {"dtype": dtype, "two_sided": two_sided, "c_per_n3": c}
            fit.update({f"t_{n}_s": round(c * n**3, 1) for n in (4096, 8192, 10000)})
            fits.append(fit)
            print(json.dumps(fit), flush=True)
        # An n x n gradient: P only and P and Q run the same thin SVD, so both columns measure one cost.
        big = [r for r in rows if r["dtype"] == dtype and r["n"] >= 1024]
        if big:
            c = sum(r["seconds"] * r["n"] ** 3 for r in big) / sum(r["n"] ** 6 for r in big)
            fit = {"dtype": dtype, "two_sided": "pooled", "c_per_n3": c}
            fit.update({f"t_{n}_s": round(c * n**3, 1) for n in (1024, 2048, 4096, 8192, 10000, 16384)})
            fits.append(fit)
            print(json.dumps(fit), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "fits": fits}, out, indent=1)


if __name__ == "__main__":
    main()
