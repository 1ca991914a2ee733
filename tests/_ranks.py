"""Processes for the multi-process tests (gloo, CPU): a free port, and ranks spawned with a deadline and a clean exit.

A rank that returns leaves through ``os._exit(0)``, skipping the interpreter's finalization: its results are on
disk by then, and finalization is where torch's gloo and TCPStore threads may still be torn down.  A C++ thread
destroyed while joinable calls ``std::terminate`` ("terminate called without an active exception", SIGABRT); CI
saw that once in ``test_fsdp2_stacks`` (both ranks; pytorch/pytorch#179291 describes such a race at
finalization).  A rank that raises keeps torch's handling: its traceback is the test's error.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for ``init_method=tcp://``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def process_group(rank: int, world: int, port: int) -> Iterator[None]:
    """The gloo process group of one rank (127.0.0.1 only) around the body.  On the way out the garbage is
    collected and, after a body that returned, the ranks meet at a barrier, before the group is destroyed: no DDP
    reducer, FSDP module or DTensor outlives the group (a DDP model freed after it hung its rank in the teardown,
    4 runs in 45 and 2 in 40 on 2 busy cores under glibc's malloc checks; 0 in 45 so), and no rank tears its group
    down while a peer still has a collective in flight.  A worker keeps its models in helper functions, so that
    they are freed when those return."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
        gc.collect()
        torch.distributed.barrier()  # every rank's collectives done before any rank tears its group down
    finally:
        gc.collect()
        torch.distributed.destroy_process_group()


def _rank_main(rank: int, fn: Callable[..., None], *args: Any) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: Callable[..., None], args: tuple, world: int, deadline: float) -> None:
    """``fn(rank, *args)`` in ``world`` processes (``torch.multiprocessing.spawn``); a rank's exception fails the
    test with its traceback, and after ``deadline`` seconds every rank is killed and the test fails (a rank left
    waiting in a collective fails CI instead of hanging it)."""
    context = torch.multiprocessing.spawn(_rank_main, args=(fn, *args), nprocs=world, join=False)
    end = time.monotonic() + deadline
    while not context.join(timeout=max(0.0, min(1.0, end - time.monotonic()))):
        if time.monotonic() >= end:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join(5)
            pytest.fail(f"the ranks did not finish within {deadline:.0f} s: a rank waits in a collective (a hang)")
