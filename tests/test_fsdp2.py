"""The torch adapter under FSDP2 (``fully_shard``: DTensor parameters), 2 and 4 processes (gloo, CPU).

``_fsdp2_worker`` trains a model with wide, tall, square, 1-D and conv parameters in two parameter groups under
every optimizer.  Tolerances: every rank feeds the same batch, so FSDP2's averaged gradient equals the
single-process gradient to one rounding; the sharded step runs the core's own functions on the same numbers
(the block route on column blocks of the same products), so each rank's shard must match the single-process
parameter to rtol 1e-10 (float64; observed: equal bit for bit).  A DCP save and load into a fresh model and
optimizer, resumed across two refreshes, must give the uninterrupted run's shards and states bit for bit (the
same code on the same numbers); a single-process ``state_dict()`` loaded into the sharded optimizer continues
that run (rtol 1e-10).  A NaN in one rank's shard makes every rank raise with nothing changed, and the
communication of a step without refresh is the exact byte count of the design (benchmarks/sharded_traffic.py).
"""

from __future__ import annotations

import _adapter_import  # noqa: F401
import pytest

torch = pytest.importorskip("torch")

from _ranks import free_port, spawn_ranks  # noqa: E402

import adadiag_ref as ar  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built"),
]
DEADLINE = 600.0  # seconds for one run of every optimizer (observed: under a minute for 4 ranks on 2 cores)


def _run(tmp_path, world: int, resume: bool) -> list[dict]:
    import _fsdp2_worker

    names = list(ar.OPTIMIZERS)
    spawn_ranks(_fsdp2_worker.worker, (world, free_port(), str(tmp_path), names, resume), world, DEADLINE)
    return [torch.load(tmp_path / f"r{r}.pt") for r in range(world)]


def _expected_route(shape: tuple[int, ...], cfg) -> tuple[str, str]:
    """``(refresh, moments)`` prefixes of a ``Shard(0)`` parameter's route, from the module docstring of
    ``adapters/_sharded.py``: the block route where the rows split a work-frame side that is not rotated (the
    columns of a tall matrix or a vector, else the rows) under the Adam family, else the gathered one."""
    layout = ar.layout_for(shape, cfg)
    columns = layout.transposed or len(shape) == 1
    split_side_rotated = layout.rotate_right if columns else layout.rotate_left
    adam = cfg.name in ("adamw", "adadiag", "adadiag_pp")
    moments = "sharded block" if adam and not split_side_rotated else "sharded gathered"
    return ("sharded owner" if layout.rotate_left else "none (no basis)"), moments


def _check_against_single_process(ranks: list[dict], world: int) -> None:
    import _fsdp2_worker

    shapes = [tuple(p.shape) for p in _fsdp2_worker.make_model().parameters()]
    for name in ar.OPTIMIZERS:
        cfg = ar.make_config(name, update_freq=_fsdp2_worker.FREQ)
        rotated = sum(ar.layout_for(shape, cfg).rotate_left for shape in shapes)
        refreshes = sum(ar.refresh_due(count, cfg) for count in range(_fsdp2_worker.STEPS))
        reference, reference_states = _fsdp2_worker.reference_run(name)
        for rank, result in enumerate(ranks):
            shards, states, routes = result["runs"][name]["straight"]
            for shape, route in routes:  # routes() reads the sharded plan the step took (adapters/_sharded.py)
                refresh, moments = _expected_route(shape, cfg)
                assert route["refresh"].startswith(refresh), (name, shape, route)
                assert route["moments"].startswith(moments), (name, shape, route)
            assert set(shards) == set(reference)
            for key, (offset, shard) in shards.items():
                expected = reference[key][offset : offset + shard.shape[0]]
                torch.testing.assert_close(shard, expected, rtol=1e-10, atol=1e-13, msg=f"{name} {key} rank {rank}")
            # the state too: whole (replicated) tensors, or this rank's block of the single-process moment
            assert set(states) == set(reference_states), (name, rank)
            for key, (offset, value) in states.items():
                whole = reference_states[key]
                expected = whole[tuple(slice(o, o + n) for o, n in zip(offset, value.shape, strict=True))]
                assert value.shape == expected.shape, (name, key, rank)
                torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-13, msg=f"{name} {key} rank {rank}")
            # each decomposition ran once across the ranks, dealt round-robin: the rotated matrices / world each
            assert result["decompositions"].get(name, 0) == rotated * refreshes // world, (name, rank)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_shards_equal_single_process_run_and_dcp_resume_is_bit_identical(tmp_path, world):
    resume = world == 2  # DCP on the 2-rank run only, to keep the test time (the code path is the same)
    ranks = _run(tmp_path, world, resume)
    _check_against_single_process(ranks, world)
    if not resume:
        return
    for rank, result in enumerate(ranks):
        for name, runs in result["runs"].items():
            (shards, states, _), (shards_resumed, states_resumed) = runs["straight"], runs["resumed"]
            for key, (_, shard) in shards.items():
                assert torch.equal(shard, shards_resumed[key][1]), (name, key, rank)
            assert states.keys() == states_resumed.keys(), (name, rank)
            for key, (_, value) in states.items():
                assert torch.equal(value, states_resumed[key][1]), (name, key, rank)
            # a single-process state_dict (whole tensors) loaded into the sharded optimizer continues the same run
            for key, (_, shard) in shards.items():
                torch.testing.assert_close(runs["from_single"][key][1], shard, rtol=1e-10, atol=1e-13)
    # a NaN in one rank's shard: every rank raises before anything is written
    for rank, result in enumerate(ranks):
        assert result["nan"] == {"raised": True, "unchanged": True}, rank
    # communication (benchmarks/sharded_traffic.py, float32): a step without refresh sends only the ranks'
    # agreement (8 bytes per parameter: CoreOptimizer._agreed) on the block route; the gathered route all-gathers
    # G and W (weight decay on)
    for row in ranks[0]["traffic"]:
        expected = 8 if row["route"] in ("block", "stack") else 2 * row["grad"] + 8
        assert row["step"] == expected, row
        assert row["refresh"] >= row["step"], row
    routes = {(row["case"], row["optimizer"]): row["route"] for row in ranks[0]["traffic"]}
    assert routes[("tall", "AdaDiag (one-sided)")] == routes[("1-D", "AdaDiag (one-sided)")] == "block"
    assert routes[("wide", "AdaDiag (one-sided)")] == routes[("tall", "AdaDiag++ (two-sided)")] == "gathered"
    stacks = {route for (case, _), route in routes.items() if case.startswith("experts")}
    assert stacks == {"stack"}  # whole experts per rank: stepped and refreshed where they are, nothing gathered
