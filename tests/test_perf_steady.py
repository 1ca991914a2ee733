"""``adadiag-ref bench --steady``: its steady-state harnesses and the opt-in allocator setting.

Timings are not asserted (benchmarks measure speed); what is checked is that the
harnesses step what they claim to step and that the CLI path runs end to end.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref.memory import ParamSpec
from adadiag_ref.perf import allocator, bench, steady

pytest.importorskip("numba")
pytest.importorskip("threadpoolctl")

SPECS = [ParamSpec("layers.0.q", (24, 40)), ParamSpec("embed", (50, 16)), ParamSpec("norm", (16,))]


@pytest.mark.parametrize("in_place", [False, True])
def test_functional_steps_keep_their_states_across_calls(in_place: bool) -> None:
    """Warm-up steps at construction, one step per call, the same trajectory as stepping by hand."""
    steps = bench.FunctionalSteps("adadiag", SPECS, rule="all", in_place=in_place, warmup=2)
    twin = bench.FunctionalSteps("adadiag", SPECS, rule="all", in_place=in_place, warmup=2)  # same seed
    elapsed = steps()
    assert isinstance(elapsed, float) and elapsed > 0.0
    for it, by_hand in zip(steps.items, twin.items, strict=True):
        assert int(it[0].count) == 3  # two warm-up steps and this call
        delta, by_hand[0] = ar.update(by_hand[0], by_hand[1], by_hand[3], by_hand[2])
        by_hand[2] += delta  # update_in_place equals update + add bit for bit
        np.testing.assert_array_equal(it[2], by_hand[2])
        for name in ("M", "V"):
            np.testing.assert_array_equal(getattr(it[0], name), getattr(by_hand[0], name))
    steps.close()
    assert steps.items == []


def test_retain_freed_memory_reports_whether_glibc_took_it() -> None:
    """Process-wide, so in a child process: ``True`` with glibc, ``False`` (and nothing changed) elsewhere."""
    code = (
        "from adadiag_ref.perf import allocator as a; "
        "assert not a.freed_memory_retained(); ok = a.retain_freed_memory(); "
        "assert a.freed_memory_retained() == ok; print(ok)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    import platform

    glibc = platform.libc_ver()[0] == "glibc"
    assert out == str(glibc)


def test_free_page_reporting_reads_the_kernel_counter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = tmp_path / "reported_kib"
    counter.write_text("123377252\n")
    monkeypatch.setattr(allocator, "_PAGE_REPORTING", counter)
    assert allocator.free_page_reporting() == 123377252
    monkeypatch.setattr(allocator, "_PAGE_REPORTING", tmp_path / "absent")
    assert allocator.free_page_reporting() is None


def test_steady_cli_quick_with_retained_memory() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from adadiag_ref.cli import main; sys.exit(main(sys.argv[1:]))",
         "bench", "--steady", "--quick", "--reps", "1", "--no-torch", "--retain-freed-memory"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "allocator: glibc keeps freed memory" in proc.stdout or "needs glibc" in proc.stderr
    for _, label, _ in steady.TARGETS[:2]:
        assert label in proc.stdout


def test_steady_table_shows_the_spread_over_rounds() -> None:
    # a median of a few rounds on a noisy machine: the table prints each row's lowest and highest round beside it
    lines: list[str] = []
    res = steady.run(quick=True, reps=2, use_torch=False, out=lines.append)
    header = next(i for i, line in enumerate(lines) if line.startswith("steady-state ratio"))
    assert "rounds min-max" in lines[header]
    for (key, label, _), line in zip(steady.TARGETS[:2], lines[header + 1 :], strict=True):
        lo, hi = min(res["rounds"][key]), max(res["rounds"][key])
        assert line.startswith(label) and f"{lo:.2f}-{hi:.2f}" in line, line


def test_each_row_is_divided_by_the_roofline_measured_right_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # a roofline per row (the VM's bandwidth drifts within seconds): made-up, distinct measurements show which
    # one each ratio used
    import math

    from adadiag_ref.memory import llama_parameters

    made_up = iter([(1e10, 1e11), (2e10, 2e11)])
    monkeypatch.setattr(bench.Roofline, "measure", lambda self: next(made_up))
    res = steady.run(quick=True, reps=1, use_torch=False, out=lambda line: None)
    size = sum(math.prod(s.shape) for s in llama_parameters(bench.QUICK))
    adamw = res["times"]["adamw_engine"] / (7 * 4 * size / 2e10)  # the second measurement of the round
    assert res["ratios"]["adamw_engine"] == pytest.approx(adamw, rel=1e-12)
    assert next(made_up, None) is None  # two measurements per round: one per row
