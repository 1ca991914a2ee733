"""scripts/cpu_levels.py's choice of levels (the runs themselves are .ci/run's last stage)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import cpu_levels


@pytest.mark.parametrize("forced", [False, True])
def test_forced_runs_every_level_but_native(monkeypatch: pytest.MonkeyPatch, forced: bool) -> None:
    """``--forced`` (what .ci/run passes, its main pass being the native level) leaves native out, nothing else;
    the pytest arguments reach every level."""
    ran: list[tuple[str, list[str]]] = []

    def record(name: str, overrides: dict[str, str | None], pytest_args: list[str]) -> dict[str, object]:
        ran.append((name, pytest_args))
        return {"level": name, "environment": overrides, "tests_rc": 0, "golden_rc": 0, "seconds": 0.0}

    monkeypatch.setattr(cpu_levels, "run_level", record)
    assert cpu_levels.main([*(["--forced"] if forced else []), "-n", "2"]) == 0
    every = list(cpu_levels.level_environments())
    assert [name for name, _ in ran] == [n for n in every if not (forced and n == "native")]
    assert all(args == ["-n", "2"] for _, args in ran)
