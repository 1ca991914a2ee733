"""The embedder's MLP loop on dask (issue 47): seconds for ``--steps`` steps per optimizer, and the largest
relative difference to the same loop on NumPy (float64).

A two-layer MLP with hand-written gradients (``tanh(X W1^T) W2^T + b``, 16 samples, 5 -> 8 -> 3), every optimizer
stepped by ``ar.step`` with ``update_freq=3``.  dask arrays are lazy: ``persist`` after each step (the default)
keeps the graph one step long; ``--no-persist`` lets it grow, which is what docs/embedding.md warns about (AdamW,
50 steps: minutes instead of seconds).

Run: ``python benchmarks/embedding_dask.py [--steps 50] [--no-persist] [--kernels reference] [--names adamw]``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import dask
import dask.array as da
import numpy as np

import adadiag_ref as ar


def _grads(params: dict[str, Any], X: Any, Y: Any) -> dict[str, Any]:
    W1, W2, b = params["fc1.weight"], params["fc2.weight"], params["fc2.bias"]
    h = np.tanh(X @ W1.T) if isinstance(X, np.ndarray) else da.tanh(X @ W1.T)
    residual = (h @ W2.T + b - Y) / X.shape[0]
    dh = (residual @ W2) * (1.0 - h * h)
    return {"fc1.weight": dh.T @ X, "fc2.weight": residual.T @ h, "fc2.bias": residual.sum(axis=0)}


def run(name: str, lazy: bool, steps: int, persist: bool, kernels: str = "auto") -> tuple[float, dict[str, np.ndarray]]:
    """Seconds for ``steps`` steps and the final parameters (NumPy)."""
    rng = np.random.default_rng(47)
    data = {"X": rng.standard_normal((16, 5)), "Y": rng.standard_normal((16, 3)),
            "fc1.weight": rng.standard_normal((8, 5)) * 0.5, "fc2.weight": rng.standard_normal((3, 8)) * 0.5,
            "fc2.bias": rng.standard_normal(3) * 0.1}  # fmt: skip
    arrays = {k: da.from_array(v) if lazy else v for k, v in data.items()}
    X, Y = arrays.pop("X"), arrays.pop("Y")
    cfg = ar.make_config(name, lr=1e-2, update_freq=3, weight_decay=0.01, kernels=kernels)
    states = {k: ar.init(p, cfg) for k, p in arrays.items()}
    start = time.perf_counter()
    for _ in range(steps):
        grads = _grads(arrays, X, Y)
        for k in arrays:
            arrays[k], states[k] = ar.step(states[k], grads[k], cfg, arrays[k], name=k)
            if lazy and persist:
                arrays[k], states[k] = dask.persist(arrays[k], states[k])
    final = {k: np.asarray(v) for k, v in arrays.items()}
    return time.perf_counter() - start, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-persist", action="store_true")
    parser.add_argument("--names", nargs="*", default=list(ar.OPTIMIZERS))
    # NumPy's default (numba) kernels agree with the reference code to rounding, which Hfac's normalisation
    # amplifies to ~3e-11 over 50 steps; under "reference" both sides run the same formulas (dask: 0 difference)
    parser.add_argument("--kernels", default="auto", choices=["auto", "reference"])
    args = parser.parse_args()
    print(f"{'optimizer':<14} {'dask s':>8} {'numpy s':>8} {'max rel diff':>13}")
    for name in args.names:
        seconds, got = run(name, True, args.steps, not args.no_persist, args.kernels)
        ref_seconds, ref = run(name, False, args.steps, False, args.kernels)
        diff = max(float(np.max(np.abs(got[k] - ref[k])) / np.max(np.abs(ref[k]))) for k in ref)
        print(f"{name:<14} {seconds:8.2f} {ref_seconds:8.3f} {diff:13.2e}")


if __name__ == "__main__":
    main()
