"""``adadiag-ref conform`` and the pytest plugin: the shipped adapters pass every case, planted bugs are named.

The planted bugs live in ``tests/_ports.py`` (a small torch.optim AdaDiag written from docs/golden.md and
single-bug versions of it); ``tests/_cmd_port.py`` is a ``--cmd`` port of the file protocol.
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref.golden import default_data_dir, load_case, load_cases
from adadiag_ref.golden.cli import main as golden_main
from adadiag_ref.golden.conform import main, run_conform, torch_runner
from adadiag_ref.testing import PARAMETER, compare

pytest_plugins = ("pytester",)

HERE = Path(__file__).resolve().parent
PORTS = HERE / "_ports.py"
CMD_PORT = f"{sys.executable} {HERE / '_cmd_port.py'}"
ADADIAG = load_cases(optimizer="adadiag")
ROTATED = [c for c in ADADIAG if "P" in c.state(1)]  # the others have max_basis_dim below m: nothing rotated
CORRECTED = [c for c in ADADIAG if c.config["bias_correction"]]


def run_port(name: str):  # type: ignore[no-untyped-def]
    """A tests/_ports.py class over every AdaDiag case."""
    torch = pytest.importorskip("torch")  # noqa: F841
    import _ports

    return run_conform(torch_runner(getattr(_ports, name)), ADADIAG, name)


# ----------------------------------------------------------------------------- the shipped adapters pass


@pytest.mark.parametrize("name", list(ar.OPTIMIZERS))
def test_shipped_torch_classes_pass_every_case_with_their_states(name: str) -> None:
    pytest.importorskip("torch")
    from adadiag_ref.adapters import pytorch as at

    cases = load_cases(optimizer=name)
    start = time.perf_counter()
    result = run_conform(torch_runner(at.OPTIMIZER_CLASSES[name]), cases, name)
    print(f"{name}: {len(cases)} cases in {time.perf_counter() - start:.2f} s")
    assert not result.failed, result.text(verbose=True)
    assert all("count" in r.state_fields and len(r.state_fields) >= 3 for r in result.reports)  # states compared


def _optax_cases(name: str, every: bool) -> list:  # type: ignore[type-arg]
    cases = load_cases(optimizer=name)
    return cases if every else [c for c in cases if c.name == f"{name}-degenerate_wide-f64"]


# one case per alias here (jit compiles once per case, ~1-3 s on 2 cores); every case in the slow test below
@pytest.mark.parametrize(
    ("name", "every"),
    [(name, False) for name in ar.OPTIMIZERS]
    + [pytest.param(name, True, marks=pytest.mark.slow) for name in ar.OPTIMIZERS],
)
def test_shipped_optax_aliases_pass_with_their_states(name: str, every: bool) -> None:
    pytest.importorskip("optax")
    from adadiag_ref.adapters import optax as ao

    from adadiag_ref.golden.conform import optax_runner

    cases = _optax_cases(name, every)
    start = time.perf_counter()
    result = run_conform(optax_runner(ao.ALIASES[name]), cases, name)
    print(f"{name}: {len(cases)} cases in {time.perf_counter() - start:.2f} s")
    assert not result.failed, result.text(verbose=True)
    assert all(len(r.state_fields) >= 3 for r in result.reports)


def test_cmd_port_passes_with_json_and_junit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    picked = ["adafacdiag_pp-degenerate_wide-f64", "hfacdiag-conv32-f32", "adamw-tall-f64"]
    argv = ["conform", "--cmd", CMD_PORT, "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")]
    assert main(argv + [a for name in picked for a in ("--case", name)]) == 0
    assert "3/3 cases pass" in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] == 3 and report["failed"] == 0
    fields = {r["case"]: set(r["state_fields"]) for r in report["results"]}
    assert {"count", "P", "Q", "r", "s"} <= fields["adafacdiag_pp-degenerate_wide-f64"]  # the states were compared
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "3" and suite.get("failures") == "0"


@pytest.mark.slow
def test_cmd_port_passes_every_float32_case(capsys: pytest.CaptureFixture[str]) -> None:
    # one process per case, ~3-4 s each on 2 cores: the 16 float32 cases (every optimizer) keep it near a minute
    assert main(["conform", "--cmd", CMD_PORT, "--dtype", "float32"]) == 0, capsys.readouterr().out


def test_replay_is_a_cmd_port(capsys: pytest.CaptureFixture[str]) -> None:
    """replay reads the optimizer and config from conform's input and writes the states: itself a --cmd port."""
    command = f"{sys.executable} -m adadiag_ref.cli replay --input {{input}} --output {{output}}"
    assert main(["conform", "--cmd", command, "--case", "hfacdiag-degenerate-f64"]) == 0
    assert "states count, P, r, s, u, v" in capsys.readouterr().out


# ----------------------------------------------------------------------------- planted bugs are named


def test_the_independent_port_passes_every_case() -> None:
    result = run_port("PortAdaDiag")
    assert not result.failed, result.text(verbose=True)


def test_flipped_sign_convention_is_caught_in_the_state_at_step_1() -> None:
    result = run_port("FlippedSignAdaDiag")
    assert {r.case for r in result.failed} == {c.name for c in ROTATED}  # max_basis_dim below m: no P to flip
    for report in result.failed:
        mismatch = report.first_mismatch
        assert mismatch is not None and (mismatch.step, mismatch.field) == (1, "P"), str(report)
        assert report.patterns and "of P differ by sign" in report.patterns[0], str(report)
        assert np.all(report.tolerance_ratio <= 1.0)  # the parameters agree: only the state shows the bug


def _first_nonzero_gradient_step(case) -> int:  # type: ignore[no-untyped-def]
    """The first ``t`` (1-based) whose gradient has a nonzero entry."""
    return 1 + next(k for k, g in enumerate(case.grads) if np.any(g != 0))


def test_off_by_one_bias_correction_is_named() -> None:
    result = run_port("OffByOneBiasAdaDiag")
    assert {r.case for r in result.failed} == {c.name for c in CORRECTED}  # bias_correction=False: no beta-hat
    first_signal = {case.name: _first_nonzero_gradient_step(case) for case in ADADIAG}
    for report in result.failed:
        mismatch = report.first_mismatch
        # both moments carry the bug; V is checked first (Adafactor's M is computed from it); a zero gradient
        # (the degenerate stream's t = 1) leaves zero moments whatever the bias correction, so it shows next step
        expected = (first_signal[report.case], "V")
        assert mismatch is not None and (mismatch.step, mismatch.field) == expected, str(report)
        assert report.likely_cause is not None
        assert report.likely_cause.startswith("off by one step in the bias correction"), str(report)


def test_a_port_that_raises_fails_its_cases_with_the_traceback_and_the_others_run() -> None:
    result = run_port("RaisesAtStep3AdaDiag")
    failed = {r.case for r in result.failed}
    assert failed == {c.name for c in ADADIAG if len(c.shape) == 4}  # the conv cases; the others pass
    for report in result.failed:
        assert report.first_diverging_step == 3 and report.error_step == 3 and report.first_mismatch is None
        assert report.error is not None and "RuntimeError: planted failure at step 3" in report.error
        assert "Traceback" in report.error and "_ports.py" in report.error
        assert np.all(np.isnan(report.max_abs_error[2:])) and np.all(report.tolerance_ratio[:2] <= 1.0)


def test_p_stored_transposed_is_named() -> None:
    result = run_port("TransposedPAdaDiag")
    vector = {c.name for c in ADADIAG if len(c.shape) == 1}  # P is 1 x 1 there: its transpose is itself
    assert {r.case for r in result.failed} == {c.name for c in ROTATED} - vector
    cases = {c.name: c for c in ADADIAG}
    for report in result.failed:
        mismatch = report.first_mismatch
        # a symmetric P (the identity of a zero gradient's refresh: the degenerate stream's t = 1) is its own
        # transpose, so the bug shows at the first step whose P is not symmetric
        case = cases[report.case]
        expected = next(t for t in range(1, case.steps + 1) if not np.array_equal(P := case.state(t)["P"], P.T))
        assert mismatch is not None and (mismatch.step, mismatch.field) == (expected, "P"), str(report)
        assert report.patterns and report.patterns[0].startswith("P is transposed"), str(report)


def test_p_and_q_swapped_is_named() -> None:
    case = load_case("adadiag_pp-square-f64")  # 4 x 4: P and Q have one shape
    states = {k[len("state_") :]: v for k, v in case.arrays.items() if k.startswith("state_")}
    states["P"], states["Q"] = states["Q"], states["P"]
    report = compare(case.params, case, states=states)
    assert report.first_mismatch is not None and report.first_mismatch.field == "P"
    assert "P and Q swapped" in report.patterns, str(report)


def test_a_parameter_wrong_while_the_state_agrees_points_at_the_update() -> None:
    case = load_case("adadiag-wide-f64")
    states = {k[len("state_") :]: v for k, v in case.arrays.items() if k.startswith("state_")}
    params = case.params.copy()
    params[3:] *= 1 + 1e-9
    report = compare(params, case, states=states)
    assert report.first_mismatch is not None and (report.first_mismatch.step, report.first_mismatch.field) == (
        4,
        PARAMETER,
    )
    assert "the state after step 4 agrees" in str(report.likely_cause)


def test_a_raising_step_function_is_a_failed_comparison() -> None:
    case = load_case("adamw-wide-f64")

    def step_fn(w, g, t):  # type: ignore[no-untyped-def]
        if t == 2:
            raise ValueError("no")
        return case.params[t - 1]

    report = compare(step_fn, case)
    assert not report.passed and report.first_diverging_step == 2 and report.error_step == 2
    assert "ValueError: no" in str(report) and "raised at step 2" in str(report.likely_cause)


def test_verify_names_the_first_wrong_state_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    shutil.copytree(default_data_dir(), tmp_path / "set")
    target = tmp_path / "set" / "adafacdiag-square-f64.npz"
    with np.load(target) as data:
        arrays = {k: np.array(data[k]) for k in data.files}
    arrays["state_r"][2, 1] *= 1 + 1e-6  # r after step 3, far above state_rtol 1e-10
    np.savez(target, **arrays)
    assert golden_main(["golden", "verify", str(tmp_path / "set")]) == 1
    assert "adafacdiag-square-f64: diverges at step 3 of 12: step 3, r[1]" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the command line


def test_conform_reports_failures_with_exit_1_and_junit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    junit, report = tmp_path / "r.xml", tmp_path / "r.json"
    argv = ["conform", "--torch", f"{PORTS}:RaisesAtStep3AdaDiag", "--optimizer", "adadiag"]
    assert main([*argv, "--junit", str(junit), "--json", str(report)]) == 1
    out = capsys.readouterr().out
    conv = {c.name for c in ADADIAG if len(c.shape) == 4}  # the port raises at step 3 on a conv kernel
    n, k = len(ADADIAG), len(conv)
    assert f"{n - k}/{n} cases pass" in out and "planted failure at step 3" in out
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("errors"), suite.get("failures")) == (str(n), str(k), "0")
    errors = [c for c in suite.iter("testcase") if c.find("error") is not None]
    assert {c.get("name") for c in errors} == conv
    data = json.loads(report.read_text())
    assert data["failed"] == k and all(r["error_step"] == 3 for r in data["results"] if not r["passed"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "one of the arguments --torch --optax --cmd is required"),
        (["--torch", "no_such_module_xyz:AdaDiag"], "cannot import no_such_module_xyz"),
        (["--torch", "adadiag_ref:NoSuchClass"], "has no attribute 'NoSuchClass'"),
        (["--torch", "AdaDiag"], "expected pkg.module:Name"),
        (["--torch", f"{PORTS}:PortAdaDiag"], "say which optimizer"),
        (["--cmd", "true", "--optimizer", "adam"], "unknown optimizer"),
        (["--cmd", "true", "--case", "nope"], "no case nope"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, message, capsys) -> None:  # type: ignore[no-untyped-def]
    if any("_ports.py" in a for a in argv):
        pytest.importorskip("torch")
    try:
        code = main(["conform", *argv])
    except SystemExit as exc:  # argparse's own usage errors exit from the parser
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("adadiag-ref: error:") and message in err, err


def test_a_keyword_the_port_lacks_fails_only_the_cases_that_need_it() -> None:
    pytest.importorskip("torch")
    import _ports

    class NoBiasCorrection(_ports.PortAdaDiag):  # takes no bias_correction keyword (and no **kwargs)
        def __init__(self, params, lr, betas, eps, weight_decay, update_freq):  # type: ignore[no-untyped-def]
            super().__init__(params, lr, betas, eps, weight_decay, update_freq)

    case = load_case("adadiag-wide-f64")
    assert torch_runner(NoBiasCorrection)(case).passed  # the left-out keywords are at the library's defaults
    needs_it = load_case("adadiag-wide-f64")
    needs_it = type(needs_it)(**{**needs_it.__dict__, "config": {**needs_it.config, "bias_correction": False}})
    report = torch_runner(NoBiasCorrection)(needs_it)
    assert not report.passed and "takes no 'bias_correction'" in str(report.error)


# ----------------------------------------------------------------------------- replay reads the fixture's config


def test_replay_of_a_fixture_uses_its_config_and_the_cli_overrides_it(tmp_path: Path) -> None:
    case = load_case("adafacdiag-wide-f64-classic")  # relative step, parameter scaling, no momentum
    fixture = str(default_data_dir() / case.file)
    out = tmp_path / "out.npz"
    assert golden_main(["replay", "--input", fixture, "--output", str(out)]) == 0  # no --optimizer, no --config
    with np.load(out) as data:
        states = {k[len("state_") :]: data[k] for k in data.files if k.startswith("state_")}
        report = compare(data["params"], case, states=states)
    assert report.passed and "r" in report.state_fields, str(report)
    assert golden_main(["replay", "--input", fixture, "--output", str(out), "--config", '{"lr": 0.5}']) == 0
    with np.load(out) as data:
        assert not compare(data["params"], case).passed  # relative_step caps lr at 1/sqrt(t): 0.5 changes step 1+
        assert json.loads(str(data["config"]))["relative_step"] is True  # the other keys stay the fixture's


# ----------------------------------------------------------------------------- the pytest plugin


def test_plugin_adds_one_test_per_case(pytester: pytest.Pytester) -> None:
    pytest.importorskip("torch")
    pytester.makepyfile("def test_own():\n    pass\n")
    good = pytester.runpytest(
        "-p", "adadiag_ref.pytest_plugin", f"--adadiag-ref={PORTS}:PortAdaDiag", "--adadiag-ref-optimizer=adadiag"
    )
    good.assert_outcomes(passed=len(ADADIAG) + 1)
    bad = pytester.runpytest(
        "-p",
        "adadiag_ref.pytest_plugin",
        f"--adadiag-ref={PORTS}:OffByOneBiasAdaDiag",
        "--adadiag-ref-optimizer=adadiag",
    )
    bad.assert_outcomes(passed=1 + len(ADADIAG) - len(CORRECTED), failed=len(CORRECTED))
    bad.stdout.fnmatch_lines(
        ["*conformance: adadiag-wide-f64*", "adadiag-wide-f64: diverges at step 1*off by one step*"]
    )


def test_plugin_fixture_runs_a_test_per_case(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from adadiag_ref.testing import assert_trajectory_close

        @pytest.mark.adadiag_ref(optimizer="adamw", dtype="float64")
        def test_my_port(adadiag_ref_case):
            assert_trajectory_close(adadiag_ref_case.params, adadiag_ref_case)
        """
    )
    result = pytester.runpytest("-p", "adadiag_ref.pytest_plugin")
    result.assert_outcomes(passed=len(load_cases(optimizer="adamw", dtype="float64")))


def test_a_port_may_keep_its_step_count_as_a_python_int() -> None:
    """A port's ``count`` (or ``step``) returned as a plain int is compared like a 0-d array, not taken as a crash."""
    case = load_case("adadiag-wide-f64")

    def port(w: np.ndarray, g: np.ndarray, t: int):  # type: ignore[no-untyped-def]
        state = {k: v for k, v in case.state(t).items() if k != "count"}
        return case.params[t - 1], {**state, "step": t}

    report = compare(port, case)
    assert report.error is None and report.passed, str(report)
    assert "count" in report.state_fields
