"""The main job: ``adadiag-ref report``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import adadiag_ref as ar
from adadiag_ref.cli import main
from adadiag_ref.golden import load_cases


def test_report_prints_every_optimizer_golden_and_memory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "curves.png"
    assert main(["report", "--steps", "20", "--backend", "numpy", "--plot", str(png), "--no-ode"]) == 0
    out = capsys.readouterr().out
    for name in ar.OPTIMIZERS:
        assert re.search(rf"^numpy +{name} ", out, re.MULTILINE), name
    n = len(load_cases())
    assert f"golden fixtures: {n}/{n} cases match" in out
    assert "AdaDiag++" in out and "11.59G" in out  # the paper's memory table, 1.3B column
    assert png.stat().st_size > 10_000


def test_report_losses_decrease() -> None:
    from adadiag_ref.report import run_report

    rows = run_report(steps=60, backends=["numpy"], out=lambda _: None, progress=False)
    for row in rows:
        assert row.losses[-1] < row.losses[0], row.optimizer


def test_unknown_subcommand_is_an_error() -> None:
    with pytest.raises(SystemExit):
        main(["frobnicate"])


@pytest.mark.parametrize(("flags", "progress"), [([], None), (["--progress"], True), (["--no-progress"], False)])
def test_report_passes_its_progress_flag_to_every_phase(
    flags: list[str], progress: bool | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None: bars only when stderr is a terminal (tqdm's disable=None); the flag forces them on or off
    from adadiag_ref import report

    seen: dict[str, object] = {}

    def phase(name: str, result: object) -> object:
        def record(*args: object, **kwargs: object) -> object:
            seen[name] = kwargs.get("progress", "not passed")
            return result

        return record

    monkeypatch.setattr(report, "run_report", phase("run_report", ["a row"]))
    monkeypatch.setattr(report, "ode_summary", phase("ode_summary", []))
    monkeypatch.setattr(report, "golden_summary", phase("golden_summary", True))
    monkeypatch.setattr(report, "memory_summary", phase("memory_summary", None))
    assert main(["report", "--backend", "numpy", *flags]) == 0
    assert seen == {"run_report": progress, "ode_summary": progress, "golden_summary": progress,
                    "memory_summary": "not passed"}  # fmt: skip
