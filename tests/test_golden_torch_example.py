"""End-to-end example of docs/golden.md: an independent implementation, torch ops only.

``TorchAdaDiag`` implements AdamW (sides = 0), AdaDiag (Algorithm 1, sides = 1)
and AdaDiag++ (sides = 2) with nothing but torch tensor operations, including
its own port of the canonical SVD convention of docs/spec.md (order, rank,
clusters, sign rule, pivoted Gram-Schmidt completion).  It does not import the
library's optimizer code; the fixtures alone decide whether it is right.
"""

from __future__ import annotations

import math

import pytest

from adadiag_ref.golden import GoldenCase, load_cases
from adadiag_ref.testing import assert_trajectory_close

torch = pytest.importorskip("torch")

SIDES = {"adamw": 0, "adadiag": 1, "adadiag_pp": 2}


# ----------------------------------------------------------------------------- canonical SVD in torch


def sign_rule(B, rtol):  # type: ignore[no-untyped-def]
    """+-1 per column: the first entry within rtol of the largest magnitude becomes positive."""
    mag = B.abs()
    near = mag >= mag.max(dim=0).values * (1 - rtol)
    first = near.to(torch.int64).argmax(dim=0)
    picked = B.gather(0, first[None, :])[0]
    return torch.where(picked < 0, -1.0, 1.0).to(B.dtype)


def pivoted_gram_schmidt(X, count, against, rtol):  # type: ignore[no-untyped-def]
    """Greedy orthonormal picks among the columns of X (largest residual norm, ties to lowest index)."""
    residual, chosen = X.clone(), []
    for _ in range(count):
        norms = (residual * residual).sum(dim=0)
        p = int((norms >= norms.max() * (1 - rtol)).to(torch.int64).argmax())
        v = residual[:, p] / residual[:, p].norm()
        for B in ([against] if against is not None else []) + ([torch.stack(chosen, 1)] if chosen else []):
            v = v - B @ (B.T @ v)  # twice is enough
        v = v / v.norm()
        chosen.append(v)
        residual = residual - torch.outer(v, v @ residual)
    return torch.stack(chosen, 1) if chosen else X.new_zeros((X.shape[0], 0))


def complete(B, size, rtol):  # type: ignore[no-untyped-def]
    eye = torch.eye(size, dtype=B.dtype)
    r = B.shape[1]
    C = pivoted_gram_schmidt(eye - B @ B.T if r else eye, size - r, B if r else None, rtol)
    return C * sign_rule(C, rtol) if C.shape[1] else C


def canonical_bases(G, need_q):  # type: ignore[no-untyped-def]
    m, n = G.shape
    eps = torch.finfo(G.dtype).eps
    rtol = eps**0.5  # spec rule 6: ties (pivots, signs) up to sqrt(eps)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    tol = max(m, n) * eps * float(S[0])  # spec rules 2 and 3: rank and clusters
    rank = int((S > tol).sum()) if float(S[0]) > 0 else 0
    p_cols, q_cols, start = [], [], 0
    for i in range(1, rank + 1):
        if i == rank or float(S[i - 1] - S[i]) > tol:  # a cluster of equal singular values ends here
            Uc, Vc = U[:, start:i], Vh[start:i].T
            if i - start > 1:
                A = pivoted_gram_schmidt(Uc.T, i - start, None, rtol)
                Uc, Vc = Uc @ A, Vc @ A
            p_cols.append(Uc)
            q_cols.append(Vc)
            start = i
    Pr = torch.cat(p_cols, 1) if p_cols else G.new_zeros((m, 0))
    Qr = torch.cat(q_cols, 1) if q_cols else G.new_zeros((n, 0))
    if rank:
        signs = sign_rule(Pr, rtol)
        Pr, Qr = Pr * signs, Qr * signs
    P = torch.cat([Pr, complete(Pr, m, rtol)], 1)
    Q = torch.cat([Qr, complete(Qr, n, rtol)], 1) if need_q else None
    return P, Q, rank


# ----------------------------------------------------------------------------- the optimizer


class TorchAdaDiag:
    """W <- W - lr (P (M / (sqrt(V) + eps)) Q^T + wd W) with beta-hat EMAs of G~ = P^T G Q."""

    def __init__(  # type: ignore[no-untyped-def]
        self, optimizer: str, shape: tuple[int, ...], lr: float, betas, eps, weight_decay, update_freq, **config
    ):
        self.sides, self.shape = SIDES[optimizer], shape
        self.lr, (self.b1, self.b2), self.eps, self.wd, self.T = lr, betas, eps, weight_decay, update_freq
        self.bias_correction = config.get("bias_correction", True)
        a, b = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))
        self.transposed, self.matrix = a > b, len(shape) >= 2
        limit = config.get("max_basis_dim", 8192)  # a side longer than this is not rotated
        self.sides = 0 if min(a, b) > limit else min(self.sides, 1) if max(a, b) > limit else self.sides
        self.m, self.n = min(a, b), max(a, b)
        self.t, self.M, self.V, self.P, self.Q, self.rank = 0, None, None, None, None, 0

    def _work(self, x):  # type: ignore[no-untyped-def]
        return x.reshape(self.n, self.m).T if self.transposed else x.reshape(self.m, self.n)

    def step(self, w, g):  # type: ignore[no-untyped-def]
        self.t += 1
        t, W, G = self.t, self._work(w), self._work(g)
        if self.M is None:
            self.M, self.V = torch.zeros_like(G), torch.zeros_like(G)
        refresh = self.sides > 0 and self.matrix and (t == 1 or (self.T is not None and (t - 1) % self.T == 0))
        if refresh:
            self.P, self.Q, self.rank = canonical_bases(G, need_q=self.sides == 2)
        Gt = G
        if self.P is not None:
            Gt = self.P.T @ Gt
        if self.Q is not None:
            Gt = Gt @ self.Q
        if refresh:  # spec section 5: G~ is Sigma (two-sided) or Sigma Q^T (one-sided), exactly
            keep = torch.zeros_like(Gt, dtype=torch.bool)
            keep[: self.rank] = True  # the rows within the refresh's rank
            if self.Q is not None:
                keep &= torch.eye(self.m, self.n, dtype=torch.bool)  # and only the diagonal
            Gt = torch.where(keep, Gt, torch.zeros_like(Gt))
        b1 = self.b1 * (1 - self.b1 ** (t - 1)) / (1 - self.b1**t)
        b2 = self.b2 * (1 - self.b2 ** (t - 1)) / (1 - self.b2**t)
        if not self.bias_correction:  # the raw betas
            b1, b2 = self.b1, self.b2
        self.M = b1 * self.M + (1 - b1) * Gt
        self.V = b2 * self.V + (1 - b2) * Gt * Gt
        D = self.M / (self.V.sqrt() + self.eps)
        if self.P is not None:
            D = self.P @ D
        if self.Q is not None:
            D = D @ self.Q.T
        W_new = W - self.lr * (D + self.wd * W)
        return (W_new.T if self.transposed else W_new).reshape(self.shape)


CASES = [c for name in SIDES for c in load_cases(optimizer=name)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_implementation_matches_golden(case: GoldenCase) -> None:
    opt = TorchAdaDiag(case.optimizer, case.shape, **{k: v for k, v in case.config.items() if k != "name"})

    def step_fn(w, g, t):  # type: ignore[no-untyped-def]
        return opt.step(torch.from_numpy(w), torch.from_numpy(g))

    assert_trajectory_close(step_fn, case)
