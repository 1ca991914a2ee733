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
from _ranks import process_group
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


def _ddp_run(rank: int, name: str, split: bool) -> list[torch.Tensor]:
    """One optimizer's DDP training on this rank: the parameters at the end (the DDP model and the optimizer are
    freed on return, while the process group still lives)."""
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = OPTIMIZER_CLASSES[name](model.parameters(), lr=0.01, weight_decay=0.1, update_freq=FREQ, split_refresh=split)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, *data(step, rank)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def worker(rank: int, port: int, out_dir: str, names: list[str]) -> None:
    with process_group(rank, WORLD, port):
        results = {name + ("/split" if split else ""): _ddp_run(rank, name, split)
                   for split in (False, True) for name in names}  # fmt: skip
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


KEPT_NAMES = ["adadiag", "adadiag_pp", "adafacdiag", "hfacdiag"]
KEPT_STEPS, KEPT_FREQ, KEPT_FAULT = 6, 2, 3  # refreshes due at t = 1, 3, 5; the one at t = 3 fails and keeps P


def kept_basis_stream(name: str, rank: int | None) -> list[torch.Tensor]:
    """Two (5, 7) parameters (one owned by each rank under split_refresh) trained on rank-2 gradients ``A B_t``
    (``P^T G`` then has rows of rounding noise, which the refresh-step structure zeroes on a refresh step only); the
    decomposition fails at ``t = KEPT_FAULT``.  ``rank=None``: the core's ``ar.step``, in one process."""
    import warnings

    import numpy as np

    import adadiag_ref as ar
    from adadiag_ref import linalg

    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 7, generator=gen, dtype=torch.float64) for _ in range(2)]
    spans = [torch.randn(5, 2, generator=gen, dtype=torch.float64) for _ in params]
    cfg = ar.make_config(name, update_freq=KEPT_FREQ)
    if rank is None:
        states = [ar.init(p, cfg) for p in params]
    else:
        params = [torch.nn.Parameter(p) for p in params]
        opt = OPTIMIZER_CLASSES[name](params, lr=0.01, update_freq=KEPT_FREQ, split_refresh=True)
    ladder = linalg.DECOMPOSITION_LADDER

    def broken(*args: object, **kwargs: object) -> None:
        raise np.linalg.LinAlgError("injected: SVD did not converge")

    for t in range(1, KEPT_STEPS + 1):
        grads = [a @ torch.randn(2, 7, generator=gen, dtype=torch.float64) for a in spans]
        if t == KEPT_FAULT:
            linalg.DECOMPOSITION_LADDER = [(rung, broken) for rung, _ in ladder]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", linalg.DecompositionWarning)
                if rank is None:
                    for i, g in enumerate(grads):
                        params[i], states[i] = ar.step(states[i], g, cfg, params[i], lr=0.01)
                else:
                    for p, g in zip(params, grads, strict=True):
                        p.grad = g
                    opt.step()
        finally:
            linalg.DECOMPOSITION_LADDER = ladder
    return [p.detach().clone() for p in params]


def kept_basis_worker(rank: int, port: int, out_dir: str) -> None:
    with process_group(rank, WORLD, port):
        results = {name: kept_basis_stream(name, rank) for name in KEPT_NAMES}
        torch.save(results, os.path.join(out_dir, f"kept{rank}.pt"))
