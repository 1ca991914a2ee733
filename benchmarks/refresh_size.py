"""Refresh time per side length: the measurement behind the default ``max_basis_dim`` (docs/reliability.md).

For each side ``n`` and dtype, times one basis refresh of an ``n x n`` Gaussian
gradient: ``canonical_svd(G)`` with ``P`` only (one-sided) and with ``P`` and ``Q``
(two-sided), best of ``--repeat`` runs, and fits ``t = c n^3`` to the largest
sizes to extrapolate.  Run: ``python benchmarks/refresh_size.py [--sides 256 512 ...]``.
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
    parser.add_argument("--sides", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for dtype in (np.float32, np.float64):
        for n in args.sides:
            for two_sided in (False, True):
                repeat = args.repeat if n <= 2048 else 1
                seconds = time_refresh(n, dtype, two_sided, repeat)
                row = {"n": n, "dtype": np.dtype(dtype).name, "two_sided": two_sided, "seconds": round(seconds, 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for dtype in ("float32", "float64"):
        for two_sided in (False, True):
            sel = [r for r in rows if r["dtype"] == dtype and r["two_sided"] == two_sided]
            big = max(sel, key=lambda r: r["n"])
            c = big["seconds"] / big["n"] ** 3
            print(json.dumps({"dtype": dtype, "two_sided": two_sided, "c_per_n3": c, "t_8192_s": c * 8192**3}))


if __name__ == "__main__":
    main()
