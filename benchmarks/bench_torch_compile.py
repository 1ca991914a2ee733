"""``torch.compile(opt.step)`` against the eager ``opt.step()`` of the torch adapter, in the same run.

For each optimizer, two copies of the same parameters (``--model small``: ``bench_torch_adapter.SHAPES``;
``--model llama-60m``: the shapes of ``adadiag_ref.memory.llama_parameters("llama-60m")``, 58M entries; gradients
set once) take
steps without refresh (T = infinity, after the t = 1 refresh of the warm-up): eagerly, and through
``torch.compile(opt.step)``.  Prints the median step time of each (interleaved, ``--repeats`` steps each), their
ratio, and Dynamo's counters after warm-up: graphs compiled, recompiles (frames compiled again) and the graph
breaks by reason (the only expected one is the deliberate ``torch.compiler.disable`` of the step).  A compiled step
runs the eager step outside the graph, so the ratio is the cost of Dynamo's call around it.

Run: ``python benchmarks/bench_torch_compile.py [--model small|llama-60m] [--repeats 100] [--threads 1]
[--dtype float32] [names ...]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import _adapter_import  # noqa: F401
from adadiag_ref.adapters.pytorch import OPTIMIZER_CLASSES
from bench_torch_adapter import SHAPES, _params

WARMUP = 3  # the t = 1 refresh and two steps without: every graph is compiled by then


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _shapes(model: str) -> list[tuple[int, ...]]:
    if model == "small":
        return list(SHAPES)
    from adadiag_ref.memory import llama_parameters

    return [tuple(spec.shape) for spec in llama_parameters(model)]


def bench(name: str, repeats: int, dtype: torch.dtype, shapes: list[tuple[int, ...]]) -> dict[str, object]:
    torch._dynamo.reset()
    counters.clear()
    options = {"lr": 1e-3, "update_freq": None}
    eager = OPTIMIZER_CLASSES[name](_params(dtype, shapes), **options)
    compiled_opt = OPTIMIZER_CLASSES[name](_params(dtype, shapes), **options)
    compiled = torch.compile(compiled_opt.step)
    start = time.perf_counter()
    for _ in range(WARMUP):
        eager.step()
        compiled()
    warmup_s = time.perf_counter() - start
    graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
    eager_times, compiled_times = [], []
    for k in range(repeats):  # interleaved, in alternating order: a load change (or a warm cache) hits both alike
        for run, times in ((eager.step, eager_times), (compiled, compiled_times))[:: 1 if k % 2 else -1]:
            times.append(_timed(run))
    eager_ms, compiled_ms = (1e3 * statistics.median(t) for t in (eager_times, compiled_times))
    return {
        "eager_ms": eager_ms,
        "compiled_ms": compiled_ms,
        "ratio": compiled_ms / eager_ms,
        "warmup_s": warmup_s,
        "graphs": graphs,
        "recompiles_after_warmup": counters["frames"]["total"] - frames,
        "graph_breaks": {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=["adamw", "adadiag", "adadiag_pp", "adafacdiag"])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch default)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--model", default="small", choices=["small", "llama-60m"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = _shapes(args.model)
    print(
        f"{args.model}: {len(shapes)} parameters, {sum(math.prod(s) for s in shapes):,} entries, {args.dtype}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} steps"
    )
    for name in args.names:
        row = bench(name, args.repeats, dtype, shapes)
        print(
            f"{name:14s} eager {row['eager_ms']:8.3f} ms  compiled {row['compiled_ms']:8.3f} ms  "
            f"ratio {row['ratio']:.2f}  warm-up {row['warmup_s']:.0f} s  graphs {row['graphs']}  "
            f"recompiles after warm-up {row['recompiles_after_warmup']}  graph breaks {row['graph_breaks']}"
        )


if __name__ == "__main__":
    main()
