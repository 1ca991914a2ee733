"""How the steady-state (non-refresh) AdaDiag step grows with the matrix side and with the parameter count.

Float32, one-sided AdaDiag (``P`` only), ``ar.Engine``'s step (what a NumPy
loop runs) and the functional ``ar.update``:

* side: one square ``s x s`` matrix, ``s = 256 ... 4096``;
* count: ``k`` matrices of 512 x 1376 (LLaMA-60M's MLP shape), ``k = 1 ... 32``.

Each time is the fastest of ``--reps`` calls.  A least-squares line through ``log t`` against
``log s`` (sides >= 512, where fixed per-call costs no longer dominate) gives
the fitted exponents, printed and plotted beside the theoretical ones:
elementwise work ``O(mn) = O(s^2)``, the rotation GEMMs ``O(m^2 n + m n^2) =
O(s^3)``, and linear growth in the parameter count.

Run: ``python benchmarks/steady_scaling.py [--max-side 4096] [--reps 5] [--threads 1]``; writes
``docs/steady-scaling.png`` and ``docs/steady-scaling.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

import adadiag_ref as ar
from adadiag_ref.perf.bench import _setup_threads, call_times, machine_description

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _best(fn: Callable[[], Any], reps: int) -> float:
    """The fastest of ``reps`` timed calls (after one warm-up): on a shared machine other processes only ever add
    time, so the minimum estimates the cost of the work itself, which is what the exponents describe."""
    return min(call_times(fn, reps))


def _engine(shapes: list[tuple[int, int]]) -> Callable[[], None]:
    """One ``ar.Engine`` step of one-sided AdaDiag over ``shapes`` (float32, the basis from the warm-up's refresh)."""
    cfg = ar.make_config("adadiag", update_freq=None)
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    grads = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    engine = ar.Engine(params, cfg)
    engine.step(grads, params)  # step 1 refreshes
    return lambda: engine.step(grads, params)


def _functional(shapes: list[tuple[int, int]]) -> Callable[[], None]:
    cfg = ar.make_config("adadiag", update_freq=None)
    rng = np.random.default_rng(1)
    items = []
    for shape in shapes:
        w, g = rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)
        items.append([ar.refresh_basis(ar.init(w, cfg), g, cfg), g, w])

    def one() -> None:
        for it in items:
            delta, it[0] = ar.update(it[0], it[1], cfg, it[2])
            np.add(it[2], delta, out=it[2])

    return one


def measure(sizes: list[int], counts: list[int], reps: int) -> dict[str, Any]:
    res: dict[str, Any] = {"side": {}, "count": {}}
    for s in sizes:
        r = max(1, reps if s <= 2048 else reps // 3)
        row = {"step": _best(_engine([(s, s)]), r), "functional": _best(_functional([(s, s)]), r)}
        res["side"][s] = row
        print(f"side {s:5d}: " + ", ".join(f"{k} {v * 1e3:9.2f} ms" for k, v in row.items()), flush=True)
    for k in counts:
        shapes = [(512, 1376)] * k
        row = {"step": _best(_engine(shapes), reps), "functional": _best(_functional(shapes), reps)}
        res["count"][k] = row
        print(f"{k:3d} x 512x1376: " + ", ".join(f"{n} {v * 1e3:9.2f} ms" for n, v in row.items()), flush=True)
    return res


def fit(xs: list[float], ts: list[float]) -> float:
    """Slope of the least-squares line through ``(log x, log t)``."""
    return float(np.polyfit(np.log(xs), np.log(ts), 1)[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-side", type=int, default=4096)
    parser.add_argument("--max-count", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DOCS / "steady-scaling")
    parser.add_argument("--threads", type=int, default=None,
                        help="BLAS and numba threads (default: all cores); 1 on a busy shared machine")  # fmt: skip
    args = parser.parse_args(argv)
    ncpu = _setup_threads()
    threads = args.threads or ncpu
    threadpool_limits(limits=threads, user_api="blas")
    import numba

    numba.set_num_threads(threads)
    sizes = [s for s in (256, 512, 1024, 2048, 4096) if s <= args.max_side]
    counts = [k for k in (1, 2, 4, 8, 16, 32) if k <= args.max_count]
    res = measure(sizes, counts, args.reps)
    theory = {"step": 3.0, "functional": 3.0}
    big = [s for s in sizes if s >= 512]
    exponents = {k: fit(big, [res["side"][s][k] for s in big]) for k in theory}
    count_exponents = {k: fit(counts, [res["count"][c][k] for c in counts]) for k in ("step", "functional")}
    print(
        "side exponents (fitted / theory): " + ", ".join(f"{k} {v:.2f} / {theory[k]:.0f}" for k, v in exponents.items())
    )
    print("count exponents (fitted / theory): " + ", ".join(f"{k} {v:.2f} / 1" for k, v in count_exponents.items()))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, marker in (("step", "o"), ("functional", "x")):
        ax1.loglog(sizes, [res["side"][s][key] * 1e3 for s in sizes], marker=marker,
                   label=f"{key}: fitted {exponents[key]:.2f}, theory {theory[key]:.0f}")  # fmt: skip
    ax1.set_xlabel("matrix side s (one s x s matrix)")
    ax1.set_ylabel("step time, best of reps (ms)")
    ax1.set_title("AdaDiag step vs matrix side")
    ax1.legend(fontsize=8)
    for key, marker in (("step", "o"), ("functional", "x")):
        ax2.loglog(counts, [res["count"][c][key] * 1e3 for c in counts], marker=marker,
                   label=f"{key}: fitted {count_exponents[key]:.2f}, theory 1")  # fmt: skip
    ax2.set_xlabel("number of 512 x 1376 matrices")
    ax2.set_title("AdaDiag step vs parameter count")
    ax2.legend(fontsize=8)
    fig.suptitle(f"float32, {threads} thread(s), {machine_description()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    payload = {"machine": machine_description(), "threads": threads, "results": res, "side_exponents": exponents,
               "count_exponents": count_exponents, "theory": theory}  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(f"wrote {args.out.with_suffix('.png')} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
