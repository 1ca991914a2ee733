"""Ranks that disagree on a step end it together: the same ``ValueError`` on every rank, nothing changed.

2 processes (gloo, CPU), per wrapper (DDP without and with ``split_refresh``, FSDP2) a missing gradient and a NaN on
rank 0 only, at a refresh step, and where ranks broadcast bases (``split_refresh``, FSDP2) a refresh that raises on
its owner (tests/_agreement_worker.py).  The harness kills the ranks after ``DEADLINE`` s, so
a rank left waiting in a collective fails the test instead of hanging CI.  After the skipped step the ranks train
on: DDP's ranks hold the same bits (they feed identical gradients to identical code).  The error's wording is a pure
function of the ranks' table (``_sharded.disagreement``), tested here without processes.
"""

from __future__ import annotations

import _adapter_import  # noqa: F401
import pytest

torch = pytest.importorskip("torch")

from _ranks import free_port, spawn_ranks  # noqa: E402
from adadiag_ref.adapters import _sharded  # noqa: E402

multiprocess = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built"),
]

WORLD = 2
DEADLINE = 60.0  # seconds for both cases of a wrapper (observed: a few seconds, most of it importing torch)


@multiprocess[0]
@multiprocess[1]
@pytest.mark.parametrize("wrapper", ["ddp", "ddp_split", "fsdp2"])
def test_a_fault_on_one_rank_raises_the_same_error_on_every_rank(tmp_path, wrapper):
    import _agreement_worker

    faults = [*_agreement_worker.FAULTS, *([_agreement_worker.REFRESH_FAULT] if wrapper != "ddp" else [])]
    cases = [(wrapper, fault) for fault in faults]
    spawn_ranks(_agreement_worker.worker, (WORLD, free_port(), str(tmp_path), cases), WORLD, DEADLINE)
    ranks = [torch.load(tmp_path / f"agree{r}.pt") for r in range(WORLD)]
    for wrapper_, fault in cases:
        key = f"{wrapper_}/{fault}"
        messages = [result[key]["message"] for result in ranks]
        assert messages[0] and messages == [messages[0]] * WORLD, (key, messages)  # one error, the same everywhere
        if fault == _agreement_worker.REFRESH_FAULT:  # the owner's refresh raised: its name and rank
            assert "basis refresh of param_groups[0].params[0] raised on rank 0" in messages[0], messages[0]
        else:
            assert "parameter 0 of param_groups[0]" in messages[0], messages[0]  # the parameter ...
            assert "rank 0" in messages[0] and "rank 1" in messages[0], messages[0]  # ... and the ranks
            assert ("NaN or Inf" if fault == "nan" else "is None") in messages[0], messages[0]
        assert "no parameter and no optimizer state was changed" in messages[0], messages[0]
        assert all(result[key]["unchanged"] for result in ranks), key
        if wrapper_ != "fsdp2":  # DDP: identical gradients into identical code, so identical bits after the skip
            for p0, p1 in zip(ranks[0][key]["params"], ranks[1][key]["params"], strict=True):
                assert torch.equal(p0, p1), key


WHERES = ["parameter 'a'", "parameter 'b'"]
OK, NONE, NAN, BAD = _sharded.HAS_GRAD, _sharded.NO_GRAD, _sharded.HAS_GRAD | _sharded.NONFINITE, _sharded.INVALID


def _table(*rows: list[tuple[int, int]]) -> torch.Tensor:
    """Rows per rank, ``(code, count)`` per parameter, as ``_sharded.exchange`` returns them."""
    return torch.tensor(rows, dtype=torch.int32)


def test_agreeing_ranks_raise_nothing():
    assert _sharded.disagreement(_table([(OK, 3), (NONE, 0)], [(OK, 3), (NONE, 0)]), WHERES, [0, 1]) is None


FAULTS = [  # (rank 2's row, rank 3's row), the message
    (
        ([(OK, 1), (OK, 1)], [(OK, 1), (NONE, 0)]),
        "gradient of parameter 'b' is None on rank 3 and present on rank 2 at step 2: every rank must step the same "
        "parameters",
    ),
    (
        ([(NAN, 1), (OK, 1)], [(OK, 1), (OK, 1)]),
        "gradient of parameter 'a' contains NaN or Inf at step 2 on rank 2, finite on rank 3",
    ),
    (
        ([(NAN, 4), (OK, 1)], [(NAN, 4), (OK, 1)]),
        "gradient of parameter 'a' contains NaN or Inf at step 5 on ranks 2, 3",
    ),
    (
        ([(OK, 1), (OK | BAD, 1)], [(OK, 1), (OK, 1)]),
        "gradient of parameter 'b' does not match its parameter (shape, dtype or layout) on rank 2",
    ),
    (
        ([(OK, 1), (OK, 7)], [(OK, 1), (OK, 6)]),
        "the ranks' optimizers have taken different numbers of steps for parameter 'b' (7 on rank 2, 6 on rank 3)",
    ),
]


@pytest.mark.parametrize(("rows", "expected"), FAULTS)
def test_the_first_fault_is_named_with_its_ranks(rows, expected):
    """The first parameter at fault, in the optimizer's order, with the global ranks of the rows (here 2 and 3)."""
    assert _sharded.disagreement(_table(*rows), WHERES, [2, 3]) == expected
