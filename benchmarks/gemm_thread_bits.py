"""Whether torch's CPU GEMMs give the same bits on 1 and on N threads (a fact about the BLAS torch uses).

The adapter's own kernels give the same bits on any number of threads (each entry is computed by the same code
whatever the cut), but its rotations are ``torch.mm`` calls, and MKL may cut a product's inner dimension between
threads and so round otherwise.  This script multiplies random operands of fixed and random shapes, in both memory
orders of each operand, in float32 and float64, with ``torch.set_num_threads(1)`` and ``(N)``, and prints the
products whose bits differ.

Run: ``python benchmarks/gemm_thread_bits.py [--threads 2] [--random 30] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import itertools
import random

import torch

FIXED = [(512, 512, 512), (512, 512, 1376), (1376, 512, 512), (512, 1376, 512), (130, 130, 300), (300, 130, 130),
         (8000, 512, 512), (512, 512, 8000), (64, 64, 4096), (4096, 64, 64), (7, 5, 5), (5, 7, 7), (1, 1, 20000),
         (20000, 1, 1), (33, 1000, 33), (256, 4096, 256)]  # fmt: skip
"""``(m, k, n)``: LLaMA-60M's products, the tests' shapes, and shapes with a long inner dimension."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="N, compared with 1")
    parser.add_argument("--random", type=int, default=30, help="random shapes added to the fixed ones")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    shapes = FIXED + [(rng.randint(1, 700), rng.randint(1, 3000), rng.randint(1, 700)) for _ in range(args.random)]
    previous = torch.get_num_threads()
    differ = total = 0
    try:
        for dtype in (torch.float32, torch.float64):
            gen = torch.Generator().manual_seed(args.seed)
            for m, k, n in shapes:
                a = torch.randn(m, k, generator=gen, dtype=dtype)
                b = torch.randn(k, n, generator=gen, dtype=dtype)
                for a_f, b_f in itertools.product([False, True], repeat=2):  # C order, or F order (a transposed copy)
                    left = a.T.contiguous().T if a_f else a
                    right = b.T.contiguous().T if b_f else b
                    torch.set_num_threads(args.threads)
                    many = left @ right
                    torch.set_num_threads(1)
                    one = left @ right
                    total += 1
                    if not torch.equal(one, many):
                        differ += 1
                        gap = (one - many).abs().max().item()
                        order = f"{'F' if a_f else 'C'}{'F' if b_f else 'C'}"
                        print(f"differ: {dtype} (m, k, n) = {(m, k, n)}, orders {order}, max |difference| {gap:.3g}")
    finally:
        torch.set_num_threads(previous)
    print(f"{differ} of {total} products differ between 1 and {args.threads} threads (torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
