"""The torch adapter's step under a scheduler that moves ``betas`` and ``weight_decay`` at every step, against the
same step with them constant, in one run.

Run on demand::

    python benchmarks/scheduled_hyperparameters.py [--threads 1] [--rounds 15]

Two copies of one model (twelve 512 x 512 matrices and six vectors, float32, no refresh after the first step) per
optimizer (``AdamW``, ``AdaDiag``); round by round one copy steps with constant hyperparameters, the other after
setting ``param_groups[0]["betas"]`` and ``["weight_decay"]`` anew, as OneCycleLR's ``cycle_momentum`` and a decay
schedule do.  Prints the median of the per-round ratios (scheduled / constant): the group kernels take a step's own
betas and weight decay as their scalars, so about 1 (before, such a step gathered: AdamW 10x, AdaDiag 1.9x).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from adadiag_ref.adapters.pytorch import AdaDiag, AdamW, CoreOptimizer


def _copy(cls: type[CoreOptimizer]) -> CoreOptimizer:
    gen = torch.Generator().manual_seed(0)
    shapes = [(512, 512)] * 12 + [(512,)] * 6
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    opt = cls(params, lr=1e-3, weight_decay=0.01, update_freq=1000)
    opt.step()  # states, the refresh and the engine: what a steady step finds made
    return opt


def _timed(opt: CoreOptimizer) -> float:
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| optimizer | scheduled / constant (median of per-round ratios) |\n|---|---|")
    for cls in (AdamW, AdaDiag):
        constant, scheduled = _copy(cls), _copy(cls)
        ratios = []
        for r in range(args.rounds):
            base = _timed(constant)
            scheduled.param_groups[0]["betas"] = (0.9 - 0.01 * (r % 7), 0.999)
            scheduled.param_groups[0]["weight_decay"] = 0.01 * (1 + r % 3)
            ratios.append(_timed(scheduled) / base)
        print(f"| {cls.__name__} | {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
