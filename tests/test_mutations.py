"""Coverage proven by mutants: every common single bug of a port is caught by at least two shipped golden cases.

``SpecPort`` below is an independent NumPy implementation of all eight optimizers, written from docs/spec.md
(work frame, refresh schedule, refresh-step rule, the three families, step sizes, decoupled decay); it shares
only ``canonical_svd`` with the library (the canonical basis is the part of the spec a port takes as a whole).
It takes one switch, the name of a mutant of :data:`CATALOGUE`, which plants one bug that real ports make.

* ``test_unmutated_port_passes``: the unmutated port passes every shipped case, parameters and states (so the
  mutants below are single bugs of a correct port);
* ``test_mutant_is_caught``: for every mutant and every optimizer it applies to (those on which it changes the
  trajectory or the state), at least :data:`MIN_CATCHING` shipped cases fail
  :func:`adadiag_ref.testing.compare` with the state returned;
* ``test_catalogue_table`` (slow): every mutant on every case of every optimizer; the cases catching it are
  counted, and a mutant never changes a case of an optimizer outside its ``optimizers`` (the catalogue's
  claim of where it applies holds on the shipped set);
* the older tests pin the first diverging step and the hint of some bugs on ``adadiag-wide-f64`` (refreshes at
  t = 1, 5, 9), parameters only.

Some mutants leave the parameters of some optimizers unchanged and show only in the state (a sign rule reversed,
``P`` and ``Q`` or ``r`` and ``s`` swapped, a tall AdamW not transposed): compared with the state, they count.
Time on 2 loaded cores: about 20 s without ``slow`` (the port passes 161 cases in 3 s), 40 s more for the table.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from adadiag_ref import OPTIMIZERS, canonical_svd
from adadiag_ref.config import AdafactorConfig
from adadiag_ref.golden import GoldenCase, load_case, load_cases
from adadiag_ref.optim import core
from adadiag_ref.testing import CAUSE_REFRESH, CAUSE_SCHEDULE, CAUSE_STEP1, CAUSE_STEP2, compare

MIN_CATCHING = 2  # issue 33: every mutant caught by >= 2 shipped cases on every optimizer where it matters


def beta_hat(beta: float, t: int) -> float:
    """beta (1 - beta^(t-1)) / (1 - beta^t): the bias-corrected EMA coefficient."""
    return 0.0 if beta == 0.0 else beta * (1.0 - beta ** (t - 1)) / (1.0 - beta**t)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x * x)))


def sign_fixed(x: np.ndarray, rule: str = "largest") -> np.ndarray:
    """Columns of ``x`` with their largest-magnitude entry (``rule="first"``: first nonzero entry) positive."""
    out = x.copy()
    for j in range(x.shape[1]):
        col = x[:, j]
        i = int(np.argmax(np.abs(col))) if rule == "largest" else int(np.flatnonzero(np.abs(col) > 0)[0])
        if col[i] < 0:
            out[:, j] = -col
    return out


def lapack_bases(G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Full ``P, Q`` straight from LAPACK, no canonical rule applied."""
    U, _, Vh = np.linalg.svd(G, full_matrices=True)
    return U, Vh.T


def canonical_bases(G: np.ndarray, two_sided: bool, bug: str | None) -> tuple[np.ndarray, np.ndarray | None]:
    """``P`` (and ``Q``) of docs/spec.md section 4, or one of its single-rule mutants."""
    if bug == "raw_lapack_bases":
        U, V = lapack_bases(G)
        return U, V if two_sided else None
    if bug == "float32_bases":
        low = canonical_svd(G.astype(np.float32), compute_q=two_sided)
        return low.P.astype(G.dtype), None if low.Q is None else low.Q.astype(G.dtype)
    svd = canonical_svd(G, compute_q=two_sided)
    P, k = svd.P.copy(), svd.S.size
    Q = np.eye(G.shape[1], dtype=G.dtype) if svd.Q is None else svd.Q.copy()  # a one-sided port ignores Q
    if bug == "sign_rule_reversed":  # the largest entry of every column negative
        P, Q = -P, -Q
    elif bug == "sign_rule_first_entry":  # the first nonzero entry positive; Q's paired columns flipped with P's
        flip = np.sign(np.sum(sign_fixed(P, "first") * P, axis=0))
        P = P * flip
        Q[:, :k] = Q[:, :k] * flip[:k]
        Q[:, k:] = sign_fixed(Q[:, k:], "first")
    elif bug in ("cluster_lapack", "completion_lapack"):
        U, V = lapack_bases(G)
        S = svd.S
        if bug == "completion_lapack":  # null-space columns as LAPACK leaves them (sign rule applied)
            P[:, svd.rank :] = sign_fixed(U[:, svd.rank :])
            Q[:, svd.rank :] = sign_fixed(V[:, svd.rank :])
        else:  # a cluster of equal singular values kept as LAPACK's vectors (sign rule applied)
            for i in range(1, svd.rank):
                if S[i - 1] - S[i] <= 1e-8 * S[0]:
                    for j in (i - 1, i):
                        flip = 1.0 if U[np.argmax(np.abs(U[:, j])), j] > 0 else -1.0
                        P[:, j], Q[:, j] = flip * U[:, j], flip * V[:, j]
    return P, Q if two_sided else None


def refresh_step_rule(Gt: np.ndarray, G: np.ndarray, two_sided: bool) -> np.ndarray:
    """docs/spec.md section 5: a refresh step's ``G~`` without its rounding noise.

    The library's rule is followed (whichever of the two it implements), so that the port stays a correct
    port when the rule changes: the structural rule (``Sigma`` two-sided, the rows beyond the rank zero
    one-sided, the rank by rule 2 on ``|G~_ii|`` or the row norms) or the entrywise floor
    ``|G~_ij| <= max(m, n) eps ||G||_F``.
    """
    m, n = Gt.shape
    eps = float(np.finfo(Gt.dtype).eps)
    if hasattr(core, "refresh_step_structure"):
        sizes = np.abs(np.diagonal(Gt)) if two_sided else np.linalg.norm(Gt, axis=1)
        rank = int(np.sum(sizes > max(m, n) * eps * np.max(sizes))) if np.max(sizes) > 0 else 0
        keep = np.arange(m)[:, None] < rank
        if two_sided:
            keep = keep & (np.arange(m)[:, None] == np.arange(n)[None, :])
        return np.where(keep, Gt, 0.0).astype(Gt.dtype)
    floor = max(m, n) * eps * np.sqrt(np.sum(G * G))
    return np.where(np.abs(Gt) <= floor, 0.0, Gt).astype(Gt.dtype)


class SpecPort:
    """All eight optimizers of docs/spec.md, one step per call: ``port(W_t, G_t, t) -> (W_{t+1}, state)``.

    ``bug`` names one mutant of :data:`CATALOGUE` (``None``: the spec).  The state is returned in the work
    frame under the fixture's field names, so :func:`compare` checks it field by field.
    """

    def __init__(self, case: GoldenCase, bug: str | None = None) -> None:
        cfg = case.make_config()
        self.cfg, self.bug = cfg, bug
        assert bug is None or bug in MUTANTS, bug
        b1, b2 = cfg.betas[::-1] if bug == "betas_swapped" else cfg.betas
        if bug == "zero_beta1_default":  # `betas[0] or 0.9`: a momentum that was turned off comes back
            b1 = b1 or 0.9
        self.b1, self.b2 = b1, b2
        self.momentum = b1 > 0 if isinstance(cfg, AdafactorConfig) and cfg.momentum_enabled is None else cfg.momentum
        shape = case.shape
        a, b = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))
        self.shape = shape
        self.transposed = a > b and bug != "tall_not_transposed"
        self.m, self.n = (b, a) if self.transposed else (a, b)
        matrix, limit = len(shape) >= 2, cfg.max_basis_dim
        if bug == "max_basis_dim_ignored":
            limit = max(self.m, self.n)
        within = (lambda side: side < limit) if bug == "max_basis_dim_exclusive" else (lambda side: side <= limit)
        self.left = cfg.sides >= 1 and within(self.m)
        self.right = cfg.sides == 2 and matrix and self.left and within(self.n)
        self.matrix = matrix
        dt, m, n = case.dtype, self.m, self.n
        self.P = np.eye(m, dtype=dt) if self.left else None
        self.Q = np.eye(n, dtype=dt) if self.right else None
        self.moments: dict[str, np.ndarray] = {}
        if cfg.family == "adam":
            self.moments = {"M": np.zeros((m, n), dt), "V": np.zeros((m, n), dt)}
        else:
            self.moments = {"r": np.zeros(m, dt), "s": np.zeros(n, dt)}
            if cfg.family == "hfac":
                self.moments |= {"u": np.zeros(m, dt), "v": np.zeros(n, dt)}
            elif self.momentum:
                self.moments["M"] = np.zeros((m, n), dt)

    # ------------------------------------------------------------------ the work frame
    def _work(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.n, self.m).T if self.transposed else x.reshape(self.m, self.n)

    def _unwork(self, x: np.ndarray) -> np.ndarray:
        return (x.T if self.transposed else x).reshape(self.shape)

    # ------------------------------------------------------------------ schedules
    def _refresh_due(self, t: int) -> bool:
        T, bug = self.cfg.update_freq, self.bug
        if bug == "refresh_t_mod_T":  # the paper read literally: P = I until t mod T == 0
            return T is not None and t % T == 0
        if bug == "refresh_t1_and_t_mod_T":
            return t == 1 or (T is not None and t % T == 0)
        if bug == "refresh_once":  # T ignored
            return t == 1
        return t == 1 or (T is not None and (t - 1) % T == 0)

    def _decay(self, beta: float, t: int) -> float:
        """The EMA coefficient of step ``t``: beta-hat, or ``beta`` with ``bias_correction=False``."""
        corrected = self.cfg.bias_correction
        if self.bug == "no_bias_correction":
            corrected = False
        elif self.bug == "bias_correction_always":
            corrected = True
        if not corrected:
            return beta
        return beta_hat(beta, t + 1 if self.bug == "bias_off_by_one" else t)

    def _step_size(self, t: int, W: np.ndarray) -> float:
        cfg, eta = self.cfg, self.cfg.lr
        if isinstance(cfg, AdafactorConfig):
            if cfg.relative_step and self.bug != "relative_step_ignored":
                eta = min(eta, 1.0 / math.sqrt(t))
            if cfg.scale_parameter and self.bug != "parameter_scale_ignored":
                eta *= max(cfg.eps2, rms(W))
        return eta

    def _clip(self, U: np.ndarray) -> np.ndarray:
        d = getattr(self.cfg, "clip_threshold", None)
        if self.bug == "no_clipping":
            d = None
        elif self.bug == "clip_when_none" and d is None:
            d = 1.0
        return U if d is None else U / max(1.0, rms(U) / d)

    # ------------------------------------------------------------------ the families
    def _factored(self, Gt: np.ndarray, beta2: float) -> np.ndarray:
        """``r``, ``s`` updated; returns ``1 / sqrt(V)``, ``V = r s^T / 1^T r``, as
        ``sqrt(1^T r) / (sqrt(r) sqrt(s)^T)`` (no product ``r_i s_j``, which underflows in float32)."""
        sq = Gt * Gt + self.cfg.eps
        r = beta2 * self.moments["r"] + (1 - beta2) * sq.sum(axis=1)
        s = beta2 * self.moments["s"] + (1 - beta2) * sq.sum(axis=0)
        self.moments["r"], self.moments["s"] = r, s
        return (np.sqrt(r.sum()) / np.sqrt(s))[None, :] / np.sqrt(r)[:, None]  # type: ignore[no-any-return]

    def _adam(self, Gt: np.ndarray, t: int) -> np.ndarray:
        h1, h2 = self._decay(self.b1, t), self._decay(self.b2, t)
        M = h1 * self.moments["M"] + (1 - h1) * Gt
        V = h2 * self.moments["V"] + (1 - h2) * Gt * Gt
        self.moments |= {"M": M, "V": V}
        eps = self.cfg.eps
        return M / np.sqrt(V + eps) if self.bug == "eps_inside_sqrt" else M / (np.sqrt(V) + eps)  # type: ignore[no-any-return]

    def _adafactor(self, Gt: np.ndarray, t: int) -> np.ndarray:
        cfg = self.cfg
        assert isinstance(cfg, AdafactorConfig)
        if cfg.beta2_schedule == "adafactor":
            beta2 = 1.0 - t ** (-cfg.decay_rate)
        else:
            beta2 = self._decay(self.b2, t)
        inv_sqrt_v = self._factored(Gt, beta2)
        N = Gt * inv_sqrt_v
        if not self.momentum:
            return self._clip(N)
        h1 = self._decay(self.b1, t)
        if self.bug == "momentum_of_gradient":  # M = EMA[G~], U = clip(M / sqrt(V))
            self.moments["M"] = h1 * self.moments["M"] + (1 - h1) * Gt
            return self._clip(self.moments["M"] * inv_sqrt_v)
        if self.bug == "clip_after_momentum":  # M = EMA[G~ / sqrt(V)], U = clip(M)
            self.moments["M"] = h1 * self.moments["M"] + (1 - h1) * N
            return self._clip(self.moments["M"])
        self.moments["M"] = h1 * self.moments["M"] + (1 - h1) * self._clip(N)
        return self.moments["M"]

    def _hfac(self, Gt: np.ndarray, t: int) -> np.ndarray:
        m, n = Gt.shape
        h1, h2 = self._decay(self.b1, t), self._decay(self.b2, t)
        row, col = Gt.mean(axis=1), Gt.mean(axis=0)
        u = h1 * self.moments["u"] + (1 - h1) * row
        v = h1 * self.moments["v"] + (1 - h1) * col
        self.moments |= {"u": u, "v": v}
        N = Gt * self._factored(Gt, h2)
        r, s = self.moments["r"], self.moments["s"]
        k = 1.0 if self.bug == "hfac_phi_without_beta_hat" else h1
        nr, ns = (1.0, 1.0) if self.bug == "hfac_mean_unnormalised" else (n, m)
        phi = k * (u - row) / np.sqrt(r / nr)
        psi = k * (v - col) / np.sqrt(s / ns)
        return 0.5 * (phi[:, None] + psi[None, :]) + self._clip(N)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ one step
    def _refresh(self, G: np.ndarray, t: int) -> None:
        P_old, Q_old = self.P, self.Q
        wrong_side = self.bug == "rotation_wrong_side" and self.cfg.sides == 1 and self.matrix
        P, Q = canonical_bases(G, self.right or wrong_side, self.bug)
        if wrong_side:
            P = np.eye(self.m, dtype=G.dtype)  # rotates the n side with Q instead of the m side with P
        self.P = P if self.matrix else np.eye(self.m, dtype=G.dtype)
        self.Q = Q if Q is not None and self.matrix else self.Q
        if t > 1 and self.bug == "moments_reset":
            self.moments = {k: np.zeros_like(x) for k, x in self.moments.items()}
        if self.bug == "moments_reprojected":  # M <- A M B, V <- A^2 V B^2, r <- A^2 r, s <- s B^2, ...
            A = self.P.T @ P_old
            B = np.eye(self.n, dtype=G.dtype) if self.Q is None or Q_old is None else Q_old.T @ self.Q
            left = {"M": A, "V": A * A, "u": A, "r": A * A}
            right = {"M": B, "V": B * B, "v": B, "s": B * B}
            for k, x in self.moments.items():
                x = left[k] @ x if k in left else x
                self.moments[k] = x @ right[k] if k in right else x

    def __call__(self, w: np.ndarray, g: np.ndarray, t: int) -> tuple[np.ndarray, dict[str, Any]]:
        W, G = self._work(w), self._work(g)
        wd, bug = self.cfg.weight_decay, self.bug
        if bug == "decay_as_l2":  # weight decay added to the gradient (Adam, not AdamW)
            G = G + wd * W
        refreshed = self.P is not None and self._refresh_due(t)
        if refreshed:
            self._refresh(G, t)
        P = np.eye(self.m, dtype=G.dtype) if self.P is None else self.P
        Q = np.eye(self.n, dtype=G.dtype) if self.Q is None else self.Q
        Gt = P.T @ G @ Q
        if refreshed and bug != "no_refresh_step_rule":
            Gt = refresh_step_rule(Gt, G, self.right)
        family = self.cfg.family
        U = self._adam(Gt, t) if family == "adam" else self._adafactor(Gt, t) if family == "adafactor" else None
        U = self._hfac(Gt, t) if U is None else U
        D = P.T @ U @ Q if bug == "unrotate_transposed" else P @ U @ Q.T
        eta = self._step_size(t, W)
        if bug == "decay_after_update":  # W <- W - eta U; then W <- W - eta lambda W (the updated W)
            half = W - eta * D
            W_new = half - eta * wd * half
        elif bug == "decay_as_l2":
            W_new = W - eta * D
        elif bug == "decay_with_base_lr":  # lambda scaled by lr, not by eta_t
            W_new = W - eta * D - self.cfg.lr * wd * W
        else:
            W_new = W - eta * (D + wd * W)
        return self._unwork(W_new.astype(w.dtype)), self._state(t)

    def _state(self, t: int) -> dict[str, Any]:
        state: dict[str, Any] = {"count": np.asarray(t), **{k: x.copy() for k, x in self.moments.items()}}
        if self.P is not None:
            state["P"] = self.P.copy()
        if self.Q is not None:
            state["Q"] = self.Q.copy()
        if self.bug == "pq_swapped" and "Q" in state:
            state["P"], state["Q"] = state["Q"], state["P"]
        if self.bug == "factors_swapped" and "r" in state:  # row and column statistics under each other's names
            state["r"], state["s"] = state["s"], state["r"]
            if "u" in state:
                state["u"], state["v"] = state["v"], state["u"]
        return state


# ----------------------------------------------------------------------------- the catalogue

ALL = ("adamw", "adadiag", "adadiag_pp", "adafactor", "adafacdiag", "adafacdiag_pp", "hfac", "hfacdiag")
ADAM = ("adamw", "adadiag", "adadiag_pp")
ADAFACTOR = ("adafactor", "adafacdiag", "adafacdiag_pp")
HFAC = ("hfac", "hfacdiag")
FACTORED = ADAFACTOR + HFAC
ROTATED = tuple(name for name in ALL if OPTIMIZERS[name].sides > 0)
ONE_SIDED = tuple(name for name in ALL if OPTIMIZERS[name].sides == 1)
TWO_SIDED = tuple(name for name in ALL if OPTIMIZERS[name].sides == 2)


@dataclass(frozen=True)
class Mutant:
    """One single bug of :class:`SpecPort`: its switch, what it does, and the optimizers whose trajectory or state
    it changes (on the others the code it touches is not run, or changes nothing)."""

    name: str
    bug: str
    optimizers: tuple[str, ...]


CATALOGUE: tuple[Mutant, ...] = (
    # bias correction
    Mutant("no_bias_correction", "raw betas where beta-hat is due", ALL),
    Mutant("bias_correction_always", "beta-hat although bias_correction=False", ALL),
    Mutant("bias_off_by_one", "the beta-hat of step t + 1 at step t", ALL),
    # eps placement
    Mutant("eps_inside_sqrt", "M / sqrt(V + eps) instead of M / (sqrt(V) + eps)", ADAM),
    # decay coupling
    Mutant("decay_as_l2", "lambda W added to the gradient (Adam's L2) instead of decoupled", ALL),
    Mutant("decay_after_update", "the decay applied to the already updated W", ALL),
    Mutant("decay_with_base_lr", "the decay scaled by lr instead of eta_t", ADAFACTOR),
    # betas and momentum
    Mutant("betas_swapped", "beta1 and beta2 read in the wrong order", ALL),
    Mutant("zero_beta1_default", "`beta1 or 0.9`: momentum turned off comes back", ALL),
    Mutant("clip_after_momentum", "momentum order: M = EMA[G~/sqrt(V)], U = clip(M)", ADAFACTOR),
    Mutant("momentum_of_gradient", "momentum order: M = EMA[G~], U = clip(M / sqrt(V))", ADAFACTOR),
    # step size and clipping (scaling)
    Mutant("relative_step_ignored", "eta_t = lr although relative_step (min(lr, 1/sqrt(t)))", ADAFACTOR),
    Mutant("parameter_scale_ignored", "no RMS(W) factor although scale_parameter", ADAFACTOR),
    Mutant("no_clipping", "update clipping skipped", FACTORED),
    Mutant("clip_when_none", "clip_threshold=None read as d = 1", FACTORED),
    Mutant("hfac_phi_without_beta_hat", "phi, psi without their beta-hat factor", HFAC),
    Mutant("hfac_mean_unnormalised", "phi / sqrt(r) instead of / sqrt(r / n) (psi likewise)", HFAC),
    Mutant("factors_swapped", "factor transposition: r, s (and u, v) under each other's names", FACTORED),
    # refresh schedule
    Mutant("refresh_t_mod_T", "refresh at t mod T == 0 (P = I before)", ROTATED),
    Mutant("refresh_t1_and_t_mod_T", "refresh at t = 1 and t mod T == 0", ROTATED),
    Mutant("refresh_once", "update_freq ignored: one refresh, t = 1", ROTATED),
    # moments at a refresh
    Mutant("moments_reprojected", "moments rotated into the new basis at a refresh", ROTATED),
    Mutant("moments_reset", "moments zeroed at a refresh", ROTATED),
    # the canonical basis
    Mutant("raw_lapack_bases", "LAPACK's P, Q as they come (no sign, cluster or completion rule)", ROTATED),
    Mutant("sign_rule_reversed", "the largest entry of every column negative", ROTATED),
    Mutant("sign_rule_first_entry", "the first nonzero entry of every column positive", ROTATED),
    Mutant("cluster_lapack", "a cluster of equal singular values kept as LAPACK's vectors", ROTATED),
    Mutant("completion_lapack", "null-space columns as LAPACK's (sign rule applied)", ROTATED),
    Mutant("float32_bases", "the decomposition in float32 in a float64 run", ROTATED),
    Mutant("no_refresh_step_rule", "the refresh-step rule (docs/spec.md section 5) omitted", ROTATED),
    # the frame and the rotation
    Mutant("tall_not_transposed", "a tall parameter worked as it is, not as its transpose", ALL),
    Mutant("rotation_wrong_side", "one-sided rotation on the n side (G Q)", ONE_SIDED),
    Mutant("unrotate_transposed", "P^T U~ Q instead of P U~ Q^T", ROTATED),
    Mutant("pq_swapped", "P and Q stored under each other's names", TWO_SIDED),
    Mutant("max_basis_dim_ignored", "every side rotated, however long", ROTATED),
    Mutant("max_basis_dim_exclusive", "a side equal to max_basis_dim left unrotated (< instead of <=)", ROTATED),
)
MUTANTS = {m.name: m for m in CATALOGUE}
CASES = load_cases()
CASES_OF = {name: [c for c in CASES if c.optimizer == name] for name in ALL}


def caught(case: GoldenCase, bug: str | None) -> bool:
    """Whether ``compare`` (states returned) fails the port with ``bug`` on ``case``."""
    return not compare(SpecPort(case, bug), case).passed


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_unmutated_port_passes(case: GoldenCase) -> None:
    """The port without a bug matches every shipped case, parameters and every state field."""
    report = compare(SpecPort(case), case)
    assert report.passed, str(report)
    assert set(report.state_fields) == set(case.state(1)), report.state_fields


@pytest.mark.parametrize("mutant", CATALOGUE, ids=lambda m: m.name)
def test_mutant_is_caught(mutant: Mutant) -> None:
    """>= MIN_CATCHING shipped cases catch the mutant on every optimizer it applies to (stops at the
    MIN_CATCHING-th: the full count is ``test_catalogue_table``'s)."""
    short = {}
    for name in mutant.optimizers:
        found = 0
        for case in CASES_OF[name]:
            found += caught(case, mutant.name)
            if found >= MIN_CATCHING:
                break
        if found < MIN_CATCHING:
            short[name] = found
    assert not short, f"{mutant.name} ({mutant.bug}) caught by fewer than {MIN_CATCHING} cases: {short}"


@pytest.mark.slow
def test_catalogue_table() -> None:
    """Every mutant on every case: the cases catching it per optimizer (printed: the catalogue's table);
    >= MIN_CATCHING where it applies, none elsewhere."""
    lines, wrong = [], []
    for mutant in CATALOGUE:
        counts = {name: sum(caught(case, mutant.name) for case in CASES_OF[name]) for name in ALL}
        lines.append(f"{mutant.name:26s} " + " ".join(f"{name}={counts[name]}" for name in mutant.optimizers))
        wrong += [
            f"{mutant.name}/{n}: {c}"
            for n, c in counts.items()
            if (c < MIN_CATCHING if n in mutant.optimizers else c > 0)
        ]
    print("\n".join(lines))
    assert not wrong, wrong


# ----------------------------------------------------------------------------- the first step and the hint


def _parameters_only(case: GoldenCase, bug: str | None) -> Callable[[np.ndarray, np.ndarray, int], np.ndarray]:
    port = SpecPort(case, bug)
    return lambda w, g, t: port(w, g, t)[0]


def _sign_flip_step(case: GoldenCase) -> int | None:
    """First refresh t > 1 at which raw LAPACK signs change relative to the previous refresh.

    One-sided AdaDiag is invariant to a basis sign flip as long as the flip is
    the same at consecutive refreshes (M is carried in the flipped frame); it
    diverges at the first refresh where the flip pattern changes.
    """
    port = SpecPort(case)
    previous = None
    for t in case.refresh_steps:
        G = port._work(case.grads[t - 1])
        P_raw, _ = lapack_bases(G)
        P_can = canonical_svd(G, compute_q=False).P
        flips = np.sign(np.sum(P_raw * P_can, axis=0))
        if previous is not None and not np.array_equal(flips, previous):
            return t
        previous = flips
    return None


# (mutant, fixture, expected first diverging step in the parameters, expected cause)
FIRST_STEPS: list[tuple[str, str, int, str]] = [
    ("eps_inside_sqrt", "adadiag-wide-f64", 1, CAUSE_STEP1),
    ("no_bias_correction", "adadiag-wide-f64", 1, "no_bias_correction: "),  # a convention the kit names
    ("refresh_t_mod_T", "adadiag-wide-f64", 1, CAUSE_STEP1),
    ("refresh_t1_and_t_mod_T", "adadiag-wide-f64", 4, CAUSE_SCHEDULE),
    ("raw_lapack_bases", "adadiag-wide-f64", -1, CAUSE_REFRESH),
    ("moments_reprojected", "adadiag-wide-f64", 5, CAUSE_REFRESH),
    ("decay_after_update", "adadiag-wide-f64", 1, "decay_after_update: "),
    ("rotation_wrong_side", "adadiag-wide-f64", 1, CAUSE_STEP1),
]


@pytest.mark.parametrize(("bug", "fixture", "expected_step", "cause"), FIRST_STEPS, ids=[m[0] for m in FIRST_STEPS])
def test_mutation_is_caught_at_its_step(bug: str, fixture: str, expected_step: int, cause: str) -> None:
    case = load_case(fixture)
    if expected_step == -1:  # the step where LAPACK's sign pattern first changes between refreshes
        flip_step = _sign_flip_step(case)
        assert flip_step is not None, "pick a fixture where LAPACK's signs differ from the canonical ones"
        expected_step = flip_step
    report = compare(_parameters_only(case, bug), case)
    assert not report.passed, f"mutation {bug} was not caught"
    assert report.first_diverging_step == expected_step, str(report)
    assert report.likely_cause is not None and report.likely_cause.startswith(cause), str(report)


def test_raw_lapack_bases_are_caught_two_sided() -> None:
    """AdaDiag++ flips P and Q together; raw LAPACK signs and null-space columns still diverge at a refresh."""
    case = load_case("adadiag_pp-wide-f64")
    report = compare(_parameters_only(case, "raw_lapack_bases"), case)
    assert not report.passed
    # Q's two null-space columns come from LAPACK: first felt at step 2, one step after the t = 1 refresh; the
    # parameters alone cannot tell the completion from the moment update, and the hint says so
    assert report.first_diverging_step == 2, str(report)
    assert report.likely_cause == CAUSE_STEP2
    # with its state returned, the port is caught where the bug is: the basis of the t = 1 refresh
    with_state = compare(SpecPort(case, "raw_lapack_bases"), case)
    mismatch = with_state.first_mismatch
    assert mismatch is not None and mismatch.step == 1 and mismatch.field in ("P", "Q"), str(with_state)
    assert "basis" in str(with_state.likely_cause) or "sign" in str(with_state.likely_cause), str(with_state)


def test_raw_lapack_signs_differ_from_canonical_on_the_fixture() -> None:
    """The sign mutation is meaningful: LAPACK's P is not already canonical on adadiag-wide-f64."""
    case = load_case("adadiag-wide-f64")
    port = SpecPort(case)
    differs = []
    for t in case.refresh_steps:
        G: Any = port._work(case.grads[t - 1])
        differs.append(not np.allclose(lapack_bases(G)[0], canonical_svd(G, compute_q=False).P))
    assert any(differs)


def test_catalogue_names_are_the_port_switches() -> None:
    """Every mutant is a switch the port reads (a name typed wrong in either would make a mutant of nothing)."""
    source = inspect.getsource(SpecPort) + inspect.getsource(canonical_bases)
    missing = [m.name for m in CATALOGUE if f'"{m.name}"' not in source]
    assert not missing, missing
    assert len(MUTANTS) == len(CATALOGUE)
    assert all(set(m.optimizers) <= set(ALL) and m.optimizers for m in CATALOGUE)
