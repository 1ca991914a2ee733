"""``ar.Engine`` over CPU torch tensors against torch's fused AdamW on the same tensors, in one run.

Run on demand::

    python benchmarks/engine_torch_cpu.py [--model llama-60m] [--threads 2] [--reps 7]

LLaMA's parameter set, float32, one steady step without refresh (``update_freq=None``, warmed up): the median step
time of

* ``ar.Engine`` AdamW over every parameter (the numba group kernels over the tensors' own memory, cut over torch's
  threads) and ``torch.optim.AdamW(fused=True)``, with their ratio;
* ``ar.Engine`` AdaDiag over the transformer blocks' matrices (the paper's rule: per-matrix ``torch.mm`` rotations,
  the reference direction over the flat group, the tail kernel).

The CHANGELOG (issue 44) quotes a run: AdamW 805 ms before the engine ran its group kernels on torch, 31 ms after.
"""

from __future__ import annotations

import argparse

import torch

import adadiag_ref as ar
from adadiag_ref.memory import LLAMA_CONFIGS, llama_parameters
from adadiag_ref.perf.bench import median_time
from adadiag_ref.perf.params import is_rotated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-60m", choices=sorted(LLAMA_CONFIGS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    specs = llama_parameters(LLAMA_CONFIGS[args.model])
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s.shape, generator=gen) for s in specs]
    grads = [torch.randn(s.shape, generator=gen) for s in specs]

    engine = ar.Engine(params, ar.make_config("adamw", lr=1e-3, update_freq=None))
    t_engine = median_time(lambda: engine.step(grads, params), args.reps, warmup=2)
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    for leaf, g in zip(leaves, grads, strict=True):
        leaf.grad = g
    fused = torch.optim.AdamW(leaves, lr=1e-3, weight_decay=0.0, fused=True)
    t_fused = median_time(fused.step, args.reps, warmup=2)

    rotated = [i for i, s in enumerate(specs) if is_rotated(s, "paper")]
    blocks = [params[i] for i in rotated]
    block_grads = [grads[i] for i in rotated]
    adadiag = ar.Engine(blocks, ar.make_config("adadiag", lr=1e-3, update_freq=None))
    t_adadiag = median_time(lambda: adadiag.step(block_grads, blocks), max(3, args.reps // 2), warmup=2)

    print(f"{args.model}, float32, {args.threads} torch threads, median of {args.reps} steps")
    print(f"ar.Engine AdamW (every parameter)      {t_engine * 1e3:8.1f} ms")
    print(f"torch fused AdamW (same tensors)       {t_fused * 1e3:8.1f} ms   ratio {t_engine / t_fused:.2f}")
    print(f"ar.Engine AdaDiag ({len(blocks)} block matrices)   {t_adadiag * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
