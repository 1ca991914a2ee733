"""Tolerances from the conditioning of the basis (docs/golden.md, "Tolerances"; docs/spec.md, section 4).

``basis_conditioning`` on constructed spectra (exact values); NumPy, torch and JAX trajectories on near-tied
spectra, which leave the golden tolerance but stay within the conditioning tolerance; the report says why it
is wider; a real bug is still caught there; fixtures store ``kappa`` (format 3) and format 2 is still read.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import adadiag_ref as ar
from adadiag_ref.golden import default_data_dir, load_cases
from adadiag_ref.golden.cli import main
from adadiag_ref.golden.generator import case_from_arrays
from adadiag_ref.golden.verify import verify_case
from adadiag_ref.linalg import basis_conditioning
from adadiag_ref.replay import Replay, replay, trajectory_conditioning
from adadiag_ref.testing import compare

EPS = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)
ROTATED = ("adadiag", "adadiag_pp", "adafacdiag", "adafacdiag_pp", "hfacdiag")


def _benchmark() -> ModuleType:
    """``benchmarks/conditioning_tolerance.py``: the measured streams, so the test checks the same spectra."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "conditioning_tolerance.py"
    spec = importlib.util.spec_from_file_location("conditioning_tolerance", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _benchmark()


# ----------------------------------------------------------------------------- the function


@pytest.mark.parametrize(
    ("S", "m", "n", "delta"),
    [
        ((1.0, 0.5, 0.25), 3, 5, 0.25),  # well separated: the smallest gap next to a kept direction
        ((1.0, 1.0 - 1e-8, 0.5), 3, 5, 1.0 - (1.0 - 1e-8)),  # a near-tie: eps / gap
        ((4.0, 4.0 - 4e-6, 2.0), 3, 5, (4.0 - (4.0 - 4e-6)) / 4.0),  # relative to sigma_max
        ((0.5, 1.0, 0.25), 3, 5, 0.25),  # any order
        ((1.0, 1.0, 0.5), 3, 5, 0.5),  # an exact cluster is canonicalised: its gap does not count
        ((1.0, 0.5, 0.0), 3, 5, 0.5),  # rank 2: the gap to the dropped value, the exact zero far from tau
        ((1.0, 0.0, 0.0), 3, 5, 1.0),  # rank 1: nothing counts
        ((0.0, 0.0, 0.0), 3, 5, 1.0),  # a zero matrix: the identity, fully determined
        ((1.0, 0.5, 150 * EPS), 3, 200, 50 * EPS),  # rank margin: the dropped value 50 eps below tau = 200 eps
        ((1.0, 1.0 - 250 * EPS, 0.5), 3, 200, 50 * EPS),  # a gap 50 eps above the cluster tolerance
        ((1.0, 1.0 - 150 * EPS, 0.5), 3, 200, 50 * EPS),  # a gap 50 eps below it: clustered, but fragile
        ((1.0, 1.0 - 50 * EPS, 0.5), 3, 200, 0.5 - 50 * EPS),  # deep inside the cluster: robust
    ],
)
def test_basis_conditioning_on_constructed_spectra(S: tuple[float, ...], m: int, n: int, delta: float) -> None:
    assert basis_conditioning(np.array(S), m, n, np.float64) == pytest.approx(EPS / delta, rel=1e-12)


def test_basis_conditioning_scales_with_eps_and_saturates() -> None:
    S = np.array([1.0, 1.0 - 1e-3, 0.5])
    assert basis_conditioning(S, 3, 5, np.float32) == pytest.approx(EPS32 / (1.0 - (1.0 - 1e-3)), rel=1e-12)
    # a value one ulp from the rank tolerance: the rank is decided by rounding, the basis undetermined
    assert basis_conditioning(np.array([1.0, 0.5, 5 * EPS]), 3, 5, np.float64) == 1.0
    assert basis_conditioning(np.array([]), 3, 5, np.float64) == EPS


def test_trajectory_conditioning_follows_the_worst_refresh() -> None:
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((9, 3, 5))
    grads[4] = BENCH.spectrum_gradient("gap=1e-8", (3, 5), rng)  # the refresh at t = 5 (T = 4)
    cfg = ar.make_config("adadiag", update_freq=4)
    kappa = trajectory_conditioning(cfg, grads)
    S = np.linalg.svd(grads[4], compute_uv=False)
    assert kappa[4] == kappa[8] == pytest.approx(EPS / ((S[0] - S[1]) / S[0]), rel=1e-6)
    assert np.all(kappa[:4] < 1e-13) and kappa[3] == kappa[0]
    assert np.all(trajectory_conditioning(ar.make_config("adamw"), grads) == 0.0)  # no basis
    result = replay("adadiag", rng.standard_normal((3, 5)), grads, lr=1e-2, update_freq=4, conditioning=True)
    assert isinstance(result, Replay) and np.array_equal(result.conditioning, kappa)
    assert result.params.shape == (9, 3, 5)


# ----------------------------------------------------------------------------- cross-backend trajectories


def _near_tie_case(name: str, gap: str = "gap=1e-10", seed: int = 7000):  # type: ignore[no-untyped-def]
    """A case whose refreshes (t = 1, 5, 9) have two singular values a relative ``gap`` apart."""
    w0, grads = BENCH.stream(gap, (6, 10), seed)
    cfg = ar.make_config(name, lr=1e-2, weight_decay=0.1, update_freq=4, kernels="reference")
    return case_from_arrays(f"{name}-near-tie", cfg, w0, grads)


def _torch_report(case, conditioning: bool = True):  # type: ignore[no-untyped-def]
    """The core on torch (another LAPACK), parameters and states, against the NumPy case."""
    torch = pytest.importorskip("torch")
    cfg = case.make_config()
    w = torch.from_numpy(case.w0.copy())
    state = ar.init(w, cfg)

    def step_fn(_w, g, t):  # type: ignore[no-untyped-def]
        nonlocal w, state
        w, state = ar.step(state, torch.from_numpy(g), cfg, w)
        return w.numpy().copy(), {k: v for k, v in state._asdict().items() if k != "count"}

    return compare(step_fn, case, conditioning=conditioning)


@pytest.mark.parametrize("name", ROTATED)
def test_backends_within_the_conditioning_tolerance_on_near_ties(name: str) -> None:
    """NumPy (the case), torch (the core on torch tensors, parameters and states) and JAX (the optax alias under
    ``jax.jit``, through ``adadiag-ref conform``'s runner) on a near-tie of relative gap 1e-10."""
    case = _near_tie_case(name)
    plain = _torch_report(case, conditioning=False)
    assert not plain.passed, "the near-tie must leave the golden tolerance (else this test shows nothing)"
    report = _torch_report(case)
    assert report.passed, str(report)
    assert report.widened_from == 1 and float(np.nanmax(report.tolerance_ratio)) < 0.1, str(report)
    pytest.importorskip("optax")
    from adadiag_ref.adapters import optax as ao

    from adadiag_ref.golden.conform import optax_runner

    conformed = optax_runner(ao.ALIASES[name])(case)
    assert conformed.passed and float(np.nanmax(conformed.tolerance_ratio)) < 0.1, str(conformed)


def test_well_separated_cases_keep_the_golden_tolerance() -> None:
    """The shipped cases (random, rank-deficient, exact clusters) are well conditioned: no tolerance widens."""
    for case in load_cases():
        rtol, atol, state_rtol = case.tolerances_per_step()
        assert np.all(rtol == case.tolerance.rtol) and np.all(atol == case.tolerance.atol), case.name
        assert np.all(state_rtol == case.tolerance.state_rtol), case.name


def test_a_real_bug_is_still_caught_on_a_near_tie() -> None:
    """The widened tolerance (2.2e-6 at a gap of 1e-10) is far below what a small bug does at step 1: weight decay
    0.1 -> 0.11 changes ``W_2`` by ``1e-4 |W_1|``.  (At a gap of 1e-12, ``kappa = 2.2e-4``, it is caught at step 5.)"""
    case = _near_tie_case("adadiag")
    wrong = ar.make_config("adadiag", **{**case.config, "weight_decay": 0.11})
    params, _ = BENCH.run_core(wrong, case.w0, case.grads, np.asarray)
    report = compare(params, case)
    assert not report.passed and report.first_diverging_step == 1
    assert float(np.max(report.step_rtol)) < 1e-5


def test_report_shows_the_tolerance_used() -> None:
    case = _near_tie_case("adadiag")
    report = _torch_report(case)
    note = report.tolerance_note()
    assert "tolerance widened by the basis conditioning from step 1" in report.summary()
    assert f"kappa {report.conditioning[0]:.2g}" in note and "case: 1e-12" in note
    assert report.to_dict()["tolerance_note"] == note and report.to_dict()["step_rtol"][0] > 1e-12
    assert "rtol" in report.table().splitlines()[0]  # the per-step tolerance column
    failing = compare(case.params * (1 + 1e-3), case)
    assert not failing.passed and note.split(":")[0] in str(failing)
    ordinary = compare(load_cases(optimizer="adadiag")[0].params, load_cases(optimizer="adadiag")[0])
    assert ordinary.passed and "widened" not in str(ordinary) and ordinary.tolerance_note() == ""


# ----------------------------------------------------------------------------- the fixtures


def test_fixtures_store_the_conditioning_of_every_refresh() -> None:
    manifest = json.loads((default_data_dir() / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    for entry, case in zip(manifest["cases"], load_cases(), strict=True):
        assert len(entry["conditioning"]) == len(entry["refresh_steps"]), entry["name"]
        assert {"conditioning_factor", "state_conditioning_factor"} <= set(entry["tolerance"])
        live = trajectory_conditioning(case.make_config(), case.grads)
        np.testing.assert_allclose(case.conditioning_per_step(), live, rtol=1e-6, atol=0.0)


def test_format_2_is_still_read_with_the_conditioning_computed(tmp_path: Path) -> None:
    shutil.copytree(default_data_dir(), tmp_path / "set")
    path = tmp_path / "set" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 2
    for entry in manifest["cases"]:
        del entry["conditioning"]
        del entry["tolerance"]["conditioning_factor"], entry["tolerance"]["state_conditioning_factor"]
    path.write_text(json.dumps(manifest))
    for old, new in zip(load_cases(tmp_path / "set"), load_cases(), strict=True):
        assert old.conditioning == () and old.tolerance == new.tolerance
        np.testing.assert_allclose(old.conditioning_per_step(), new.conditioning_per_step(), rtol=1e-6)
    assert main(["golden", "verify", str(tmp_path / "set")]) == 0


def test_verify_flags_a_wrong_stored_conditioning() -> None:
    case = next(c for c in load_cases(optimizer="adadiag") if c.name == "adadiag-wide-f64")
    edited = type(case)(**{**case.__dict__, "conditioning": (1e-3,) * len(case.refresh_steps)})
    problems = verify_case(edited).problems
    assert any("conditioning of the refresh at step 1" in p for p in problems), problems


def test_cli_replay_writes_the_conditioning(tmp_path: Path) -> None:
    case = _near_tie_case("adadiag")
    np.savez(tmp_path / "in.npz", w0=case.w0, grads=case.grads)
    config = json.dumps({"lr": 1e-2, "weight_decay": 0.1, "update_freq": 4})
    args = ["replay", "--optimizer", "adadiag", "--config", config]
    assert main([*args, "--input", str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_allclose(out["conditioning"], case.conditioning_per_step(), rtol=1e-12)
