"""Worker for ``test_fsdp2.py``: the torch adapter under FSDP2 (``fully_shard``, gloo, CPU, 127.0.0.1 only).

A float64 model with wide, tall and square ``nn.Linear`` layers, their biases (1-D), a wide and a tall
``Conv2d`` kernel, split in two parameter groups, is sharded with ``fully_shard`` (each layer, then the root)
over ``world`` ranks.  Every rank feeds the same batch, so FSDP2's averaged gradient is the single-process
gradient (to one rounding for 4 ranks); ``reference_run`` is that single process.  Each rank saves its shards
with their offsets in the whole parameters.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import _adapter_import  # noqa: F401
import torch
from _ranks import process_group
from adadiag_ref.adapters.pytorch import OPTIMIZER_CLASSES

import adadiag_ref as ar

STEPS, FREQ = 5, 2  # refreshes at t = 1, 3, 5


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    f64 = {"dtype": torch.float64}
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 9, 1, **f64),  # tall kernel (9, 2, 1, 1): work frame 2 x 9, the split side unrotated
        torch.nn.Tanh(),
        torch.nn.Conv2d(9, 3, 2, **f64),  # wide kernel (3, 9, 2, 2): work frame 3 x 36, the split side rotated
        torch.nn.Flatten(),
        torch.nn.Linear(12, 6, **f64),  # wide (6, 12)
        torch.nn.Tanh(),
        torch.nn.Linear(6, 10, **f64),  # tall (10, 6)
        torch.nn.Tanh(),
        torch.nn.Linear(10, 10, **f64),  # square
        torch.nn.Linear(10, 4, **f64),
    )


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Mixed groups: the weights but the square one with decay; the biases and the square weight without, at
    another learning rate."""
    named = list(model.named_parameters())
    decayed = [p for n, p in named if n.endswith("weight") and not n.startswith("8.")]
    rest = [p for n, p in named if not (n.endswith("weight") and not n.startswith("8."))]
    return [{"params": decayed, "weight_decay": 0.1}, {"params": rest, "lr": 0.02, "weight_decay": 0.0}]


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    return OPTIMIZER_CLASSES[name](param_groups(model), lr=0.01, update_freq=FREQ)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 2, 3, 3, generator=gen, dtype=torch.float64)
    return x, torch.randn(8, 4, generator=gen, dtype=torch.float64)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(batch(step)[0]), batch(step)[1]).backward()
        opt.step()


def reference_run(name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The single-process run: parameters by name, state tensors keyed as :func:`local_state`."""
    model = make_model()
    opt = make_optimizer(name, model)
    train(model, opt, range(STEPS))
    params = (p for group in opt.param_groups for p in group["params"])
    states = {f"{i}.{k}": v.clone() for i, p in enumerate(params) for k, v in opt.state[p].items()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, states


def sharded_model(world: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return model


def shards(model: torch.nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """Each parameter's local shard and its offset on dim 0 in the whole parameter."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for n, p in model.named_parameters():
        _, offset = compute_local_shape_and_global_offset(tuple(p.shape), p.device_mesh, tuple(p.placements))
        out[n] = (int(offset[0]), p.to_local().detach().clone())
    return out


SAVE_AT = 2  # checkpoint after t = 2: the resumed run crosses the refreshes at t = 3 and 5


def local_state(opt: torch.optim.Optimizer) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    """Every state tensor of ``opt`` as this rank holds it (a DTensor's local shard, with its offset in the whole
    tensor; zeros for a plain tensor), keyed by ``"<parameter index>.<field>"`` in group order."""
    from adadiag_ref.adapters import _sharded
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for i, p in enumerate(p for group in opt.param_groups for p in group["params"]):
        for key, value in opt.state[p].items():
            offset = (0,) * value.ndim
            if _sharded.is_sharded(value):
                _, offset = compute_local_shape_and_global_offset(
                    tuple(value.shape), value.device_mesh, tuple(value.placements)
                )
            out[f"{i}.{key}"] = (tuple(offset), _sharded.local(value).detach().clone())
    return out


def _checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _counting_decompositions(counts: Counter[str]) -> Any:
    """Replace ``ar.refresh_basis`` (which the adapter calls for every matrix it decomposes) by a counting
    wrapper; returns the original."""
    original = ar.refresh_basis

    def counted(state: Any, grad: torch.Tensor, cfg: Any, **kwargs: Any) -> Any:
        counts[cfg.name] += 1
        return original(state, grad, cfg, **kwargs)

    ar.refresh_basis = counted  # type: ignore[assignment]
    return original


def _resumed_run(name: str, world: int, path: str) -> tuple[Any, Any]:
    """``SAVE_AT`` steps, a DCP checkpoint, a fresh model and optimizer loaded from it, the remaining steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model = sharded_model(world)
    opt = make_optimizer(name, model)
    train(model, opt, range(SAVE_AT))
    dcp.save(_checkpoint(model, opt), checkpoint_id=path)
    model = sharded_model(world)
    opt = make_optimizer(name, model)
    loaded = _checkpoint(model, opt)
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(model, loaded["model"])
    set_optimizer_state_dict(model, opt, loaded["optim"])
    train(model, opt, range(SAVE_AT, STEPS))
    return shards(model), local_state(opt)


def _traffic_rows() -> list[dict[str, Any]]:
    """``benchmarks/sharded_traffic.py``'s measurement (the table of docs/adapters.md) in this process group."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import sharded_traffic
    finally:
        sys.path.pop(0)
    return sharded_traffic.measure()


def _loaded_from_single_process(name: str, world: int) -> Any:
    """``SAVE_AT`` single-process steps (in this process), their parameters and ``state_dict()`` (whole tensors)
    loaded into a sharded model and optimizer (``load_state_dict`` keeps each rank's block), the remaining
    steps sharded; returns the shards."""
    from adadiag_ref.adapters import _sharded

    single = make_model()
    single_opt = make_optimizer(name, single)
    train(single, single_opt, range(SAVE_AT))
    model = sharded_model(world)
    with torch.no_grad():
        for p, whole in zip(model.parameters(), single.parameters(), strict=True):
            _sharded.local(p).copy_(whole[_sharded.local_slices(p)])
    opt = make_optimizer(name, model)
    opt.load_state_dict(single_opt.state_dict())
    train(model, opt, range(SAVE_AT, STEPS))
    return shards(model)


def _nan_on_one_rank(world: int, rank: int) -> dict[str, bool]:
    """A NaN in rank 1's shard of one gradient at step 2: every rank must raise ``ValueError`` (the verdict is
    all-reduced, so no rank steps into a collective the others skip) and leave parameters and state unchanged."""
    from adadiag_ref.adapters import _sharded

    model = sharded_model(world)
    opt = make_optimizer("adadiag", model)
    train(model, opt, range(1))
    before = (shards(model), local_state(opt))
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(batch(1)[0]), batch(1)[1]).backward()
    if rank == 1:
        _sharded.local(model[6].weight.grad)[0, 0] = float("nan")  # the tall Linear: the block route
    try:
        opt.step()
        message = ""
    except ValueError as exc:
        message = str(exc)
    after = (shards(model), local_state(opt))
    unchanged = all(torch.equal(before[0][k][1], after[0][k][1]) for k in before[0]) and all(
        torch.equal(before[1][k][1], after[1][k][1]) for k in before[1]
    )
    return {"raised": "NaN or Inf" in message and "at step 2" in message, "unchanged": unchanged}


def _straight_run(name: str, world: int, decompositions: Counter[str]) -> tuple[Any, Any, Any]:
    """The uninterrupted run's shards and states, the decompositions counted (the sharded model and its optimizer
    freed on return, while the group lives), and ``opt.routes()`` after it, as ``(shape, route)`` in group order."""
    original = _counting_decompositions(decompositions)
    try:
        model = sharded_model(world)
        opt = make_optimizer(name, model)
        train(model, opt, range(STEPS))
    finally:
        ar.refresh_basis = original  # type: ignore[assignment]
    shapes = [tuple(p.shape) for group in opt.param_groups for p in group["params"]]
    return shards(model), local_state(opt), list(zip(shapes, opt.routes().values(), strict=True))


def worker(rank: int, world: int, port: int, out_dir: str, names: list[str], resume: bool) -> None:
    """Per optimizer of ``names``: the uninterrupted run's shards and states, the number of decompositions this
    rank ran in it, and with ``resume`` the same after a DCP save and load at ``SAVE_AT``; saved per rank."""
    torch.set_num_threads(1)  # tiny matrices, more ranks than cores: one thread each avoids oversubscription
    decompositions: Counter[str] = Counter()
    with process_group(rank, world, port):
        results: dict[str, Any] = {}
        for name in names:
            results[name] = {"straight": _straight_run(name, world, decompositions)}
            if resume:
                results[name]["resumed"] = _resumed_run(name, world, os.path.join(out_dir, f"checkpoint-{name}"))
                results[name]["from_single"] = _loaded_from_single_process(name, world)
        traffic = _traffic_rows() if resume else []
        nan = _nan_on_one_rank(world, rank) if resume else {}
        torch.save(
            {"runs": results, "decompositions": dict(decompositions), "traffic": traffic, "nan": nan},
            os.path.join(out_dir, f"r{rank}.pt"),
        )
