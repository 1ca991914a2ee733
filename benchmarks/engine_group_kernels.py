"""The engine's group kernels on NumPy: AdamW over LLaMA-60M's 75 parameters (float32), one step without refresh,
stepped in place by the Adam family's multi-tensor kernels (no gather of ``G`` or ``W``, no write-back) against
the gathering path the engine took before (both concatenations, the fused update, ``W + delta``, the write-back),
in one process, alternated, the median of each and of the per-round ratios.  Both give the same bits
(``tests/test_optim_engine.py``).  Run on demand::

    python benchmarks/engine_group_kernels.py [--rounds 9] [--threads 1] [--optimizer adadiag]

``--optimizer adadiag`` (a rotated optimizer, no refresh after the first step): the kernels write the tail only
(``W <- W + (-eta)(D + lambda W)`` from the flat direction), so ``W`` is neither gathered nor written back; ``G``
is still gathered for the batched GEMMs.

Array passes per entry, counted from the code (reads + writes of an ``N``-entry array):

* group kernels: 7 (read ``G, W, M, V``; write ``W, M, V``) + 1 with ``check=True`` (the NaN/Inf count reads
  ``G``);
* gathering path: 2 + 2 (gather ``G``, ``W``) + 7 (the fused update reads ``G, W, M, V``, writes ``M, V,
  delta``) + 3 (``W + delta``) + 2 (the write-back) = 16, + 1 with ``check=True`` (the sum of the gathered ``G``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per round and path (median taken)")
    parser.add_argument("--threads", type=int, default=None, help="numba threads (default: all)")
    parser.add_argument("--model", default="llama-60m")
    parser.add_argument("--optimizer", default="adamw", help="adamw, or a rotated one (its tail by the kernels)")
    args = parser.parse_args()
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")  # as adadiag-ref bench: the parallel kernels
    import numba

    import adadiag_ref as ar
    from adadiag_ref.memory import llama_parameters

    if args.threads is not None:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shapes = [p.shape for p in llama_parameters(args.model)]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    cfg = ar.make_config(args.optimizer, weight_decay=0.1, update_freq=None)
    engines: dict[str, tuple[Any, list[np.ndarray]]] = {}
    for path in ("group kernels", "gathering"):
        params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        engine = ar.Engine(params, cfg)
        if path == "gathering":
            for group in engine._flat:
                group.kernels = None
        engine.step(grads, params)  # warm-up: compilation, first touch of the pages
        engines[path] = (engine, params)
    entries = sum(int(np.prod(s)) for s in shapes)
    print(
        f"{args.model} {args.optimizer}: {len(shapes)} parameters, {entries / 1e6:.1f} M entries, float32, numba "
        f"threads {numba.get_num_threads()} ({numba.config.THREADING_LAYER}); {args.rounds} rounds x {args.steps} steps"
    )
    print(engines["group kernels"][0].routes()[0].entrywise)
    times: dict[str, list[float]] = {p: [] for p in engines}
    ratios = []
    for _ in range(args.rounds):
        row = {}
        for path, (engine, params) in engines.items():
            samples = []
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step(grads, params)
                samples.append(time.perf_counter() - start)
            row[path] = statistics.median(samples)
            times[path].append(row[path])
        ratios.append(row["group kernels"] / row["gathering"])
    for path, t in times.items():
        print(f"{path:14s} median {1e3 * statistics.median(t):7.1f} ms  (rounds {1e3 * min(t):.1f}-{1e3 * max(t):.1f})")
    print(
        f"group kernels / gathering: median of per-round ratios {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
