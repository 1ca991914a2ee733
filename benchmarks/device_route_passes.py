"""Array passes per entry of one non-refresh step of the torch adapter's device routes, counted per op (issue 31's
CPU target: AdamW through the CUDA route at most 1.6x torch fused AdamW's passes in the same counting, and
AdaDiag's entrywise part the same, plus the GEMMs).

A pass is one read or one write of an array of the step's size: every aten op of the step is counted by a
``TorchDispatchMode`` as the bytes of the tensors it reads (its tensor arguments) plus those it writes (its outputs,
and its arguments marked as written in its schema), divided by the bytes of one array of all parameters.  Views
count nothing.  Counted alike for:

* ``torch.optim.AdamW(fused=True)`` (one ``aten._fused_adamw_``: reads ``W, G, M, V``, writes ``W, M, V``; its
  schema also marks ``G`` as written, which it is only under a ``GradScaler``: 8 counted, 7 of traffic);
* the adapter's default route on CUDA without CuPy: its group's engine on its device path (the engine told these
  CPU tensors are off the host) without group kernels, the gathering path in torch ops;
* the adapter's default route on CUDA with CuPy installed: its group's engine on the CUDA group kernels
  (``cupy_group``), whose launches are counted here by a launcher that records them instead of running them (no
  GPU needed): each kernel's reads and writes per entry, as its CUDA source writes them (:data:`KERNEL_PASSES`),
  times its entries; the engine's other aten ops (the gathers, the direction of a rotated group, the GEMMs) by
  the dispatch mode as above;
* ``ar.Engine`` itself with ``check=True`` on its device path (the engine told these CPU tensors are off the host:
  batched GEMMs over stacks, the verdict a sum per gathered group left on the device, the kernels gated by it).

The GEMMs (``mm``, ``bmm``, ``matmul``) are reported apart: their passes are the operands' and outputs' bytes, not
the flops.  Nothing here is timed.  Run on demand::

    python benchmarks/device_route_passes.py [--model llama-60m] [--layers 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adadiag_ref.adapters import pytorch as at

import adadiag_ref as ar
from adadiag_ref.memory import LLAMA_CONFIGS, llama_parameters
from adadiag_ref.optim import engine as engine_module
from adadiag_ref.optim.families.adam import cupy_group, group_route
from adadiag_ref.perf.params import is_rotated

KERNEL_PASSES = {"step": 7, "moments": 6, "tail": 3, "nonfinite": 1}
"""Reads + writes per entry of each group kernel, from its CUDA source (``cupy_group``): ``step`` reads ``G, W,
M, V`` and writes ``W, M, V``; ``moments`` reads ``G~, M, V`` and writes ``M, V`` and ``U~`` over ``G~``; ``tail``
reads ``W, D`` and writes ``W``; ``nonfinite`` reads ``G``."""

GEMMS = {"aten.mm.default", "aten.mm.out", "aten.bmm.default", "aten.matmul.default"}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


class CountBytes(TorchDispatchMode):
    """Bytes read and written per aten op (views: none), GEMMs apart."""

    def __init__(self) -> None:
        super().__init__()
        self.entrywise = 0
        self.gemm = 0
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        read = sum(t.nbytes for t in _tensors(list(args) + list(kwargs.values())))
        written = 0
        for argument, value in zip(func._schema.arguments, list(args), strict=False):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written += sum(t.nbytes for t in _tensors(value))
        if not any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            written += sum(t.nbytes for t in _tensors(out))
        name = str(func)
        self.ops[name] += 1
        if name in GEMMS:
            self.gemm += read + written
        else:
            self.entrywise += read + written
        return out


class CountingLauncher:
    """A :class:`~adadiag_ref.optim.families.adam.cupy_group.CudaGroup` launcher over CPU tensors that records each
    launch's passes (:data:`KERNEL_PASSES` x entries x itemsize) instead of running it."""

    def __init__(self) -> None:
        self.bytes = 0
        self.launches: Counter[str] = Counter()

    def address(self, a: Any) -> int | None:
        return int(a.data_ptr()) if a.is_contiguous() else None

    def upload(self, table: np.ndarray) -> Any:
        return torch.from_numpy(table.astype(np.int64))

    def zeros_int32(self) -> Any:
        return torch.zeros((), dtype=torch.int32)

    def true(self) -> Any:
        return torch.ones((), dtype=torch.bool)

    def launch(self, name: str, source: str, grid: int, args: tuple[Any, ...]) -> None:
        kind = next(k for k in KERNEL_PASSES if f"_group_{k}" in name)
        size = int(args[[type(a) for a in args].index(np.int64)])  # the kernels' ``size`` (entries)
        itemsize = 8 if "float64" in name else 4
        self.launches[kind] += 1
        self.bytes += KERNEL_PASSES[kind] * size * itemsize


class _Both:
    """Several optimizers stepped as one."""

    def __init__(self, opts: list[Any]) -> None:
        self.opts = opts

    def step(self) -> None:
        for opt in self.opts:
            opt.step()


def _model(name: str, layers: int) -> list[Any]:
    return llama_parameters(dataclasses.replace(LLAMA_CONFIGS[name], layers=layers))


def _count(make: Any, params: list[torch.nn.Parameter], launcher: CountingLauncher | None) -> tuple[float, ...]:
    """(entrywise passes, GEMM passes, kernel passes) of the third step (the first refreshes; none after)."""
    opt = make(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    before = 0 if launcher is None else launcher.bytes
    with CountBytes() as counted:
        opt.step()
    one = sum(p.numel() * p.element_size() for p in params)
    kernels = 0 if launcher is None else launcher.bytes - before
    return counted.entrywise / one, counted.gemm / one, kernels / one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-60m")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (passes per entry barely depend)")
    args = parser.parse_args()
    specs = _model(args.model, args.layers)
    rotated = [is_rotated(s, "paper") for s in specs]

    def fresh() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s.shape, generator=gen)) for s in specs]

    launcher = CountingLauncher()
    in_host_memory = engine_module._in_host_memory
    # no host kernels over these CPU tensors; no probe: the launches are recorded, not run, here
    group_route._host_dtype = lambda *args: None  # type: ignore[assignment]
    cupy_group.ready = lambda *args: True  # type: ignore[assignment]

    def route(cuda_kernels: bool, device_path: bool) -> None:
        """The engines over these CPU tensors as over CUDA tensors with (``cuda_kernels``) or without CuPy;
        ``device_path``: the engine told they are off the host."""
        found = launcher if cuda_kernels else None
        cupy_group.launcher_for = lambda cfg, dtype, device, xp: found  # type: ignore[assignment]
        engine_module._in_host_memory = (lambda xp, array: False) if device_path else in_host_memory  # type: ignore[assignment]

    def paper(name: str) -> Any:
        """The paper's rule: ``name`` on the blocks' matrices, AdamW on the rest (two optimizers, one step)."""

        def make(params: list[torch.nn.Parameter]) -> Any:
            if name == "adamw":
                return at.AdamW(params, lr=1e-3, weight_decay=0.1)
            blocks = [p for p, r in zip(params, rotated, strict=True) if r]
            rest = [p for p, r in zip(params, rotated, strict=True) if not r]
            opts = [at.optimizer_class(name)(blocks, lr=1e-3, weight_decay=0.1, update_freq=None),
                    at.AdamW(rest, lr=1e-3, weight_decay=0.1)]  # fmt: skip
            return _Both(opts)

        return make

    def device_engines(params: list[torch.nn.Parameter]) -> Any:
        """``ar.Engine`` AdaDiag on the blocks, AdamW on the rest, stepped with ``check=True`` on the device path."""
        blocks = [p.detach() for p, r in zip(params, rotated, strict=True) if r]
        rest = [p.detach() for p, r in zip(params, rotated, strict=True) if not r]
        engines = [(ar.Engine(blocks, ar.make_config("adadiag", update_freq=None, weight_decay=0.1)), blocks,
                    [p for p, r in zip(params, rotated, strict=True) if r]),
                   (ar.Engine(rest, ar.make_config("adamw", weight_decay=0.1)), rest,
                    [p for p, r in zip(params, rotated, strict=True) if not r])]  # fmt: skip

        class Steps:
            def step(self) -> None:
                for engine, tensors, owners in engines:
                    engine.step([p.grad for p in owners], tensors, lr=1e-3, check=True)

        return Steps()

    # (label, optimizer, CUDA kernels, device path)
    rows = [("torch AdamW(fused=True)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
             False, False)]  # fmt: skip
    for name in ("adamw", "adadiag"):
        rows.append((f"adapter {name}, engine without CuPy (gathering path in torch ops)", paper(name), False, True))
        rows.append((f"adapter {name}, engine on the CUDA group kernels (counted, not run)", paper(name), True, False))
    rows.append(("ar.Engine adadiag, check=True, device path (counted, not run)", device_engines, True, True))
    results = {}
    for label, make, cuda_kernels, device_path in rows:
        route(cuda_kernels, device_path)
        results[label] = _count(make, fresh(), launcher if cuda_kernels else None)
    route(False, False)
    fused = sum(results[rows[0][0]][::2])
    print(f"{args.model}, {args.layers} blocks, {sum(int(np.prod(s.shape)) for s in specs) / 1e6:.1f} M entries, "
          "float32; passes per entry of one non-refresh step")  # fmt: skip
    print("| route | entrywise (aten) | group kernels | entrywise total | / fused AdamW | GEMM operands |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, (entrywise, gemm, kernels) in results.items():
        total = entrywise + kernels
        print(f"| {label} | {entrywise:.2f} | {kernels:.2f} | {total:.2f} | {total / fused:.2f} | {gemm:.2f} |")
    print(f"group kernel launches counted (the 3 steps of each kernel row): {dict(launcher.launches)}")
    kernels = sum(results[rows[2][0]][::2])
    print(f"fused AdamW's schema marks its gradients as written (it unscales them in place under a GradScaler), so "
          f"it counts {fused:.0f} here for {fused - 1:.0f} passes of traffic; against those, the group kernels' "
          f"AdamW is {kernels / (fused - 1):.2f}x (issue 31's target: <= 1.6x)")  # fmt: skip


if __name__ == "__main__":
    main()
