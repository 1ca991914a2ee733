"""Communication of the torch adapter under FSDP2: bytes per step without refresh and per refresh step.

Run on demand (2 gloo processes on the CPU by default)::

    python benchmarks/sharded_traffic.py [--world 4]

For each case (a wide, tall and square matrix, a 1-D parameter, a wide and a tall (1x1) conv kernel) one
parameter is sharded with ``fully_shard``; its gradient is set directly (no forward pass, so only the
optimizer's collectives are counted) and two steps run: the refresh step ``t = 1`` and a step without refresh.
The bytes are the payloads of the collectives the adapter issues (``adapters/_sharded.py``'s counter: the
gathered whole tensor of an all-gather, the tensor of a broadcast or an all-reduce) on one rank, reported
against the gradient's own size (float32, so 4 bytes an entry).  Prints the markdown table of
``docs/adapters.md`` ("Sharded training").
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

import torch

CASES: dict[str, tuple[int, ...]] = {
    "wide": (64, 256),
    "tall": (256, 64),
    "square": (128, 128),
    "1-D": (256,),
    "conv": (32, 16, 3, 3),
    "conv 1x1, tall": (128, 32, 1, 1),
    "experts, batch_dims=1": (8, 32, 64),  # a stack: each rank holds whole experts (the stack route)
}
CASE_OPTIONS: dict[str, dict[str, Any]] = {"experts, batch_dims=1": {"batch_dims": 1}}
OPTIMIZERS = {"adamw": "AdamW", "adadiag": "AdaDiag (one-sided)", "adadiag_pp": "AdaDiag++ (two-sided)"}
WEIGHT_DECAY = 0.1  # decay reads W: the gathered route then gathers W as well as G


class _One(torch.nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))


def measure(names: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Rows ``{case, shape, optimizer, route, step, refresh, grad}`` (bytes on this rank) in a process group."""
    from adadiag_ref.adapters import _sharded
    from adadiag_ref.adapters.pytorch import OPTIMIZER_CLASSES
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    rows = []
    for case, shape in CASES.items():
        for name, label in (names or OPTIMIZERS).items():
            module = _One(shape)
            fully_shard(module)
            p = module.w
            options = CASE_OPTIONS.get(case, {})
            opt = OPTIMIZER_CLASSES[name]([p], lr=1e-3, weight_decay=WEIGHT_DECAY, update_freq=10, **options)
            gen = torch.Generator().manual_seed(1)
            counted = []
            for _ in range(2):  # t = 1 refreshes, t = 2 does not
                grad = torch.randn(shape, generator=gen)
                p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
                with _sharded.traffic() as traffic:
                    opt.step()
                counted.append(traffic.bytes)
            plan = _sharded.plan_for(p, opt.config())
            route = "block" if plan.block is not None else "stack" if plan.stack else "gathered"
            grad_bytes = p.numel() * p.element_size()
            rows.append({"case": case, "shape": shape, "optimizer": label, "route": route,
                         "refresh": counted[0], "step": counted[1], "grad": grad_bytes})  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: bytes and their ratio to the gradient's size."""
    lines = [
        "| case | shape | optimizer | route | step without refresh | refresh step |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{r[k]:,} B ({r[k] / r['grad']:.3g} G)" for k in ("step", "refresh")]
        lines.append(f"| {r['case']} | {r['shape']} | {r['optimizer']} | {r['route']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = measure()
        if rank == 0:
            print(f"{world} ranks, float32, weight_decay={WEIGHT_DECAY}; G = the gradient's bytes")
            print(table(rows))
    finally:
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    world = parser.parse_args().world
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    torch.multiprocessing.spawn(_worker, args=(world, port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
