"""The multi-parameter engine (``ar.Engine``) on the CPU: what one step without refresh asks of a device, and its
host time per step with tiny tensors (the dispatch cost), against ``multi_step`` and per-parameter ``ar.step``.

Run on demand::

    python benchmarks/engine_step.py

LLaMA's parameter structure (embedding, 9 tensors per layer, final norm, LM head), float32:

* counts on ``array_api_strict`` (:mod:`adadiag_ref.perf.traffic`), hidden 64, intermediate 172, 2 and 8 layers:
  host conversions with ``check=True`` and ``check=False``, namespace calls (all, and without views);
* host time per step, hidden 16, intermediate 43, 8 layers, NumPy and CPU torch (1 thread), medians of 15 steps:
  ``engine.step`` (``check`` on and off), ``multi_step(count=1)``, ``ar.step`` per parameter.

docs/performance.md, "The multi-parameter engine", shows a run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import array_api_strict as xs
import numpy as np

import adadiag_ref as ar
from adadiag_ref.perf.bench import median_time
from adadiag_ref.perf.traffic import count_traffic

VIEW_CALLS = {"reshape", "__getitem__", "astype", "matrix_transpose"}


def llama_shapes(hidden: int, intermediate: int, layers: int, vocab: int = 1000) -> list[tuple[int, ...]]:
    block = [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate), (hidden,), (hidden,)]
    return [(vocab, hidden), *block * layers, (hidden,), (vocab, hidden)]


def counts(name: str, layers: int) -> str:
    rng = np.random.default_rng(0)
    shapes = llama_shapes(64, 172, layers)
    params = [xs.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    grads = [xs.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    engine = ar.Engine(params, ar.make_config(name, update_freq=10))
    engine.step(grads, params)  # t = 1, the refresh
    cells = []
    for check in (True, False):
        with count_traffic() as traffic:
            engine.step(grads, params, check=check)
        non_view = sum(v for k, v in traffic.calls.items() if k not in VIEW_CALLS)
        cells.append(f"check={check!s:5}: {traffic.host_conversions} conversions, {traffic.namespace_calls} calls "
                     f"({non_view} not views)")  # fmt: skip
    return f"{name:11} {layers} layers ({len(shapes)} parameters): " + "; ".join(cells)


def median_ms(fn: Callable[[], Any], n: int = 15) -> float:
    """Milliseconds: the median of ``n`` timed calls after two untimed ones (``perf.bench.median_time``)."""
    return 1e3 * median_time(fn, n, warmup=2)


def timings(backend: str, name: str) -> str:
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    convert: Callable[[np.ndarray], Any] = (lambda a: a) if backend == "numpy" else torch.from_numpy
    shapes = llama_shapes(16, 43, 8, vocab=100)
    cfg = ar.make_config(name, update_freq=None)
    params = [convert(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    grads = [convert(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    engine = ar.Engine(params, cfg)
    engine.step(grads, params)
    states = [ar.init(p, cfg) for p in params]
    after, states = ar.multi_step(states, grads, cfg, params, count=0)
    rows = {
        "engine.step": median_ms(lambda: engine.step(grads, params)),
        "engine.step(check=False)": median_ms(lambda: engine.step(grads, params, check=False)),
        "multi_step(count=1)": median_ms(lambda: ar.multi_step(states, grads, cfg, after, count=1)),
        "ar.step per parameter": median_ms(
            lambda: [ar.step(s, g, cfg, p, count=1) for s, g, p in zip(states, grads, after, strict=True)]
        ),
    }
    return f"{backend:6} {name:8} ({len(shapes)} parameters): " + "  ".join(f"{k} {v:.2f} ms" for k, v in rows.items())


def main() -> None:
    print("one step without refresh on array_api_strict (hidden 64, intermediate 172)")
    for name in ("adamw", "adadiag", "adadiag_pp", "adafacdiag", "hfacdiag"):
        for layers in (2, 8):
            print("  " + counts(name, layers))
    print("host time per step, tiny tensors (hidden 16, intermediate 43, 8 layers)")
    for backend in ("numpy", "torch"):
        for name in ("adamw", "adadiag"):
            print("  " + timings(backend, name))


if __name__ == "__main__":
    main()
