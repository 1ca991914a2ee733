"""Worker for ``test_flattening_wrappers.py``: the torch adapter under FSDP1 (gloo, CPU, 127.0.0.1 only).

FSDP1 with ``use_orig_params=True`` hands the optimizer 1-D views into each rank's shard of a flat parameter,
so no optimizer can see the matrices.  Each rank records what the adapter does with them: the error of the
constructor on wrapped parameters; for an optimizer built before wrapping, the error of its first ``step()``
(parameters and state unchanged) and of DCP's ``get_optimizer_state_dict``.
"""

from __future__ import annotations

import os

import _adapter_import  # noqa: F401
import torch
from _ranks import process_group
from adadiag_ref.adapters.pytorch import AdaDiag

WORLD = 2


def _error(call: object) -> str:
    try:
        call()  # type: ignore[operator]
    except RuntimeError as exc:
        return str(exc)
    return ""


def _report() -> dict[str, object]:
    """What FSDP1 does to the adapter on this rank (the wrapped model freed on return, while the group lives)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    inner = torch.nn.Sequential(
        torch.nn.Linear(6, 5, dtype=torch.float64), torch.nn.Tanh(), torch.nn.Linear(5, 3, dtype=torch.float64)
    )
    early = AdaDiag(inner.parameters(), lr=0.1, update_freq=2)  # built before wrapping: sees the true shapes
    model = FullyShardedDataParallel(inner, use_orig_params=True, device_id=torch.device("cpu"))
    report: dict[str, object] = {"constructor": _error(lambda: AdaDiag(model.parameters(), lr=0.1))}
    model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    report["step"] = _error(early.step)
    report["unchanged"] = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    report["state_empty"] = not early.state
    early.zero_grad(set_to_none=True)  # DCP initialises a state only when no gradient is set
    report["dcp"] = _error(lambda: get_optimizer_state_dict(model, early))
    report["shapes"] = [tuple(p.shape) for p in model.parameters()]
    return report


def worker(rank: int, port: int, out_dir: str) -> None:
    with process_group(rank, WORLD, port):
        torch.save(_report(), os.path.join(out_dir, f"fsdp1_rank{rank}.pt"))
