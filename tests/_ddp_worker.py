"""Worker for ``test_distributed.py``: the torch adapter under DDP (gloo, CPU, 127.0.0.1 only).

Every rank trains the same float64 model on its own shard of the batch; DDP
averages the gradients, so every rank feeds the identical gradient to the
optimizer and must end with bit-identical parameters.  ``reference_run`` is the
single-process run on the same shards (gradients averaged by hand).
"""

from __future__ import annotations

import os

import _adapter_import  # noqa: F401
import torch
from adadiag_ref.adapters.pytorch import OPTIMIZER_CLASSES

STEPS, FREQ, WORLD = 9, 3, 2  # refreshes at t = 1, 4, 7


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5, dtype=torch.float64), torch.nn.Tanh(), torch.nn.Linear(5, 3, dtype=torch.float64)
    )


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randn(8, 3, generator=gen, dtype=torch.float64)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def reference_run(name: str) -> list[torch.Tensor]:
    """One process: the gradient is the mean of the per-shard gradients, as DDP's allreduce gives it."""
    model = make_model()
    opt = OPTIMIZER_CLASSES[name](model.parameters(), lr=0.01, weight_decay=0.1, update_freq=FREQ)
    for step in range(STEPS):
        shard_grads = []
        for rank in range(WORLD):
            model.zero_grad()
            _loss(model, *data(step, rank)).backward()
            shard_grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *shard_grads):
            p.grad = sum(g / WORLD for g in gs)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def worker(rank: int, port: int, out_dir: str, names: list[str]) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for split in (False, True):
            for name in names:
                model = torch.nn.parallel.DistributedDataParallel(make_model())
                opt = OPTIMIZER_CLASSES[name](
                    model.parameters(), lr=0.01, weight_decay=0.1, update_freq=FREQ, split_refresh=split
                )
                for step in range(STEPS):
                    opt.zero_grad()
                    _loss(model, *data(step, rank)).backward()
                    opt.step()
                results[name + ("/split" if split else "")] = [p.detach().clone() for p in model.parameters()]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()
