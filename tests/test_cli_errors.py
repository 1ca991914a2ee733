"""CLI misuse (issues 10 and 26): one line ``adadiag-ref: error: ...`` on stderr and exit 2, never a traceback.

``replay``, ``ode`` and ``golden verify`` are run in-process through the main
entry point; a hang would show as a test that never ends, so the ODE cases that
used to run forever are refused before any integration starts.

:func:`test_every_bad_option_is_refused_up_front` walks every numeric and path option of every
subcommand: the message names the option and the value, and no work starts (the functions that would do
it are replaced by ones that fail the test).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error, run_cli

from adadiag_ref.golden.format import default_data_dir


def _good_input(path: Path) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, w0=rng.standard_normal((3, 4)), grads=rng.standard_normal((5, 3, 4)))
    return path


def test_replay_works_on_good_input(tmp_path: Path, capsys) -> None:
    src = _good_input(tmp_path / "in.npz")
    code, out, _ = run_cli(
        ["replay", "--optimizer", "adadiag", "--input", str(src), "--output", str(tmp_path / "o.npz")], capsys
    )
    assert code == 0 and "wrote 5 steps" in out
    with np.load(tmp_path / "o.npz") as data:
        assert data["params"].shape == (5, 3, 4)


def test_replay_with_a_missing_input_file(tmp_path: Path, capsys) -> None:
    argv = ["replay", "--optimizer", "adadiag", "--input", str(tmp_path / "nope.npz"), "--output", str(tmp_path / "o")]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "nope.npz")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_replay_with_a_corrupt_input_file(tmp_path: Path, capsys, damage: str) -> None:
    src = _good_input(tmp_path / "in.npz")
    blob = src.read_bytes()
    src.write_bytes({"truncated": blob[: len(blob) // 2], "garbage": b"not a zip at all" * 10, "empty": b""}[damage])
    argv = ["replay", "--optimizer", "adadiag", "--input", str(src), "--output", str(tmp_path / "o.npz")]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "in.npz")
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize(
    ("arrays", "fragment"),
    [
        ({"w0": np.ones((3, 4))}, "lacks grads"),
        ({"w0": np.ones((3, 4)), "grads": np.ones((5, 4, 3))}, "grads have shape"),
        ({"w0": np.ones((3, 4), dtype=np.int64), "grads": np.ones((5, 3, 4))}, "float32 or float64"),
        ({"w0": np.ones((3, 4)), "grads": np.full((2, 3, 4), np.nan)}, "non-finite gradient"),
        ({"w0": np.ones((3, 4)), "grads": np.ones(())}, "grads have shape"),
    ],
)
def test_replay_with_bad_arrays(tmp_path: Path, capsys, arrays: dict, fragment: str) -> None:
    src = tmp_path / "in.npz"
    np.savez(src, **arrays)
    argv = ["replay", "--optimizer", "adadiag", "--input", str(src), "--output", str(tmp_path / "o.npz")]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize(
    "config",
    ['{"eps": 0}', '{"lr": -1}', "[1, 2]", "{not json", '{"update_freq": 0}', '{"frobnicate": 1}', "@/no/such.json"],
)
def test_replay_with_a_bad_config(tmp_path: Path, capsys, config: str) -> None:
    src = _good_input(tmp_path / "in.npz")
    argv = [
        "replay",
        "--optimizer",
        "adadiag",
        "--config",
        config,
        "--input",
        str(src),
        "--output",
        str(tmp_path / "o"),
    ]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err)


def test_replay_to_an_unwritable_output(tmp_path: Path, capsys) -> None:
    src = _good_input(tmp_path / "in.npz")
    argv = ["replay", "--optimizer", "adadiag", "--input", str(src), "--output", str(tmp_path / "no" / "dir" / "o.npz")]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err)


@pytest.mark.parametrize(
    "extra",
    [
        ["--t-end", "-1"],
        ["--t-end", "0"],
        ["--t-end", "inf"],
        ["--t-end", "nan"],
        ["--t-end", "abc"],
        ["--integrator", "rk4", "--dt", "0"],
        ["--integrator", "rk4", "--dt", "-0.1"],
        ["--integrator", "rk4", "--dt", "inf"],
        ["--rtol", "-1"],
        ["--rtol", "0"],
        ["--atol", "nan"],
        ["--max-steps", "0"],
        ["--max-steps", "-5"],
        ["--refresh-every", "0"],
        ["--eps", "-1"],
        ["--weight-decay", "inf"],
        ["--optimizer", "nope"],
    ],
)
def test_ode_refuses_bad_numbers_up_front(capsys, extra: list[str]) -> None:
    argv = ["ode", "--optimizer", "adam", "--problem", "least_squares", "--no-progress", *extra]
    if "--optimizer" in extra:
        argv = ["ode", "--problem", "least_squares", "--no-progress", *extra]
    code, out, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, extra[-2] if extra[-2].startswith("--") else extra[0])
    assert out == ""


def test_max_steps_bounds_the_integration(capsys) -> None:
    argv = ["ode", "--optimizer", "adam", "--problem", "least_squares", "--t-end", "1e6", "--max-steps", "50"]
    code, out, _ = run_cli([*argv, "--integrator", "dopri5", "--no-progress", "--json"], capsys)
    result = json.loads(out)
    assert code == 1 and result["status"] == "max_steps" and result["n_steps"] <= 50


def test_max_steps_bounds_the_order_measurement_too(capsys) -> None:
    # main run: 10 steps of 0.1; the order runs halve dt0 = 1/10 four times: 160 steps on the finest
    argv = ["ode", "--optimizer", "adam", "--integrator", "rk4", "--t-end", "1", "--dt", "0.1", "--order"]
    code, out, _ = run_cli([*argv, "--max-steps", "100", "--no-progress", "--json"], capsys)
    result = json.loads(out)
    assert code == 1 and result["status"] == "max_steps" and result["observed_order"] is None
    assert any("160 steps, more than max_steps = 100" in note for note in result["notes"])
    code, out, _ = run_cli([*argv, "--max-steps", "200", "--no-progress", "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["status"] == "success" and abs(result["observed_order"] - 4.0) < 0.5


def test_golden_verify_fails_on_an_empty_fixture_set(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(["golden", "verify", str(empty)], capsys)
    assert_one_line_error(code, err)
    manifest = json.loads((default_data_dir() / "manifest.json").read_text())
    (empty / "manifest.json").write_text(json.dumps({**manifest, "cases": []}))
    code, _, err = run_cli(["golden", "verify", str(empty)], capsys)
    assert_one_line_error(code, err, "no cases")
    code, _, err = run_cli(["golden", "verify", str(tmp_path / "missing")], capsys)
    assert_one_line_error(code, err, "missing")


def _copy_of_shipped_set(tmp_path: Path) -> Path:
    target = tmp_path / "set"
    shutil.copytree(default_data_dir(), target)
    return target


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_golden_verify_fails_on_an_unreadable_fixture_set(tmp_path: Path, capsys, damage: str) -> None:
    target = _copy_of_shipped_set(tmp_path)
    victim = sorted(target.glob("*.npz"))[0]
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:200])
    elif damage == "delete":
        victim.unlink()
    else:
        (target / "manifest.json").write_text("{ truncated")
    code, _, err = run_cli(["golden", "verify", str(target)], capsys)
    assert_one_line_error(code, err)


def test_usage_errors_are_one_line_too(capsys) -> None:
    for argv in (["frobnicate"], ["replay"], ["golden"], ["ode", "--optimizer", "adam", "--t-end"]):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err)


# ------------------------------------------------------------------ every option checked up front (issue 26)

_SLOW_WORK = [  # (module, attribute): what each subcommand calls once its options are accepted
    ("adadiag_ref.reproduce.train", "compare"),
    ("adadiag_ref.perf.bench", "run"),
    ("adadiag_ref.perf.steady", "run"),
    ("adadiag_ref.perf.gpu", "run"),
    ("adadiag_ref.perf.refresh", "run_routes"),
    ("adadiag_ref.perf.refresh", "run_scaling"),
    ("adadiag_ref.ode.cli", "check"),
    ("adadiag_ref.golden.cli", "run_core"),
    ("adadiag_ref.report", "run_report"),
]


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every subcommand's work fails the test: an option error must come before it."""
    import importlib

    for module, name in _SLOW_WORK:

        def started(*args: object, _name: str = f"{module}.{name}", **kwargs: object) -> None:
            raise AssertionError(f"{_name} ran before the options were checked")

        monkeypatch.setattr(importlib.import_module(module), name, started)


# {missing}: a path in a folder that does not exist; {folder}: an existing folder; {text}: a text file
_BAD_OPTIONS: list[tuple[list[str], str]] = [
    (["reproduce", "--quick", "--batch", "-3"], "--batch"),
    (["reproduce", "--batch", "0"], "--batch"),
    (["reproduce", "--steps", "-5"], "--steps"),
    (["reproduce", "--steps", "1"], "--steps"),
    (["reproduce", "--steps", "ten"], "--steps"),
    (["reproduce", "--update-freq", "0"], "--update-freq"),
    (["reproduce", "--threads", "0"], "--threads"),
    (["reproduce", "--jobs", "-1"], "--jobs"),
    (["reproduce", "--seeds", ""], "--seeds"),
    (["reproduce", "--seeds", "0,-1"], "--seeds"),
    (["reproduce", "--seeds", "1,1"], "--seeds"),
    (["reproduce", "--seeds", "a,b"], "--seeds"),
    (["reproduce", "--lr-grid", "0"], "--lr-grid"),
    (["reproduce", "--lr-grid", "nan"], "--lr-grid"),
    (["reproduce", "--optimizers", "nope"], "--optimizers"),
    (["reproduce", "--json", "{missing}"], "--json"),
    (["reproduce", "--json", "{folder}"], "--json"),
    (["reproduce", "--plot", "{missing}"], "--plot"),
    (["reproduce", "--device", "tpu"], "--device"),
    (["bench", "--quick", "--reps", "-1"], "--reps"),
    (["bench", "--reps", "0"], "--reps"),
    (["bench", "--period", "0"], "--period"),
    (["bench", "--refresh-routes", "--threads", "0"], "--threads"),
    (["bench", "--refresh-scaling", "--sides", "1,x"], "--sides"),
    (["bench", "--refresh-scaling", "--sides", "0,64"], "--sides"),
    (["bench", "--refresh-scaling", "--plot", "{missing}"], "--plot"),
    (["bench", "--plot", "{folder}/scaling.png"], "--plot"),  # --plot draws only --refresh-scaling's figure
    (["bench", "--gpu", "--json", "{missing}"], "--json"),
    (["bench", "--gpu", "--json", "{folder}"], "--json"),
    (["bench", "--json", "{folder}/gpu.json"], "--json"),  # --json writes only --gpu's tables
    (["memory", "--dtype", "fp8"], "--dtype"),
    (["ode", "--optimizer", "adam", "--plot", "{missing}"], "--plot"),
    (["ode", "--optimizer", "adam", "--plot", "{folder}"], "--plot"),
    (["ode", "--optimizer", "adam", "--seed", "-1"], "--seed"),
    (["replay", "--optimizer", "adadiag", "--output", "{folder}/o.npz", "--input", "{text}"], "--input"),
    (["replay", "--optimizer", "adadiag", "--output", "{folder}/o.npz", "--input", "{missing}"], "--input"),
    (["replay", "--optimizer", "adadiag", "--output", "{folder}/o.npz", "--input", "{folder}"], "--input"),
    (["replay", "--optimizer", "adadiag", "--input", "{text}", "--output", "{missing}"], "--output"),
    (["replay", "--optimizer", "adadiag", "--input", "{text}", "--output", "{folder}"], "--output"),
    (["report", "--steps", "0"], "--steps"),
    (["report", "--plot", "{missing}"], "--plot"),
    # a file type matplotlib cannot write: refused before the work, not after it (ode would lose its result)
    (["reproduce", "--plot", "{folder}/curves.txt"], "--plot"),
    (["ode", "--optimizer", "adam", "--plot", "{folder}/h.txt"], "--plot"),
    (["bench", "--refresh-scaling", "--plot", "{folder}/scaling.txt"], "--plot"),
    (["report", "--plot", "{folder}/report.txt"], "--plot"),
]
_ALSO_NAMED = {
    ("bench", "--plot"): {"--refresh-scaling"},
    ("bench", "--json"): {"--gpu"},
}  # a message may name the option that is missing


@pytest.mark.parametrize(("template", "option"), _BAD_OPTIONS, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_every_bad_option_is_refused_up_front(
    template: list[str], option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not an array file\n")
    places = {"missing": str(tmp_path / "no" / "such" / "out.png"), "folder": str(tmp_path), "text": str(text)}
    argv = [arg.format(**places) for arg in template]
    value = argv[len(argv) - 1 - argv[::-1].index(option) + 1]
    code, out, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, option, value)
    assert out == ""
    named = set(re.findall(r"--[a-z][a-z-]*", err)) - {"--help"}
    assert option in named and named <= {option, *_ALSO_NAMED.get((argv[0], option), set())}, err


_PLOTTING = [  # every command with --plot
    ["reproduce", "--quick", "--plot", "{png}"],
    ["ode", "--optimizer", "adam", "--plot", "{png}"],
    ["bench", "--refresh-scaling", "--plot", "{png}"],
    ["report", "--plot", "{png}"],
]


@pytest.mark.parametrize("template", _PLOTTING, ids=lambda v: v[0])
def test_every_plot_without_matplotlib_is_refused_up_front(
    template: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    no_work: None,
) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what find_spec sees when it is not installed
    argv = [arg.format(png=tmp_path / "figure.png") for arg in template]
    code, out, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "--plot", 'pip install "adadiag-ref[plot]"')
    assert out == ""


@pytest.mark.parametrize(
    ("argv", "blocked", "lacks"),
    [
        (["reproduce", "--quick"], "torch", "torch"),
        (["reproduce", "--quick", "--task", "digits"], "sklearn", "scikit-learn"),
    ],
)
def test_reproduce_without_its_libraries_is_one_line_before_any_work(
    argv: list[str], blocked: str, lacks: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    no_work: None,
) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, blocked, None)  # a core-only install, as import and find_spec see it
    code, out, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, f"reproduce needs {lacks}", 'pip install "adadiag-ref[reproduce]"')
    assert out == ""


def test_no_option_is_a_bare_int() -> None:
    # counts, sizes and seeds go through adadiag_ref._cli's checked types (a bare int takes -3 and fails later)
    from adadiag_ref.cli import build_parser

    seen: dict[str, object] = {}
    parser = build_parser()
    stack = [parser]
    while stack:
        current = stack.pop()
        for action in current._actions:
            if action.choices and isinstance(action.choices, dict):
                stack.extend(action.choices.values())  # sub-parsers
            elif action.type is int:
                seen[f"{current.prog} {action.option_strings}"] = action.type
    assert seen == {"adadiag-ref report ['--steps']": int}  # checked (with the plot) by report.check_options


def test_a_truncated_golden_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = _copy_of_shipped_set(tmp_path)
    victim = sorted(target.glob("*.npz"))[1]
    blob = victim.read_bytes()
    victim.write_bytes(blob[: len(blob) - 100])  # the central directory at the end is cut off
    code, _, err = run_cli(["golden", "verify", str(target)], capsys)
    assert_one_line_error(code, err, victim.name)
    (target / "manifest.json").write_text("{ truncated")
    code, _, err = run_cli(["golden", "verify", str(target)], capsys)
    assert_one_line_error(code, err, "manifest.json")
