"""Expert stacks (``batch_dims=1``) under FSDP2: each rank steps and refreshes the whole experts it holds.

2 processes (gloo, CPU; tests/_fsdp2_stack_worker.py), AdaDiag, AdaDiag++ and AdafacDiag on a float64 ``(E, 6, 10)``
stack, 8 experts (4 + 4) and 5 (3 + 2), 4 steps across 2 refreshes.  Each rank's experts must equal the
single-process run's: the same core functions on the same matrices (a stack's matrices are independent), checked
at the golden float64 tolerance (rtol 1e-12; the batched GEMM and SVD of a shorter stack may round differently).
Every step sends the ranks' agreement only (8 bytes for the one parameter), a refresh step adds the 4-byte flag
that says whether a rank's refresh raised (so every rank raises then), and each rank
holds the state of its experts only; its ``state_dict()``, loaded into a fresh optimizer, resumes bit for bit, and
``opt.routes()`` names the stack route.  Killed
after ``DEADLINE`` s.
"""

from __future__ import annotations

import _adapter_import  # noqa: F401
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built"),
]

WORLD, DEADLINE = 2, 120.0


def test_expert_stacks_are_stepped_by_their_owner_without_traffic(tmp_path):
    import _fsdp2_stack_worker as stack
    from _ranks import free_port, spawn_ranks

    spawn_ranks(stack.worker, (WORLD, free_port(), str(tmp_path)), WORLD, DEADLINE)
    ranks = [torch.load(tmp_path / f"stack{r}.pt") for r in range(WORLD)]
    for (name, experts), _ in ranks[0].items():
        held = 0
        for rank, result in enumerate(ranks):
            run = result[(name, experts)]
            mine = run["shard"].shape[0]
            expected = run["whole"][run["offset"] : run["offset"] + mine]
            torch.testing.assert_close(run["shard"], expected, rtol=1e-12, atol=1e-14, msg=f"{name} {experts} {rank}")
            # the agreement (8 bytes), and at a refresh step (k % FREQ == 0) the stack's refresh-failure flag (4)
            expected = [8 + 4 * (k % stack.FREQ == 0) for k in range(stack.STEPS)]
            assert run["sent"] == expected, (name, experts, rank, run["sent"])
            assert torch.equal(run["resumed"], run["shard"]), (name, experts, rank)  # state_dict() resumes bit for bit
            # routes() names the stack route the step took: no owner's broadcast, each rank refreshes its own
            assert run["route"]["refresh"].startswith("sharded stack"), (name, experts, rank, run["route"])
            assert run["route"]["moments"].startswith("sharded stack"), (name, experts, rank, run["route"])
            for key, shape in run["state"].items():  # the counter and param_shape aside: this rank's experts only
                if key != "param_shape":
                    assert shape[0] == mine, (name, experts, rank, key, shape)
            held += mine
        assert held == experts
