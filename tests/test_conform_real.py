"""The conformance kit on code nobody here wrote (issue 45): correct ports pass unchanged, conventions are named.

* torch.optim.AdamW and optax.adamw pass every AdamW case that applies to them, unwrapped, states compared
  (their raw ``exp_avg``/``mu`` detected as raw EMAs); the ``nobc`` cases (an option they lack) are not
  applicable: skipped, counted, listed;
* each convention of real code (tests/_ports.py plants one per class) is named by its pattern on >= 2 cases;
* the summary says what was compared, per field; the CLI's selection and tolerance flags; the pytest plugin
  counts and skips right.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import numpy as np
import pytest

from adadiag_ref.golden import load_case, load_cases
from adadiag_ref.golden.conform import ConformOptions, main, run_conform, select_cases, torch_runner
from adadiag_ref.testing import compare

pytest_plugins = ("pytester",)

HERE = Path(__file__).resolve().parent
PORTS = HERE / "_ports.py"
ADAMW = load_cases(optimizer="adamw")
ADADIAG = load_cases(optimizer="adadiag")
NOBC = {c.name for c in ADAMW if not c.config["bias_correction"]}  # torch's and optax's AdamW lack the option


def _states(case):  # type: ignore[no-untyped-def]
    return {k[len("state_") :]: v for k, v in case.arrays.items() if k.startswith("state_")}


# ----------------------------------------------------------------------------- correct ports pass unchanged


@pytest.mark.parametrize("foreach", [None, False])
def test_torch_adamw_passes_every_applicable_case_with_its_states(
    foreach: bool | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    junit, report = tmp_path / "r.xml", tmp_path / "r.json"
    extra = [] if foreach is None else ["--port-option", "foreach=false"]
    argv = ["conform", "--torch", "torch.optim:AdamW", "--optimizer", "adamw", "--junit", str(junit)]
    assert main([*argv, "--json", str(report), *extra]) == 0
    out = capsys.readouterr().out
    n = len(ADAMW)
    assert f"{n - len(NOBC)}/{n - len(NOBC)} applicable cases pass, {len(NOBC)} not applicable" in out, out
    assert " s wall: " in out and " s start-up, " in out and " s in the cases)" in out, out
    for name in NOBC:
        assert f"{name}: not applicable: needs bias_correction=False" in out
    data = json.loads(report.read_text())
    for result in data["results"]:
        if result["not_applicable"] is None:  # the states compared: step, exp_avg, exp_avg_sq as count, M, V
            assert set(result["state_fields"]) == {"count", "M", "V"}, result
            assert "V (raw EMA, detected)" in result["moment_notes"], result
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("skipped") == str(len(NOBC)) and suite.get("failures") == "0"
    assert {c.get("name") for c in suite.iter("testcase") if c.find("skipped") is not None} == NOBC


def _optax_adamw(cases: list[str]) -> list[str]:
    return ["conform", "--optax", "optax:adamw", "--optimizer", "adamw", *[a for c in cases for a in ("--case", c)]]


def test_optax_adamw_passes_with_its_states(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("optax")
    picked = ["adamw-tall-f64", "adamw-conv32-f32", "adamw-wide-f64-nobc"]  # jit compiles once per case
    assert main(_optax_adamw(picked)) == 0
    out = capsys.readouterr().out
    assert "2/2 applicable cases pass, 1 not applicable" in out and "states count, V, M" in out, out


@pytest.mark.slow
def test_optax_adamw_passes_every_applicable_case(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("optax")
    assert main(_optax_adamw([])) == 0
    n = len(ADAMW)
    assert f"{n - len(NOBC)}/{n - len(NOBC)} applicable cases pass" in capsys.readouterr().out


def test_torch_adam_is_named_coupled_l2_on_every_applicable_case() -> None:
    """torch.optim.Adam's weight_decay is L2 in the gradient: correct code, another convention, named as such."""
    torch = pytest.importorskip("torch")
    result = run_conform(torch_runner(torch.optim.Adam), ADAMW, "torch.optim.Adam")
    assert {r.case for r in result.skipped} == NOBC and not result.passed
    for report in result.failed:
        assert str(report.likely_cause).startswith("coupled_l2: coupled L2 decay"), str(report)


def test_a_port_swallowing_kwargs_is_not_given_undeclared_keywords() -> None:
    pytest.importorskip("torch")
    import _ports

    class Swallows(_ports.PortAdaDiag):
        def __init__(self, params, lr, betas, eps, weight_decay, update_freq, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(params, lr, betas, eps, weight_decay, update_freq, **kwargs)

    nobc = load_case("adadiag-wide-f64-nobc")
    report = torch_runner(Swallows)(nobc)
    assert report.not_applicable is not None and "would swallow through **kwargs" in report.not_applicable
    assert "--accepts bias_correction" in report.not_applicable
    declared = torch_runner(Swallows, ConformOptions(accepts=("bias_correction",)))(nobc)
    assert declared.passed, str(declared)


def test_a_constructor_that_raises_fails_with_its_own_frames_only() -> None:
    pytest.importorskip("torch")
    import _ports

    class Broken(_ports.PortAdaDiag):
        def __init__(self, params, lr, betas, eps, weight_decay, update_freq):  # type: ignore[no-untyped-def]
            raise RuntimeError("no such thing")

    report = torch_runner(Broken)(load_case("adadiag-wide-f64"))
    assert report.failed and report.error is not None and "RuntimeError: no such thing" in report.error
    assert "golden/conform.py" not in report.error and "test_conform_real.py" in report.error
    assert "step None" not in str(report) and "before its first step" in report.summary()


# ----------------------------------------------------------------------------- conventions named


_CONVENTIONS = ("eps_before_bias", "decay_after_update", "coupled_l2", "missing_decay", "no_bias_correction")


def _failed(port: str) -> tuple[list, list]:  # type: ignore[type-arg]
    """The failed reports of a tests/_ports.py class over the AdaDiag cases, and those of the float64 cases."""
    pytest.importorskip("torch")
    import _ports

    result = run_conform(torch_runner(getattr(_ports, port)), ADADIAG, port)
    return result.failed, [r for r in result.failed if "-f64" in r.case]


@pytest.mark.parametrize(
    ("port", "pattern"),
    [
        ("EpsBeforeBiasAdaDiag", "eps_before_bias: "),
        ("DecayAfterUpdateAdaDiag", "decay_after_update: "),
        ("CoupledL2AdaDiag", "coupled_l2: "),
        ("MissingDecayAdaDiag", "missing_decay: "),
        ("RawUpdateAdaDiag", "no_bias_correction: "),
        ("RawStateAdaDiag", "raw moments: V is the fixture's times 1 - beta2^t"),
        ("SkipFirstAdaDiag", "no_update_at_step_1: "),
        ("OtherSideAdaDiag", "other_side: "),
        ("Float32SvdAdaDiag", "P agrees with the canonical basis only to"),
    ],
)
def test_each_convention_is_named_on_every_float64_case_it_breaks(port: str, pattern: str) -> None:
    failed, float64 = _failed(port)
    assert len(float64) >= 2, [r.case for r in failed]
    for report in float64:
        assert str(report.likely_cause).startswith(pattern), str(report)
    others = [name for name in _CONVENTIONS if not pattern.startswith(name)]
    for report in failed:  # float32's tolerance hides some (eps placement, the decay's order): never misnamed
        assert not str(report.likely_cause).startswith(tuple(others)), str(report)


def test_a_missing_decay_is_got_minus_want_equal_lr_wd_w() -> None:
    case = load_case("adamw-wide-f64")
    lr, wd = case.config["lr"], case.config["weight_decay"]
    params = case.params.copy()
    params[0] = case.params[0] + lr * wd * case.w0  # step 1 without its decay term; later steps are not looked at
    report = compare(params, case)
    assert report.first_diverging_step == 1
    # the whole trajectory is not a run without decay (only step 1 is): no convention is named
    assert not str(report.likely_cause).startswith("missing_decay"), str(report)


# ----------------------------------------------------------------------------- honest summaries


def test_raw_moments_under_other_names_are_detected_or_declared() -> None:
    case = load_case("adamw-wide-f64")
    b1, b2 = case.config["betas"]
    t = np.arange(1, case.steps + 1)[:, None, None]
    raw = {"m": case.arrays["state_M"] * (1 - b1**t), "v": case.arrays["state_V"] * (1 - b2**t)}
    mapped = compare(case.params, case, states=raw, state_map={"m": "M", "v": "V"})
    assert mapped.passed and mapped.moment_notes == ("M (raw EMA, detected)", "V (raw EMA, detected)"), str(mapped)
    declared = compare(case.params, case, states=raw, state_map={"m": "M", "v": "V"}, moments="corrected")
    assert declared.first_mismatch is not None and declared.first_mismatch.field == "V"
    assert declared.patterns and declared.patterns[0].startswith("raw moments: V is the fixture's"), str(declared)
    summary = declared.summary()
    assert "W agrees at all 12 steps" in summary and "V differs from step 1" in summary, summary


def test_a_tolerance_edge_is_not_called_a_divergence() -> None:
    case = load_case("adamw-wide-f64")
    bound = case.tolerance.atol + case.tolerance.rtol * np.abs(case.params)
    report = compare(case.params + 1.0001 * bound, case)  # every entry just out, at every step
    assert not report.passed and report.at_edge
    assert "at the tolerance's edge from step 1 of 12" in report.summary() and "diverges" not in report.summary()
    assert compare(case.params + 1.0001 * bound, case, rtol=2 * case.tolerance.rtol).passed


def test_the_table_flags_the_row_that_diverges_and_marks_no_refresh_of_adamw() -> None:
    case = load_case("adamw-wide-f64")
    states = _states(case)
    states["V"] = states["V"] * 2  # the state wrong from step 1, the parameters exact
    report = compare(case.params, case, states=states)
    table = report.table().splitlines()
    assert "<- V differs first (W within tolerance here)" in table[1] and "first divergence" not in report.table()
    assert not any(line[6] == "R" for line in table[1:]), report.table()  # AdamW has no basis to refresh
    assert "W agrees at all 12 steps" in report.summary()
    only_w = compare(case.params, case)
    assert only_w.passed and "parameters only" in only_w.summary()


# ----------------------------------------------------------------------------- the command line


def test_list_feature_exclude_and_case_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conform", "--list", "--optimizer", "adamw", "--feature", "nobc"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == sorted(NOBC, key=[c.name for c in ADAMW].index)
    assert "nobc" in listed[0] and "float64" in listed[0]
    cases = select_cases(None, ["adamw"], None, None, exclude=["nobc", "adamw-wide-f32"])
    assert {c.name for c in cases} == {c.name for c in ADAMW} - NOBC - {"adamw-wide-f32"}
    pytest.importorskip("torch")  # --case alone: the class's name does not say which optimizer
    assert main(["conform", "--torch", f"{PORTS}:PortAdaDiag", "--case", "adadiag-square-f64"]) == 0
    assert "1/1 applicable cases pass" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--cmd", "true", "--case", "adamw-nope"],
            "no case adamw-nope among the selected ones; they are: adamw-wide-f64",
        ),
        (["--cmd", "true", "--feature", "nope"], "no feature nope; the features: "),
        (["--cmd", "true", "--rtol", "-1"], "expected a positive number"),
        (["--cmd", "true", "--state-map", "exp_avg=X"], "expected NAME=FIELD"),
    ],
)
def test_selection_errors_list_the_names(argv, message, capsys) -> None:  # type: ignore[no-untyped-def]
    try:
        code = main(["conform", *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


# ----------------------------------------------------------------------------- the pytest plugin


def test_plugin_counts_its_items_and_skips_what_does_not_apply(pytester: pytest.Pytester) -> None:
    pytest.importorskip("torch")
    pytester.makepyfile("def test_own():\n    pass\n")
    args = ["-p", "adadiag_ref.pytest_plugin", "--adadiag-ref=torch.optim:AdamW", "--adadiag-ref-optimizer=adamw"]
    collected = pytester.runpytest(*args, "--collect-only")
    collected.stdout.fnmatch_lines([f"collected {len(ADAMW) + 1} items"])
    run = pytester.runpytest(*args, "-rs")
    run.assert_outcomes(passed=len(ADAMW) - len(NOBC) + 1, skipped=len(NOBC))
    run.stdout.fnmatch_lines(["*not applicable: needs bias_correction=False*"])


def test_a_rank_deficient_refresh_without_its_structure_points_at_the_structure() -> None:
    """Without the refresh-step rule, G~'s rounding noise beyond the rank reaches W (the state agrees to its
    tolerance): the hint names the structure, not eps placement or the decay."""
    failed, float64 = _failed("NoStructureAdaDiag")
    assert len(float64) >= 2 and len(failed) == len(float64), [r.case for r in failed]
    for report in failed:
        assert "refresh-step structure of G~" in str(report.likely_cause), str(report)
        assert "rank-deficient" in str(report.likely_cause)
    case = load_case(failed[0].case)
    parameters_only = compare(np.stack([np.asarray(r) for r in _trajectory(failed[0].case)]), case)
    assert "refresh-step structure of G~" in str(parameters_only.likely_cause), str(parameters_only)


def _trajectory(name: str) -> list:  # type: ignore[type-arg]
    """NoStructureAdaDiag's parameters on one case (no state: the parameters-only hint)."""
    import _ports
    import torch

    case = load_case(name)
    param = torch.nn.Parameter(torch.from_numpy(case.w0.copy()))
    opt = _ports.NoStructureAdaDiag([param], **{k: v for k, v in case.config.items() if k != "state_dtype"})
    out = []
    for g in case.grads:
        param.grad = torch.from_numpy(g.copy())
        opt.step()
        out.append(param.detach().numpy().copy())
    return out


def test_a_counter_alone_is_not_called_an_agreeing_state() -> None:
    case = load_case("adamw-wide-f64")
    params = case.params.copy()
    params[4:] *= 1 + 1e-6
    report = compare(params, case, states={"count": case.arrays["state_count"]})
    assert report.state_fields == ("count",) and "state after step" not in str(report.likely_cause), str(report)
    assert "count agrees at all 12 steps" in report.summary() and "W differs from step 5" in report.summary()
