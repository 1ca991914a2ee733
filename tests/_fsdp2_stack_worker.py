"""Worker for ``test_fsdp2_stacks.py``: an expert stack ``(E, d, f)`` with ``batch_dims=1`` under FSDP2 (gloo, CPU).

The stack is one parameter sharded on dim 0 (``fully_shard``), so each rank holds whole experts (torch.chunk's
counts: 8 experts on 2 ranks 4 + 4, 5 experts 3 + 2).  The gradient of every step is set directly (the same whole
gradient on every rank, distributed as FSDP2 would hold it), so only the optimizer's collectives are counted
(``_sharded.traffic``).  Each rank reports its shard and offset, the single-process run's whole parameter, the
bytes per step and the entries of state it holds.
"""

from __future__ import annotations

import os
from typing import Any

import _adapter_import  # noqa: F401
import torch
from _ranks import process_group
from adadiag_ref.adapters import _sharded
from adadiag_ref.adapters.pytorch import OPTIMIZER_CLASSES

D, F, STEPS, FREQ = 6, 10, 4, 2  # refreshes at t = 1 and 3
NAMES = ("adadiag", "adadiag_pp", "adafacdiag")


class Experts(torch.nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(experts, D, F, generator=gen, dtype=torch.float64))


def grads(experts: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(experts, D, F, generator=gen, dtype=torch.float64) for _ in range(STEPS)]


def optimizer(name: str, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    return OPTIMIZER_CLASSES[name]([p], lr=1e-2, weight_decay=0.1, update_freq=FREQ, batch_dims=1)


def single_process(name: str, experts: int) -> torch.Tensor:
    module = Experts(experts)
    opt = optimizer(name, module.w)
    for g in grads(experts):
        module.w.grad = g.clone()
        opt.step()
    return module.w.detach().clone()


def sharded(name: str, experts: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    module = Experts(experts)
    fully_shard(module)
    p = module.w
    opt = optimizer(name, p)
    sent = []
    for g in grads(experts):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        with _sharded.traffic() as counted:
            opt.step()
        sent.append(counted.bytes)
    state = {k: tuple(_sharded.local(v).shape) for k, v in opt.state[p].items() if k != "step"}
    offset = _sharded.local_slices(p)[0].start
    return {
        "shard": _sharded.local(p).detach().clone(),
        "offset": offset,
        "sent": sent,
        "route": opt.routes()["param_groups[0].params[0]"],
        "state": state,
        "resumed": resumed(name, experts),
    }


def resumed(name: str, experts: int) -> torch.Tensor:
    """``STEPS - 1`` steps, ``state_dict()`` loaded into a fresh model and optimizer, the last step: this shard."""
    import copy

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    module = Experts(experts)
    fully_shard(module)
    opt = optimizer(name, module.w)
    for g in grads(experts)[:-1]:
        module.w.grad = distribute_tensor(g, module.w.device_mesh, module.w.placements)
        opt.step()
    saved, weights = copy.deepcopy(opt.state_dict()), _sharded.local(module.w).detach().clone()
    fresh = Experts(experts)
    fully_shard(fresh)
    with torch.no_grad():
        _sharded.local(fresh.w).copy_(weights)
    opt = optimizer(name, fresh.w)
    opt.load_state_dict(saved)
    fresh.w.grad = distribute_tensor(grads(experts)[-1], fresh.w.device_mesh, fresh.w.placements)
    opt.step()
    return _sharded.local(fresh.w).detach().clone()


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    with process_group(rank, world, port):
        results = {}
        for experts in (8, 5):
            for name in NAMES:
                results[(name, experts)] = {**sharded(name, experts), "whole": single_process(name, experts)}
        torch.save(results, os.path.join(out_dir, f"stack{rank}.pt"))
