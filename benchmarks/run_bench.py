"""Benchmark entry point: ``python benchmarks/run_bench.py [--model llama-60m|llama-130m] [--quick]``.

Same as ``adadiag-ref bench``; the code lives in :mod:`adadiag_ref.perf.bench` so that an
installed package can run it.  See docs/performance.md for the thread policy and the table.
"""

from __future__ import annotations

import sys

from adadiag_ref.perf.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
