"""Mutation tests: the harness must catch each common AdaDiag bug, at the right step.

``ReferenceAdam`` below is an independent NumPy implementation of the Adam
family (AdamW, AdaDiag = Algorithm 1, AdaDiag++), written from the paper and
docs/spec.md; it shares only ``canonical_svd`` with the library.  Each flag of
``Bugs`` plants one mistake that real implementations make.  The unmutated
copy must pass :func:`adadiag_ref.testing.compare` on every Adam-family
fixture; every mutant must fail it with the expected first diverging step
and likely cause.

Fixture ``adadiag-wide-f64``: W is 3 x 5, T = 4, 12 steps, refreshes at
t = 1, 5, 9, lr = 0.01, weight decay 0.1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import pytest

from adadiag_ref import canonical_svd
from adadiag_ref.golden import GoldenCase, load_case, load_cases
from adadiag_ref.testing import CAUSE_REFRESH, CAUSE_SCHEDULE, CAUSE_STEP1, CAUSE_STEP2, compare

SIDES = {"adamw": 0, "adadiag": 1, "adadiag_pp": 2}


@dataclass(frozen=True)
class Bugs:
    eps_inside_sqrt: bool = False  # U = M / sqrt(V + eps)
    no_bias_correction: bool = False  # raw betas instead of beta-hat
    refresh_t_mod_T: bool = False  # the paper read literally: P = I until t mod T == 0
    refresh_t1_and_t_mod_T: bool = False  # t == 1 or t mod T == 0 instead of (t - 1) mod T == 0
    no_sign_canonicalisation: bool = False  # raw LAPACK signs / completion
    moments_reprojected: bool = False  # M <- P_new^T P_old M at a refresh
    decay_after_update: bool = False  # W <- W - lr U; then W <- W - lr lambda W (the updated W)
    rotation_wrong_side: bool = False  # one-sided rotation on the long side


def beta_hat(beta: float, t: int) -> float:
    """beta (1 - beta^(t-1)) / (1 - beta^t): the bias-corrected EMA coefficient."""
    return 0.0 if beta == 0.0 else beta * (1.0 - beta ** (t - 1)) / (1.0 - beta**t)


def raw_svd_bases(G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Full P, Q straight from LAPACK, with no canonical rule applied."""
    U, _, Vh = np.linalg.svd(G, full_matrices=True)
    return U, Vh.T


def canonical_bases(G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    svd = canonical_svd(G)
    return svd.P, svd.Q


class ReferenceAdam:
    """Algorithm 1 (and its two-sided / identity-basis variants), one step per call."""

    def __init__(self, case: GoldenCase, bugs: Bugs = Bugs()) -> None:
        cfg = case.config
        self.lr, (self.b1, self.b2) = cfg["lr"], cfg["betas"]
        self.eps, self.wd, self.T = cfg["eps"], cfg["weight_decay"], cfg["update_freq"]
        self.sides = SIDES[case.optimizer]
        self.bugs = bugs
        shape = case.shape
        a = shape[0] if len(shape) >= 2 else 1
        b = math.prod(shape[1:]) if len(shape) >= 2 else math.prod(shape)
        self.shape, self.transposed = shape, a > b
        self.m, self.n = min(a, b), max(a, b)
        self.matrix = len(shape) >= 2
        dt = case.dtype
        self.M = np.zeros((self.m, self.n), dt)
        self.V = np.zeros((self.m, self.n), dt)
        self.P, self.Q = np.eye(self.m, dtype=dt), np.eye(self.n, dtype=dt)

    def _work(self, x: np.ndarray) -> np.ndarray:
        x = x.reshape(self.n, self.m).T if self.transposed else x.reshape(self.m, self.n)
        return x

    def _unwork(self, x: np.ndarray) -> np.ndarray:
        return (x.T if self.transposed else x).reshape(self.shape)

    def _refresh_due(self, t: int) -> bool:
        if self.bugs.refresh_t_mod_T:
            return self.T is not None and t % self.T == 0
        if self.bugs.refresh_t1_and_t_mod_T:
            return t == 1 or (self.T is not None and t % self.T == 0)
        return t == 1 or (self.T is not None and (t - 1) % self.T == 0)

    def __call__(self, w: np.ndarray, g: np.ndarray, t: int) -> np.ndarray:
        W, G = self._work(w), self._work(g)
        refreshed = self.sides > 0 and self._refresh_due(t)
        if refreshed:
            P_old, Q_old = self.P, self.Q
            bases = raw_svd_bases if self.bugs.no_sign_canonicalisation else canonical_bases
            P, Q = bases(G)
            if self.bugs.rotation_wrong_side and self.sides == 1 and self.matrix:
                self.P, self.Q = np.eye(self.m, dtype=G.dtype), Q  # rotate the n side with Q instead
            else:
                self.P = P if self.matrix else np.eye(self.m, dtype=G.dtype)
                self.Q = Q if self.sides == 2 and self.matrix else np.eye(self.n, dtype=G.dtype)
            if self.bugs.moments_reprojected:
                A, B = self.P.T @ P_old, Q_old.T @ self.Q
                self.M = A @ self.M @ B
                self.V = (A * A) @ self.V @ (B * B)
        Gt = self.P.T @ G @ self.Q
        if refreshed:  # spec: G~ entries at the rank tolerance are exact zeros on a refresh step
            tol = max(self.m, self.n) * np.finfo(G.dtype).eps * np.sqrt(np.sum(G * G))
            Gt = np.where(np.abs(Gt) <= tol, 0.0, Gt).astype(G.dtype)
        b1 = self.b1 if self.bugs.no_bias_correction else beta_hat(self.b1, t)
        b2 = self.b2 if self.bugs.no_bias_correction else beta_hat(self.b2, t)
        self.M = b1 * self.M + (1.0 - b1) * Gt
        self.V = b2 * self.V + (1.0 - b2) * Gt * Gt
        if self.bugs.eps_inside_sqrt:
            Ut = self.M / np.sqrt(self.V + self.eps)
        else:
            Ut = self.M / (np.sqrt(self.V) + self.eps)
        D = self.P @ Ut @ self.Q.T
        if self.bugs.decay_after_update:
            W_half = W - self.lr * D
            W_new = W_half - self.lr * self.wd * W_half
        else:
            W_new = W - self.lr * (D + self.wd * W)
        return self._unwork(W_new.astype(w.dtype))


ADAM_CASES = [c for name in SIDES for c in load_cases(optimizer=name)]


@pytest.mark.parametrize("case", ADAM_CASES, ids=lambda c: c.name)
def test_unmutated_reference_passes(case: GoldenCase) -> None:
    report = compare(ReferenceAdam(case), case)
    assert report.passed, str(report)


def _sign_flip_steps(case: GoldenCase) -> int | None:
    """First refresh t > 1 at which raw LAPACK signs change relative to the previous refresh.

    One-sided AdaDiag is invariant to a basis sign flip as long as the flip is
    the same at consecutive refreshes (M is carried in the flipped frame); it
    diverges at the first refresh where the flip pattern changes.
    """
    ref = ReferenceAdam(case)
    previous = None
    for t in case.refresh_steps:
        G = ref._work(case.grads[t - 1])
        P_raw, _ = raw_svd_bases(G)
        P_can, _ = canonical_bases(G)
        flips = np.sign(np.sum(P_raw * P_can, axis=0))
        if previous is not None and not np.array_equal(flips, previous):
            return t
        previous = flips
    return None


# (mutation, fixture, expected first diverging step, expected cause)
MUTATIONS: list[tuple[str, str, int, str]] = [
    ("eps_inside_sqrt", "adadiag-wide-f64", 1, CAUSE_STEP1),
    ("no_bias_correction", "adadiag-wide-f64", 1, CAUSE_STEP1),
    ("refresh_t_mod_T", "adadiag-wide-f64", 1, CAUSE_STEP1),
    ("refresh_t1_and_t_mod_T", "adadiag-wide-f64", 4, CAUSE_SCHEDULE),
    ("no_sign_canonicalisation", "adadiag-wide-f64", -1, CAUSE_REFRESH),
    ("moments_reprojected", "adadiag-wide-f64", 5, CAUSE_REFRESH),
    ("decay_after_update", "adadiag-wide-f64", 1, CAUSE_STEP1),
    ("rotation_wrong_side", "adadiag-wide-f64", 1, CAUSE_STEP1),
]


def test_every_bug_has_a_mutation() -> None:
    assert {m[0] for m in MUTATIONS} == {f.name for f in fields(Bugs)}


@pytest.mark.parametrize(("bug", "fixture", "expected_step", "cause"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught(bug: str, fixture: str, expected_step: int, cause: str) -> None:
    case = load_case(fixture)
    if expected_step == -1:  # the step where LAPACK's sign pattern first changes between refreshes
        flip_step = _sign_flip_steps(case)
        assert flip_step is not None, "pick a fixture where LAPACK's signs differ from the canonical ones"
        expected_step = flip_step
    report = compare(ReferenceAdam(case, replace(Bugs(), **{bug: True})), case)
    print(f"{bug}: caught at step {report.first_diverging_step} ({report.likely_cause})")
    assert not report.passed, f"mutation {bug} was not caught"
    assert report.first_diverging_step == expected_step, str(report)
    assert report.likely_cause is not None and report.likely_cause.startswith(cause), str(report)


def test_no_sign_canonicalisation_is_caught_two_sided() -> None:
    """AdaDiag++ flips P and Q together; raw LAPACK signs and null-space columns still diverge at a refresh."""
    case = load_case("adadiag_pp-wide-f64")
    report = compare(ReferenceAdam(case, Bugs(no_sign_canonicalisation=True)), case)
    assert not report.passed
    # Q's two null-space columns come from LAPACK: first felt at step 2, one step after the t = 1 refresh; the
    # parameters alone cannot tell the completion from the moment update, and the hint says so
    assert report.first_diverging_step == 2, str(report)
    assert report.likely_cause == CAUSE_STEP2
    # with its state returned, the port is caught where the bug is: the basis of the t = 1 refresh
    ref = ReferenceAdam(case, Bugs(no_sign_canonicalisation=True))
    with_state = compare(lambda w, g, t: (ref(w, g, t), {"P": ref.P, "Q": ref.Q, "M": ref.M, "V": ref.V}), case)
    mismatch = with_state.first_mismatch
    assert mismatch is not None and mismatch.step == 1 and mismatch.field in ("P", "Q"), str(with_state)
    assert "basis" in str(with_state.likely_cause) or "sign" in str(with_state.likely_cause), str(with_state)


def test_raw_lapack_signs_differ_from_canonical_on_the_fixture() -> None:
    """The sign mutation is meaningful: LAPACK's P is not already canonical on adadiag-wide-f64."""
    case = load_case("adadiag-wide-f64")
    ref = ReferenceAdam(case)
    differs = []
    for t in case.refresh_steps:
        G: Any = ref._work(case.grads[t - 1])
        differs.append(not np.allclose(raw_svd_bases(G)[0], canonical_bases(G)[0]))
    assert any(differs)
