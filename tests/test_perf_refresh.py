"""The refresh benchmark module (``adadiag-ref bench --refresh-routes/--refresh-scaling``): its routes and report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")  # adadiag_ref.perf's engine is numba code

from adadiag_ref.linalg import canonical_svd
from adadiag_ref.perf import refresh
from adadiag_ref.perf.bench import gradient_with_spectrum


@pytest.mark.parametrize("name", sorted(refresh.CANDIDATES))
@pytest.mark.parametrize("spectrum", ["decaying", "flat"])
def test_every_evaluated_route_gives_the_canonical_basis(name: str, spectrum: str) -> None:
    # Every candidate ends in the same canonicalisation, so each must reproduce the reference basis on the
    # leading half of the spectrum to the fast route's bound (1e-3), whatever decomposition it started from.
    rng = np.random.default_rng(41)
    G = gradient_with_spectrum((48, 130), spectrum, rng)
    ref = np.asarray(canonical_svd(G, compute_q=False).P)
    previous = np.asarray(canonical_svd(G + 0.1 * rng.standard_normal(G.shape).astype(np.float32), compute_q=False).P)
    P = refresh.CANDIDATES[name](G, previous)
    assert P.shape == (48, 48) and P.dtype == np.float32
    column, subspace = refresh.leading_half_disagreement(P, ref)
    assert column <= 1e-3 and subspace <= 1e-3, (column, subspace)


def test_leading_half_disagreement_sees_a_swapped_column() -> None:
    P = np.eye(6)
    assert refresh.leading_half_disagreement(P, P) == (0.0, 0.0)
    swapped = P[:, [0, 1, 3, 2, 4, 5]]  # column 3 of the leading half swapped with column 4 of the trailing half
    column, subspace = refresh.leading_half_disagreement(swapped, P)
    assert column == 1.0 and subspace == pytest.approx(1.0)


def test_scaling_report_and_plot(tmp_path: Path) -> None:
    lines: list[str] = []
    plot = tmp_path / "scaling.png"
    result = refresh.run_scaling((16, 32, 64), reps=1, plot=plot, out=lines.append)
    assert set(result) == {"svd, Gaussian", "gram, Gaussian", "svd, 1/i", "gram, 1/i"}
    for entry in result.values():
        assert [n for n, _ in entry["points"]] == [16, 32, 64]
        assert np.isfinite(entry["exponent"])
    assert plot.stat().st_size > 0
    assert any("fitted p" in line for line in lines)


def test_refresh_routes_time_the_users_engine_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # the refresh share is refresh time / (T x step time): the step is ar.Engine's, what a user's loop runs
    seen: list[tuple[object, ...]] = []
    real = refresh.EngineSteps

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(args[:1] + args[2:])
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(refresh, "_threads", lambda threads: threads)  # no process-wide thread setting in a test
    monkeypatch.setattr(refresh, "EngineSteps", spy)
    refresh.run_routes(quick=True, reps=1, threads=1, out=lambda line: None)
    assert seen == [("adadiag", "paper")]
