"""The torch adapter's default CPU route against its peers, side by side (issue 31's CPU targets).

Over LLaMA-60M's parameter structure cut to its first 4 transformer blocks, with an 8000-token embedding and LM
head (float32, ``adadiag_ref.memory.llama_parameters``), one ``optimizer.step()`` of each contender:

* ``fused AdamW``:   ``torch.optim.AdamW(fused=True)``;
* ``adapter AdamW``: ``adadiag_ref.adapters.pytorch.AdamW`` (its group's engine);
* ``engine AdamW, check=False``: the same engine called directly without the finiteness check (the adapter
  checks every gradient before any write, one more read of ``G``; fused AdamW checks nothing): the check's cost;
* ``adapter AdaDiag`` / ``GaLore``: the adapter's ``AdaDiag`` on the blocks' matrices (the embedding, head and
  norms by its ``AdamW``, the paper's rule) against the official ``galore_torch.GaLoreAdamW`` at full rank
  (``rank = min(m, n)``, one-sided: AdaDiag's form) on the same matrices, its plain Adam on the rest;
  non-refresh steps (AdaDiag ``update_freq=None``, GaLore ``update_proj_gap`` never reached after its first
  step), and separately refresh steps (every step refreshes: ``update_freq=1``, ``update_proj_gap=1``).

For each thread count, torch (``torch.set_num_threads``), numba (``numba.set_num_threads``) and the BLAS
libraries (threadpoolctl) are set to it; the contenders are called in rotation, one step each per round
(``--rounds`` rounds after warm-up), with a short pause after each call so that one library's spinning
OpenMP threads do not slow the next call down; the table gives median milliseconds and the ratios
adapter/fused AdamW, adapter AdaDiag/GaLore and 2-thread/1-thread (each ratio is the median of the per-round
ratios, so load drift on a shared machine affects both sides alike).

GaLore is skipped, with a message, when ``galore_torch`` is not installed (``pip install -e .[peers]``, or
``pip install --no-deps galore-torch``).  Its
package ``__init__`` imports ``transformers`` and ``bitsandbytes`` for its other optimizers; only
``galore_torch.adamw`` and ``galore_torch.galore_projector`` are loaded here, and when ``transformers`` is
absent its ``require_version`` (a version assertion at construction) is replaced by a no-op.

``--after-backward`` runs a multi-threaded ``torch.mm`` (untimed) right before each timed call: in training,
``step()`` follows a backward pass whose last multi-threaded ops leave torch's OpenMP workers spinning, which the
pause alone hides.  ``--phases N`` then times N more rounds of ``adapter AdaDiag`` and ``GaLore`` split into their
GEMMs, each kernel call of the adapter's engine and the rest (medians per phase).

Run: ``python benchmarks/cpu_adapter_vs_peers.py [--threads 1 2] [--rounds 15] [--refresh-rounds 3] [--phases 11]``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adadiag_ref.memory import LLAMA_CONFIGS, llama_parameters
from adadiag_ref.perf.params import is_rotated

LR = 1e-3


def specs() -> list[Any]:
    """LLaMA-60M's shapes, 4 blocks, 8000-token embedding and head."""
    return llama_parameters(dataclasses.replace(LLAMA_CONFIGS["llama-60m"], layers=4, vocab=8000))


def galore_adamw() -> Any:
    """``galore_torch.GaLoreAdamW`` without its package ``__init__`` (module docstring), or ``None``."""
    if "galore_torch.adamw" in sys.modules:
        return sys.modules["galore_torch.adamw"].AdamW
    spec = importlib.util.find_spec("galore_torch")
    if spec is None or spec.submodule_search_locations is None:
        return None
    if "galore_torch" not in sys.modules:
        package = types.ModuleType("galore_torch")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["galore_torch"] = package
    if importlib.util.find_spec("transformers") is None and "transformers.utils.versions" not in sys.modules:
        stub = types.ModuleType("transformers.utils.versions")
        stub.require_version = lambda *args, **kwargs: None  # type: ignore[attr-defined]
        for name in ("transformers", "transformers.utils"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["transformers.utils.versions"] = stub
    from galore_torch.adamw import AdamW

    return AdamW


def _params(seed: int = 0) -> tuple[list[torch.nn.Parameter], list[bool]]:
    gen = torch.Generator().manual_seed(seed)
    params, rotated = [], []
    for s in specs():
        p = torch.nn.Parameter(torch.randn(s.shape, generator=gen) * 0.02)
        p.grad = torch.randn(s.shape, generator=gen) * 1e-3
        params.append(p)
        rotated.append(is_rotated(s, "paper"))
    return params, rotated


def unchecked_engine_step() -> Callable[[], Any]:
    """``ar.Engine`` AdamW's ``step(check=False)`` on the parameters' own tensors: the adapter's steady step
    without its all-or-nothing NaN/Inf scan (one more read of every gradient, which fused AdamW does not make), so
    the table shows what that check costs."""
    import adadiag_ref as ar

    params, _ = _params()
    tensors, grads = [p.detach() for p in params], [p.grad for p in params]
    engine = ar.Engine(tensors, ar.make_config("adamw", lr=LR, update_freq=None))
    return lambda: engine.step(grads, tensors, check=False)


def contenders(refresh: bool) -> dict[str, Callable[[], Any]]:
    """Step functions, each on its own copy of the parameters, warmed past their first (refresh) step."""
    from adadiag_ref.adapters import pytorch as at

    fns: dict[str, Callable[[], Any]] = {}
    if not refresh:
        params, _ = _params()
        fns["fused AdamW"] = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True).step
        params, _ = _params()
        fns["adapter AdamW"] = at.AdamW(params, lr=LR, update_freq=None).step
        fns["engine AdamW, check=False"] = unchecked_engine_step()
    params, rotated = _params()
    freq = 1 if refresh else None
    opts = [
        at.AdaDiag([p for p, r in zip(params, rotated) if r], lr=LR, update_freq=freq),
        at.AdamW([p for p, r in zip(params, rotated) if not r], lr=LR, update_freq=None),
    ]
    suffix = " refresh" if refresh else ""
    fns["adapter AdaDiag" + suffix] = lambda: [o.step() for o in opts]
    GaLore = galore_adamw()
    if GaLore is not None:
        params, rotated = _params()
        groups = [
            {"params": [p for p, r in zip(params, rotated) if not r]},
            {
                "params": [p for p, r in zip(params, rotated) if r],
                "rank": min(min(p.shape) for p, r in zip(params, rotated) if r),
                "update_proj_gap": 1 if refresh else 1 << 30,
                "scale": 1.0,
                "proj_type": "std",
            },
        ]
        assert all(min(p.shape) == groups[1]["rank"] for p in groups[1]["params"])  # full rank: 512 here
        fns["GaLore" + suffix] = GaLore(groups, lr=LR, weight_decay=0.0).step
    for fn in fns.values():
        fn()  # t = 1: every first step refreshes
    return fns


def set_threads(n: int) -> Any:
    """torch, numba and BLAS threads set to ``n``; returns the threadpoolctl context to exit afterwards."""
    torch.set_num_threads(n)
    try:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=n, user_api="blas")


_BEFORE_EACH_CALL: list[Callable[[], Any]] = []
"""Run right before each timed call, after the pause (``--after-backward`` puts a multi-threaded GEMM here)."""


def settle(pause: float) -> None:
    """The pause before a timed call, then whatever ``--after-backward`` asks to run right before it."""
    time.sleep(pause)
    for fn in _BEFORE_EACH_CALL:
        fn()


def backward_tail() -> Callable[[], Any]:
    """A multi-threaded ``torch.mm`` of 1024 x 1024 operands: what the end of a backward pass leaves behind (torch's
    OpenMP workers spinning for a while before they sleep), run untimed right before each call."""
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(1024, 1024, generator=gen) for _ in range(2))
    return lambda: torch.mm(a, b)


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int, pause: float) -> dict[str, list[float]]:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            settle(pause)
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


class PhaseClock:
    """Seconds spent in each phase of a call, by wrapping the functions that run the phases (``--phases``)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = collections.Counter()
        self.undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str | Callable[[tuple[Any, ...]], str]) -> None:
        """``owner.name`` timed into ``spent[label]`` (``label(args)`` when callable) until :meth:`restore`."""
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                key = label(args) if callable(label) else label
                self.spent[key] += time.perf_counter() - start

        self.replace(owner, name, timed)

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value`` until :meth:`restore`."""
        self.undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)
        self.undo.clear()


def phases(fns: dict[str, Callable[[], Any]], rounds: int, pause: float) -> dict[str, dict[str, list[float]]]:
    """Per round, ``adapter AdaDiag``'s step split into its GEMMs (the group engine's products), each kernel call
    through ``torch_route.split_rows`` (by kernel) and the rest; GaLore's into its projections (``torch.matmul`` in
    ``galore_projector``) and the rest."""
    from adadiag_ref.optim import engine
    from adadiag_ref.optim.families.adam import torch_route

    clock = PhaseClock()
    clock.wrap(engine, "_product", "GEMMs")
    clock.wrap(torch_route, "split_rows", lambda args: "kernel " + getattr(args[0], "__name__", "?").lstrip("_"))
    contenders = {name: fns[name] for name in ("adapter AdaDiag", "GaLore") if name in fns}
    projector = sys.modules.get("galore_torch.galore_projector")
    if projector is not None:

        class TimedTorch(types.ModuleType):  # the projector's ``torch``, its matmul timed
            def __getattr__(self, name: str) -> Any:
                return getattr(torch, name)

        timed_torch = TimedTorch("torch")
        timed_torch.matmul = torch.matmul  # type: ignore[attr-defined]
        clock.wrap(timed_torch, "matmul", "GEMMs")
        clock.replace(projector, "torch", timed_torch)
    out: dict[str, dict[str, list[float]]] = {name: collections.defaultdict(list) for name in contenders}
    try:
        for r in range(rounds):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for name in order:
                settle(pause)
                clock.spent.clear()
                start = time.perf_counter()
                contenders[name]()
                total = time.perf_counter() - start
                out[name]["step"].append(total)
                for key, value in clock.spent.items():
                    out[name][key].append(value)
                out[name]["rest (Python, other torch ops)"].append(total - sum(clock.spent.values()))
    finally:
        clock.restore()
    return out


def ratio(times: dict[str, list[float]], a: str, b: str) -> float | None:
    if a not in times or b not in times:
        return None
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of non-refresh steps")
    parser.add_argument("--refresh-rounds", type=int, default=3, help="rounds of refresh steps (0: none)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pause", type=float, default=0.2, help="seconds of sleep before each timed call")
    parser.add_argument(
        "--phases", type=int, default=0, help="rounds of AdaDiag and GaLore steps timed by phase (0: none)"
    )
    parser.add_argument(
        "--after-backward",
        action="store_true",
        help="run a multi-threaded torch.mm right before each timed call, as a backward pass ends before step()",
    )
    args = parser.parse_args(argv)
    if args.after_backward:
        _BEFORE_EACH_CALL.append(backward_tail())
    if galore_adamw() is None:
        print("galore_torch is not installed (pip install --no-deps galore-torch): the GaLore rows are skipped")
    results: dict[int, dict[str, list[float]]] = {}
    split: dict[int, dict[str, dict[str, list[float]]]] = {}
    for n in args.threads:
        limits = set_threads(n)
        try:
            fns = contenders(refresh=False)
            times = interleaved(fns, args.rounds, args.warmup, args.pause)
            if args.phases:
                split[n] = phases(fns, args.phases, args.pause)
            if args.refresh_rounds:
                times.update(interleaved(contenders(refresh=True), args.refresh_rounds, 1, args.pause))
        finally:
            if limits is not None:
                limits.restore_original_limits()
        results[n] = times
        print(f"threads={n}: done", file=sys.stderr, flush=True)
    names = list(next(iter(results.values())))
    head = "| median ms | " + " | ".join(f"{n} thread{'s' if n > 1 else ''}" for n in results) + " |"
    print(head)
    print("|---|" + "---|" * len(results))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{1e3 * statistics.median(t[name]):.1f}" for t in results.values()) + " |")
    pairs = [
        ("adapter AdamW", "fused AdamW"),
        ("engine AdamW, check=False", "fused AdamW"),
        ("adapter AdaDiag", "GaLore"),
        ("adapter AdaDiag refresh", "GaLore refresh"),
    ]
    for a, b in pairs:
        values = [ratio(t, a, b) for t in results.values()]
        if all(v is not None for v in values):
            print(f"| {a} / {b} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    if 1 in results and 2 in results:
        print()
        print("| 2 threads / 1 thread (medians) | ratio |")
        print("|---|---|")
        for name in names:
            one, two = statistics.median(results[1][name]), statistics.median(results[2][name])
            print(f"| {name} | {two / one:.2f} |")
    for name in next(iter(split.values()), {}):
        print()
        print(
            f"| {name}: median ms by phase | " + " | ".join(f"{n} thread{'s' if n > 1 else ''}" for n in split) + " |"
        )
        print("|---|" + "---|" * len(split))
        keys = sorted({k for per in split.values() for k in per[name]}, key=lambda k: (k != "step", k))
        for key in keys:
            cells = [
                f"{1e3 * statistics.median(per[name][key]):.1f}" if per[name].get(key) else "-"
                for per in split.values()
            ]
            print(f"| {key} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
