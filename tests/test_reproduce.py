"""``adadiag-ref reproduce``: speed-up arithmetic, schedule, corpus, determinism, and the --quick run."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
from adadiag_ref.reproduce import data, metrics, schedule  # noqa: E402
from adadiag_ref.reproduce.model import CharLM, CharLMConfig  # noqa: E402
from adadiag_ref.reproduce.train import RunConfig, build_task, make_optimizers, train_run  # noqa: E402

# ---------------------------------------------------------------- speed-up on synthetic curves


def test_steps_to_reach_interpolates_linearly_between_evaluations():
    steps, losses = [0, 10, 20, 30], [1.0, 0.5, 0.4, 0.45]
    assert metrics.steps_to_reach(steps, losses, 0.45) == pytest.approx(15.0, rel=1e-12)  # first crossing
    assert metrics.steps_to_reach(steps, losses, 0.5) == 10.0  # exactly on an evaluation
    assert metrics.steps_to_reach(steps, losses, 2.0) == 0.0  # already there at the start
    assert metrics.steps_to_reach(steps, losses, 0.3) is None  # never reached


def test_speedup_of_a_curve_twice_as_fast_is_two():
    steps = list(range(0, 1001, 100))
    base = [1 - s / 1000 for s in steps]  # reaches its final loss 0 at step 1000
    fast = [max(0.0, 1 - s / 500) for s in steps]  # reaches 0 at step 500
    assert metrics.seed_speedup(steps, base, steps, fast) == pytest.approx(2.0, rel=1e-12)
    assert metrics.seed_speedup(steps, base, steps, base) == 1.0
    slow = [1 - s / 2000 for s in steps]  # ends at 0.5: never reaches the baseline's 0
    assert metrics.seed_speedup(steps, base, steps, slow) is None


def test_speedup_counts_the_baseline_dipping_below_its_final_loss():
    steps = [0, 10, 20, 30, 40]
    base = [1.0, 0.5, 0.3, 0.35, 0.4]  # final 0.4, first reached at 10 + (0.5 - 0.4) / 0.2 * 10 = 15
    other = [1.0, 0.7, 0.4, 0.2, 0.1]  # 0.4 first at 20
    assert metrics.seed_speedup(steps, base, steps, other) == pytest.approx(15 / 20, rel=1e-12)


def test_median_over_seeds_is_none_when_a_seed_never_reaches():
    assert metrics.median_or_none([1.0, 3.0]) == 2.0
    assert metrics.median_or_none([1.0, None]) is None
    assert metrics.median_or_none([]) is None


def test_steps_to_reach_rejects_mismatched_curves():
    with pytest.raises(ValueError, match="matching"):
        metrics.steps_to_reach([0, 1], [1.0], 0.5)


# ---------------------------------------------------------------- schedule


def test_schedule_is_10_percent_warmup_then_cosine_to_10_percent():
    total = 200
    factors = [schedule.lr_factor(s, total) for s in range(total)]
    warm = schedule.warmup_steps(total)
    assert warm == 20
    assert factors[:warm] == pytest.approx([(s + 1) / 20 for s in range(20)], rel=1e-12)
    assert factors[warm] == 1.0 and factors[-1] == pytest.approx(0.1, rel=1e-12)
    assert all(a >= b for a, b in zip(factors[warm:], factors[warm + 1 :]))  # cosine decays monotonically
    mid = warm + (total - 1 - warm) / 2  # half-way through the decay: f + (1 - f) / 2
    assert schedule.lr_factor(int(mid), total) == pytest.approx(0.55, abs=0.9 * math.pi / (total - 1 - warm))


def test_make_scheduler_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = schedule.make_scheduler(opt, 10)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5 * schedule.lr_factor(s, 10) for s in range(10)], rel=1e-12)


# ---------------------------------------------------------------- corpus and model


def test_corpus_is_deterministic_and_split():
    a, b = data.load_corpus(), data.load_corpus()
    assert a.sha256 == b.sha256 and a.files == b.files and len(a.files) >= 20
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert 8 < len(a.train) / len(a.val) < 10  # 90/10 per file, up to rounding
    assert int(a.train.max()) < len(data.VOCAB) and int(a.train.min()) >= 0
    assert data.encode("a\n\t\u00e9").tolist() == [data.VOCAB.index("a"), 1, data.UNKNOWN, data.UNKNOWN]


def test_windows_are_reproducible():
    tokens = torch.arange(1000)
    w1 = data.random_windows(tokens, 4, 16, torch.Generator().manual_seed(3))
    w2 = data.random_windows(tokens, 4, 16, torch.Generator().manual_seed(3))
    assert torch.equal(w1, w2) and w1.shape == (4, 17)
    assert torch.equal(w1[:, 1:] - w1[:, :-1], torch.ones(4, 16, dtype=torch.int64))  # consecutive tokens
    fixed = data.fixed_windows(tokens, 5, 16)
    assert fixed[0, 0] == 0 and fixed[-1, -1] == 999


def test_charlm_is_about_a_million_parameters_and_rotates_the_block_matrices():
    model = CharLM(CharLMConfig(vocab=len(data.VOCAB)))
    total = sum(p.numel() for p in model.parameters())
    assert 0.7e6 < total < 1.2e6
    rotated = model.rotated_parameters()
    assert len(rotated) == 4 * 7 and all(p.ndim == 2 for p in rotated)
    cfg = RunConfig(task="charlm", steps=100, batch=2)
    main, rest = make_optimizers(model, "adadiag", 1e-3, cfg)
    assert type(main).__name__ == "AdaDiag" and type(rest).__name__ == "AdamW"
    assert {id(p) for g in main.param_groups for p in g["params"]} == {id(p) for p in rotated}
    assert main.param_groups[0]["update_freq"] == 2  # 100 steps // 50 refreshes


TINY = CharLMConfig(len(data.VOCAB), hidden=16, layers=1, heads=2, intermediate=32, context=8)
QUICK = RunConfig(task="charlm", steps=6, batch=2, eval_points=3, eval_windows=2, model=TINY)


def test_a_run_is_deterministic():
    task = build_task(QUICK)
    a = train_run(task, QUICK, "adadiag", 1e-2, seed=3, progress=False)
    b = train_run(task, QUICK, "adadiag", 1e-2, seed=3, progress=False)
    assert a["val_loss"] == b["val_loss"] and a["eval_steps"] == [0, 2, 4, 6]
    c = train_run(task, QUICK, "adadiag", 1e-2, seed=4, progress=False)
    assert c["val_loss"] != a["val_loss"]


def test_digits_task_trains():
    cfg = RunConfig(task="digits", steps=20, batch=32, eval_points=2)
    run = train_run(build_task(cfg), cfg, "adafacdiag", 1e-2, seed=0, progress=False)
    assert run["val_loss"][-1] < run["val_loss"][0]


# ---------------------------------------------------------------- the CLI's --quick run (CI)

RUN_KEYS = {"optimizer", "lr", "seed", "steps", "eval_steps", "val_loss", "final_val_loss",
            "optimizer_ms_per_step", "step_ms"}  # fmt: skip
DEFAULT_OPTIMIZERS = ["adamw", "adadiag", "adadiag_pp", "adafacdiag", "hfacdiag"]


def test_quick_run_writes_the_documented_json(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    cmd = [sys.executable, "-m", "adadiag_ref.cli", "reproduce", "--quick", "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["task"] == "charlm" and result["seeds"] == [0, 1]
    assert set(result["speedup"]) == set(DEFAULT_OPTIMIZERS) and result["speedup"]["adamw"] == 1.0
    grid = result["lr_grid"]
    assert len(result["runs"]) == len(DEFAULT_OPTIMIZERS) * (len(grid) + 1)  # sweep on seed 0, then seed 1
    for run in result["runs"]:
        assert set(run) == RUN_KEYS
        assert run["optimizer"] in DEFAULT_OPTIMIZERS and run["lr"] in grid
        assert run["eval_steps"][0] == 0 and run["eval_steps"][-1] == run["steps"]
        assert len(run["eval_steps"]) == len(run["val_loss"])
        assert all(math.isfinite(v) for v in run["val_loss"]) and run["final_val_loss"] == run["val_loss"][-1]
        assert run["optimizer_ms_per_step"] > 0 and run["step_ms"] >= run["optimizer_ms_per_step"]
    for run in (r for r in result["runs"] if r["optimizer"] == "adamw"):
        losses = run["val_loss"]
        assert losses[-1] < losses[0] - 0.5  # learns: from ~log(97) = 4.6 nats down
        assert max(losses[len(losses) // 2 :]) < min(losses[: len(losses) // 4])  # decreasing overall
    assert result["machine"]["num_threads"] == 1 and len(result["corpus"]["sha256"]) == 64
    for name in DEFAULT_OPTIMIZERS:  # the selected lr is the sweep's best on the first seed
        sweep = {r["lr"]: r["final_val_loss"] for r in result["runs"] if r["optimizer"] == name and r["seed"] == 0}
        assert set(sweep) == set(grid) and result["selected_lr"][name] == min(sweep, key=sweep.__getitem__)
    for name in DEFAULT_OPTIMIZERS:  # every optimizer has both seeds at its selected lr
        seeds = sorted(
            r["seed"] for r in result["runs"] if r["optimizer"] == name and r["lr"] == result["selected_lr"][name]
        )
        assert seeds == [0, 1]


@pytest.mark.slow
def test_parallel_runs_give_the_same_numbers():
    from adadiag_ref.reproduce.train import compare

    one = compare(QUICK, ["adadiag"], [0, 1], [1e-2, 3e-3], progress=False, jobs=1)
    two = compare(QUICK, ["adadiag"], [0, 1], [1e-2, 3e-3], progress=False, jobs=2)
    assert [r["val_loss"] for r in one["runs"]] == [r["val_loss"] for r in two["runs"]]
    assert one["speedup"] == two["speedup"] and one["selected_lr"] == two["selected_lr"]


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_outputs_into_a_missing_folder_fail_before_the_run(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from adadiag_ref.cli import main
    from adadiag_ref.reproduce import train

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the comparison ran before its outputs were checked")

    monkeypatch.setattr(train, "compare", no_run)
    target = tmp_path / "missing" / ("r.json" if flag == "--json" else "r.png")
    with pytest.raises(SystemExit) as exc:  # refused by the parser (adadiag_ref._cli.output_file)
        main(["reproduce", "--task", "digits", "--quick", flag, str(target)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("adadiag-ref: error:") and "does not exist" in err[0]


_TINY = ["reproduce", "--quick", "--optimizers", "adamw", "--seeds", "0", "--steps", "2", "--lr-grid", "1e-2"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("flags", "terminal", "bars"),
    [([], False, False), ([], True, True), (["--progress"], False, True), (["--no-progress"], True, False)],
)
def test_progress_bars_only_on_a_terminal_or_when_asked(
    flags: list[str], terminal: bool, bars: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a redirected stderr used to receive every bar (518 lines for the --quick run)
    from adadiag_ref.cli import main

    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main([*_TINY, *flags]) == 0
    assert ("charlm: runs" in stderr.getvalue()) == bars, stderr.getvalue()
    assert "speed-up over AdamW" in capsys.readouterr().out


def test_speedups_are_printed_with_three_decimals_and_their_range(capsys: pytest.CaptureFixture[str]) -> None:
    from adadiag_ref.reproduce.cli import _print_table

    run = {"optimizer": "adamw", "lr": 1e-2, "seed": 0, "final_val_loss": 2.0, "optimizer_ms_per_step": 1.0,
           "step_ms": 2.0}  # fmt: skip
    result = {
        "selected_lr": {"adamw": 1e-2, "adadiag": 1e-2, "hfacdiag": 1e-2},
        "runs": [run],
        "speedup": {"adamw": 1.0, "adadiag": 1.04, "hfacdiag": None},
        "speedup_per_seed": {"adamw": [1.0, 1.0], "adadiag": [1.0444444444, 1.0355555555], "hfacdiag": [1.4, None]},
    }
    _print_table(result)
    out = capsys.readouterr().out
    assert "  adamw          1.000x  seeds 1.000, 1.000 (range 1.000-1.000)\n" in out
    assert "  adadiag        1.040x  seeds 1.044, 1.036 (range 1.036-1.044)\n" in out
    assert "  hfacdiag       None  seeds 1.400, None\n" in out
