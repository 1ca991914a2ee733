"""Where a batched refresh spends its time on a CUDA device: one ``ar.refresh_bases`` call over LLaMA-60M's 56
block matrices (float32, ``sigma_i = 1/i``, as ``bench --gpu``'s refresh rows) under ``cProfile``, with the device
synchronised around it, against the bare float64 ``eigh`` of the Gram stack (the issue 31 target: at most 2x).

Run on demand on a GPU machine (``scripts/device-check.sh`` runs it), or on the CPU with ``--xp torch`` or
``--xp numpy`` (other code paths: torch CPU goes through NumPy for the canonical rules)::

    python benchmarks/gpu_refresh_profile.py [--xp cupy|torch|numpy] [--top 25]

The H100 run of 2026-11-26 measured the batched ``auto`` refresh at 1028 ms against 255 ms for the bare
float64 ``eigh`` (docs/performance.md, "The GPU path"); this script says where the other ~770 ms go.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import adadiag_ref as ar
from adadiag_ref.memory import LLAMA_CONFIGS, llama_parameters
from adadiag_ref.perf.params import gradient_with_spectrum, is_rotated


def backend(name: str) -> tuple[Callable[[np.ndarray], Any], Callable[[], None], Any]:
    """``(to_device, synchronise, namespace)`` of ``name``."""
    if name == "cupy":
        import cupy

        return cupy.asarray, cupy.cuda.Device().synchronize, cupy
    if name == "torch":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        return (lambda a: torch.from_numpy(a).to(device)), sync, torch
    return (lambda a: a), (lambda: None), np


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--xp", default="cupy", choices=["cupy", "torch", "numpy"])
    parser.add_argument("--method", default="auto", choices=["auto", "gram", "svd"])
    parser.add_argument("--top", type=int, default=25, help="functions listed, by cumulative time")
    args = parser.parse_args(argv)
    to_device, sync, xp = backend(args.xp)
    specs = [s for s in llama_parameters(LLAMA_CONFIGS["llama-60m"]) if is_rotated(s, "paper")]
    rng = np.random.default_rng(5)
    grads = [to_device(gradient_with_spectrum(s.shape, "decaying", rng)) for s in specs]
    cfg = ar.make_config("adadiag", basis_method=args.method)
    states = [ar.init(g, cfg) for g in grads]

    def refresh() -> None:
        ar.refresh_bases(states, grads, cfg, count=0)
        sync()

    refresh()  # warm-up: handles, kernels compiled
    start = time.perf_counter()
    refresh()
    total = time.perf_counter() - start
    frames = [g if g.shape[0] <= g.shape[1] else g.T for g in grads]
    by_m: dict[int, list[Any]] = {}
    for g in frames:
        g64 = g.astype(np.float64) if args.xp != "torch" else g.double()
        by_m.setdefault(int(g.shape[0]), []).append(g64 @ g64.T)
    stacks = [xp.stack(v) for v in by_m.values()]
    [xp.linalg.eigh(a) for a in stacks]
    sync()
    start = time.perf_counter()
    [xp.linalg.eigh(a) for a in stacks]
    sync()
    bare = time.perf_counter() - start
    print(f"{args.xp}: refresh_bases ({args.method}) of {len(grads)} matrices {1e3 * total:.1f} ms; bare float64 "
          f"eigh of the Gram stack {1e3 * bare:.1f} ms; ratio {total / bare:.2f} (target <= 2)")  # fmt: skip
    profile = cProfile.Profile()
    profile.enable()
    refresh()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
