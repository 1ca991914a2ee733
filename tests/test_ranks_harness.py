"""The multi-process tests' harness (tests/_ranks.py): a rank that finished its work leaves without the
interpreter's finalization, so a C++ thread torn down there (gloo's, the TCPStore's) cannot abort a passing run;
a rank that raises still fails the test with its error; a rank that hangs is killed at the deadline."""

from __future__ import annotations

import atexit
import os

import _adapter_import  # noqa: F401
import pytest

torch = pytest.importorskip("torch")

from _ranks import spawn_ranks  # noqa: E402

pytestmark = pytest.mark.slow  # processes


def _aborts_at_exit(rank: int, out_dir: str) -> None:
    atexit.register(os.abort)  # finalization's SIGABRT, as a joinable std::thread's destructor raises it
    with open(os.path.join(out_dir, f"done{rank}"), "w") as f:
        f.write("ok")


def _raises(rank: int, out_dir: str) -> None:
    raise ValueError(f"rank {rank} refuses")


def _hangs(rank: int, out_dir: str) -> None:
    import time

    time.sleep(60)


def test_a_rank_that_finished_leaves_without_finalization(tmp_path):
    spawn_ranks(_aborts_at_exit, (str(tmp_path),), 2, 60.0)
    assert sorted(os.listdir(tmp_path)) == ["done0", "done1"]


def test_a_rank_that_raises_fails_with_its_error(tmp_path):
    with pytest.raises(Exception, match=r"rank [01] refuses"):
        spawn_ranks(_raises, (str(tmp_path),), 2, 60.0)


def test_a_rank_that_hangs_is_killed_at_the_deadline(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="did not finish within 3 s"):
        spawn_ranks(_hangs, (str(tmp_path),), 2, 3.0)
