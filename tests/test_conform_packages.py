"""The conformance kit on real packages: the verdicts ``adadiag-ref conform`` gives them (issue 45).

torch.optim's AdamW and Adam and optax's adamw are in tests/test_conform_real.py.  Here: official GaLore
(``galore-torch``, installed ``--no-deps`` by scripts/setup-env.sh) and SOAP from ``pytorch-optimizer``.  Each is
correct code with its own conventions, and the kit names them: never a crash, never a generic hint where the
evidence fits a pattern.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import _adapter_import  # noqa: F401  (registers adadiag_ref.adapters from a source checkout)
import pytest

from adadiag_ref.golden.conform import ConformOptions, run_conform, select_cases, torch_runner

HERE = Path(__file__).resolve().parent
GALORE = importlib.util.find_spec("galore_torch") is not None
SOAP = importlib.util.find_spec("pytorch_optimizer") is not None
HF_NAMES = {"bias_correction": "correct_bias"}  # HF's, GaLore's and SOAP's name of the keyword


@pytest.fixture(scope="module")
def galore():  # type: ignore[no-untyped-def]
    if not GALORE:
        pytest.skip("galore-torch is not installed (pip install --no-deps galore-torch)")
    pytest.importorskip("torch")
    import _galore_port

    return _galore_port


def test_galore_adamw_is_named_hf_adamw(galore) -> None:  # type: ignore[no-untyped-def]
    """GaLore's AdamW (HF's): eps before the bias correction and the decay of the updated W, on every float64
    case; with correct_bias=False (the nobc cases) only the decay's order is left."""
    cases = select_cases(None, ["adamw"], "float64", None)
    options = ConformOptions(rename=HF_NAMES, port_options={"no_deprecation_warning": True})
    result = run_conform(torch_runner(galore.GaLoreAdamW, options), cases, "GaLore AdamW")
    assert not result.skipped and not result.passed  # correct_bias renamed: every case applies
    for report in result.reports:
        assert report.error is None and report.first_mismatch is not None, str(report)
        expected = "decay_after_update: " if "nobc" in report.case else "hf_adamw: "
        assert str(report.likely_cause).startswith(expected), str(report)
        assert set(report.state_fields) == {"count", "M", "V"} and report.field_status[0][1] is None  # states agree


@pytest.mark.slow
def test_galore_at_full_rank_is_named_a_float32_svd(galore) -> None:  # type: ignore[no-untyped-def]
    """GaLore at full rank on the 2-D AdaDiag cases: its SVD runs in float32 (``.float()``), which the moments
    show at the first refresh; on a square matrix it rotates the right side (``std``: ``m >= n``)."""
    cases = select_cases(None, ["adadiag"], "float64", None, exclude=["conv_4d", "vector_1d", "fixed_basis"])
    cases = [c for c in cases if c.config.get("max_basis_dim", 8192) >= min(c.shape)]
    result = run_conform(torch_runner(galore.GaLoreFullRank, ConformOptions(rename=HF_NAMES)), cases, "GaLore")
    assert not result.passed and all(r.error is None for r in result.reports)
    named = [r for r in result.failed if "float32 SVD" in str(r.likely_cause)]
    assert len(named) >= 5, result.text()
    for report in named:
        assert report.first_mismatch is not None and report.first_mismatch.field == "V", str(report)


@pytest.mark.slow
def test_soap_is_named_no_update_at_step_1() -> None:
    """pytorch-optimizer's SOAP builds its preconditioner at step 1 without an update: named on every case."""
    if not SOAP:
        pytest.skip("pytorch-optimizer is not installed (pip install --no-deps pytorch-optimizer)")
    pytest.importorskip("torch")
    from pytorch_optimizer import SOAP as Soap

    options = ConformOptions(
        rename={**HF_NAMES, "update_freq": "precondition_frequency", "max_basis_dim": "max_precondition_dim"},
        port_options={"shampoo_beta": 0.0},
    )
    cases = select_cases(None, ["adadiag_pp"], None, None)
    result = run_conform(torch_runner(Soap, options), cases, "SOAP")
    assert not result.skipped and not result.passed
    for report in result.reports:
        assert report.error is None, str(report)
        assert "no_update_at_step_1: W_2 = W_1" in str(report.likely_cause), str(report)
