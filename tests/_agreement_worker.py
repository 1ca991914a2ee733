"""Worker for ``test_rank_agreement.py``: ranks that disagree on a step (gloo, CPU, 127.0.0.1 only).

Per case ``(wrapper, fault)``: a float64 model of three bias-free ``nn.Linear`` layers (square, tall, wide: under
FSDP2 the tall one takes the block route, the others the gathered one) wrapped by DDP (``split_refresh`` off or
on) or FSDP2, trained by AdaDiag with a refresh at every step (``update_freq=1``: a refresh step is where the
collectives are).  Step 1 is clean; at step 2 rank 0's gradient of the first layer is removed (``"missing"``), one
entry of it is NaN (``"nan"``), or rank 0's ``refresh_basis`` raises (``"refresh"``), and the documented
catch-and-skip runs (``except (ValueError, RuntimeError)``); step 3 is clean again.  Each rank reports the message
it raised, whether its parameters and state were unchanged by the failed step, and its parameters after step 3
(whole tensors; FSDP2's gathered once at the end).
"""

from __future__ import annotations

import os
from typing import Any

import _adapter_import  # noqa: F401
import torch
from _ranks import process_group
from adadiag_ref.adapters import _sharded
from adadiag_ref.adapters.pytorch import AdaDiag

import adadiag_ref as ar

WRAPPERS = ("ddp", "ddp_split", "fsdp2")
FAULTS = ("missing", "nan")
REFRESH_FAULT = "refresh"  # the owner's decomposition raises (split_refresh and FSDP2: the ranks that broadcast)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    f64 = {"dtype": torch.float64, "bias": False}
    layers = [torch.nn.Linear(8, 8, **f64), torch.nn.Linear(8, 16, **f64), torch.nn.Linear(16, 8, **f64)]
    return torch.nn.Sequential(*layers)


def wrap(model: torch.nn.Module, wrapper: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(wrapped, inner)``: the model the loss runs through and the ``nn.Sequential`` whose layers are named."""
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model, model
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return ddp, ddp.module


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank), dtype=torch.float64)


def _raises(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected: the decomposition failed on this rank")


def snapshot(inner: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's parameters and state tensors (local shards), copied."""
    out = [_sharded.local(p).detach().clone() for p in inner.parameters()]
    for p in inner.parameters():
        out += [_sharded.local(v).detach().clone() for v in opt.state.get(p, {}).values()]
    return out


def run_case(rank: int, wrapper: str, fault: str) -> dict[str, Any]:
    model, inner = wrap(make_model(), wrapper)
    opt = AdaDiag(model.parameters(), lr=1e-2, update_freq=1, split_refresh=wrapper == "ddp_split")
    message, unchanged = "", False
    for step in (1, 2, 3):
        opt.zero_grad()
        model(batch(step, rank)).square().sum().backward()
        if step == 2:
            if rank == 0 and fault == "missing":
                inner[0].weight.grad = None
            elif rank == 0 and fault == "nan":
                _sharded.local(inner[0].weight.grad)[0, 0] = float("nan")
            before = snapshot(inner, opt)
            original = ar.refresh_basis
            if rank == 0 and fault == REFRESH_FAULT:
                ar.refresh_basis = _raises  # type: ignore[assignment]
            try:
                opt.step()
            except (ValueError, RuntimeError) as exc:  # the documented catch-and-skip
                message = str(exc)
            finally:
                ar.refresh_basis = original  # type: ignore[assignment]
            after = snapshot(inner, opt)
            unchanged = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
            continue
        opt.step()
    params = [(p.full_tensor() if _sharded.is_sharded(p) else p).detach().clone() for p in inner.parameters()]
    return {"message": message, "unchanged": unchanged, "params": params}


def worker(rank: int, world: int, port: int, out_dir: str, cases: list[tuple[str, str]]) -> None:
    torch.set_num_threads(1)
    with process_group(rank, world, port):
        results = {}
        for wrapper, fault in cases:
            results[f"{wrapper}/{fault}"] = run_case(rank, wrapper, fault)
            torch.save(results, os.path.join(out_dir, f"agree{rank}.pt"))  # what finished, even if a later case hangs
