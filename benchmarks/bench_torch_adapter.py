"""Per-step overhead of the torch adapter against calling the core directly on the same tensors.

For each optimizer and a small model-like set of parameters, times (median of
``--repeats`` steps, after warm-up, refresh steps excluded by T = infinity):

* ``adapter``: ``opt.step()`` of ``adadiag_ref.adapters.pytorch``;
* ``core``:    ``ar.update`` (+ ``check_inputs``) per parameter, the same core calls with the state kept as NamedTuples;
* ``torch``:   ``torch.optim.AdamW`` (foreach=False), for the AdamW row only.

``--host-time`` (issue 31): the host time of one ``optimizer.step()`` over many *tiny* tensors, where the
per-call (dispatch) cost is everything: LLaMA-60M's parameter structure (8 blocks of q, k, v, o, gate, up, down
and two norms, embedding, final norm, head: 75 parameters) with hidden 8, MLP 16 and vocabulary 32, float32,
against ``torch.optim.AdamW(fused=True)`` on the same parameters, measured in the same run: interleaved rounds (a
block of steps of every optimizer per round), the median step of each block, the median over rounds of each
optimizer's time and of its ratio to fused AdamW's in the same round.  Steps without a refresh
(``update_freq=None`` after the first step); a refresh step of AdaDiag / AdaDiag++ is timed apart
(``update_freq=1``: every step refreshes).

Run: ``python benchmarks/bench_torch_adapter.py [--repeats 200] [--threads 1]``,
``python benchmarks/bench_torch_adapter.py --host-time [--rounds 15] [--block 40] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import _adapter_import  # noqa: F401
from adadiag_ref.adapters.pytorch import OPTIMIZER_CLASSES

import adadiag_ref as ar
from adadiag_ref.perf.bench import median_time

SHAPES = [(256, 512), (512,), (512, 256), (256,), (64, 32, 3, 3)]


def _params(dtype: torch.dtype, shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
    return params


def _median_ms(fn, repeats: int, warmup: int = 5) -> float:
    return 1e3 * median_time(fn, repeats, warmup)


def bench(name: str, repeats: int, dtype: torch.dtype) -> dict[str, float]:
    params = _params(dtype)
    opt = OPTIMIZER_CLASSES[name](params, lr=1e-3, update_freq=None)
    adapter = _median_ms(opt.step, repeats)

    cfg = ar.make_config(name, lr=1e-3, update_freq=None)
    core_params = _params(dtype)
    states = []
    with torch.no_grad():
        for p in core_params:  # t = 1 refresh done once, as the adapter's warm-up did
            s = ar.refresh_basis(ar.init(p, cfg), p.grad, cfg)
            states.append(s)

    @torch.no_grad()
    def core_step() -> None:
        for i, p in enumerate(core_params):
            ar.check_inputs(states[i], p.grad, cfg, p)
            delta, states[i] = ar.update(states[i], p.grad, cfg, p, lr=1e-3)
            p.add_(delta)

    row = {"adapter_ms": adapter, "core_ms": _median_ms(core_step, repeats)}
    if name == "adamw":
        ref_params = _params(dtype)
        ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.0, foreach=False)
        row["torch_ms"] = _median_ms(ref.step, repeats)
    return row


def llama_tiny_shapes(hidden: int = 8, mlp: int = 16, vocab: int = 32, layers: int = 8) -> list[tuple[int, ...]]:
    """LLaMA-60M's parameter count and kinds (8 blocks; embedding, final norm, head) with tiny dimensions."""
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(mlp, hidden), (mlp, hidden), (hidden, mlp), (hidden,), (hidden,)]
    return [*shapes, (hidden,), (vocab, hidden)]


def host_time(rounds: int, block: int) -> None:
    """The ``--host-time`` table (module docstring)."""
    shapes = llama_tiny_shapes()

    def adapter(name: str, **options) -> torch.optim.Optimizer:
        return OPTIMIZER_CLASSES[name](_params(torch.float32, shapes), lr=1e-3, weight_decay=0.01, **options)

    def torch_adamw(**options) -> torch.optim.Optimizer:
        return torch.optim.AdamW(_params(torch.float32, shapes), lr=1e-3, weight_decay=0.01, **options)

    rows = {
        "torch AdamW(fused=True)": torch_adamw(fused=True),
        "torch AdamW(foreach=True)": torch_adamw(foreach=True),
        "adapter AdamW (default route)": adapter("adamw", update_freq=None),
        "adapter AdaDiag (default route)": adapter("adadiag", update_freq=None),
        "adapter AdaDiagPP (default route)": adapter("adadiag_pp", update_freq=None),
        "adapter AdaDiag refresh step": adapter("adadiag", update_freq=1),
        "adapter AdaDiagPP refresh step": adapter("adadiag_pp", update_freq=1),
    }
    for opt in rows.values():
        for _ in range(3):
            opt.step()  # the first step refreshes and creates the states
    times: dict[str, list[float]] = {label: [] for label in rows}
    ratios: dict[str, list[float]] = {label: [] for label in rows}
    for _ in range(rounds):
        this = {label: _median_ms(opt.step, block, warmup=2) for label, opt in rows.items()}
        for label, ms in this.items():
            times[label].append(ms)
            ratios[label].append(ms / this["torch AdamW(fused=True)"])
    print(f"host time per step, {len(shapes)} tiny float32 parameters (LLaMA-60M's kinds, hidden 8, MLP 16, vocab 32)")
    print(f"{torch.get_num_threads()} threads, {rounds} interleaved rounds of {block} steps, medians")
    print(f"{'optimizer':35s} {'ms/step':>9s} {'/ fused AdamW':>14s}")
    for label in rows:
        print(f"{label:35s} {statistics.median(times[label]):9.3f} {statistics.median(ratios[label]):14.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch default)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--host-time", action="store_true", help="host time per step over tiny tensors (issue 31)")
    parser.add_argument("--rounds", type=int, default=15, help="--host-time: interleaved rounds")
    parser.add_argument("--block", type=int, default=40, help="--host-time: steps per optimizer and round")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.host_time:
        host_time(args.rounds, args.block)
        return
    dtype = getattr(torch, args.dtype)
    print(f"shapes {SHAPES}, dtype {args.dtype}, {torch.get_num_threads()} threads, median of {args.repeats} steps")
    print(f"{'optimizer':15s} {'adapter ms':>11s} {'core ms':>9s} {'ratio':>7s} {'torch.AdamW ms':>15s}")
    ratios = []
    for name in ar.OPTIMIZERS:
        row = bench(name, args.repeats, dtype)
        ratio = row["adapter_ms"] / row["core_ms"]
        ratios.append(ratio)
        extra = f"{row['torch_ms']:15.3f}" if "torch_ms" in row else ""
        print(f"{name:15s} {row['adapter_ms']:11.3f} {row['core_ms']:9.3f} {ratio:7.3f} {extra}")
    if ratios:
        print(f"median adapter/core ratio over the eight optimizers: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
