"""Tiny loop-based float64 references, written straight from the paper's algorithm boxes.

Each function runs the whole algorithm on a list of gradients (of a wide or
square matrix, m <= n) and returns the list of parameters W_2, W_3, ... .  They
use plain Python loops over steps and entries, the paper's beta-hat EMAs, and
the basis refresh at ``t == 1 or (t - 1) mod T == 0`` (docs/spec.md, section 3) with
``canonical_svd`` (tested on its own in test_linalg.py).  They are deliberately
slow and share no code with the library except ``canonical_svd``.
"""

from __future__ import annotations

import math

import numpy as np

from adadiag_ref import canonical_svd


def beta_hat(beta: float, t: int) -> float:
    """beta_hat_t = beta (1 - beta^(t-1)) / (1 - beta^t)."""
    if beta == 0.0:
        return 0.0
    return beta * (1.0 - beta ** (t - 1)) / (1.0 - beta**t)


def _refresh_due(t: int, T: int | None) -> bool:
    """docs/spec.md, section 3: the basis is refreshed at t = 1 and whenever (t - 1) mod T == 0."""
    return t == 1 or (T is not None and (t - 1) % T == 0)


def _rotated_gradient(G: np.ndarray, t: int, T: int | None, P: np.ndarray, Q: np.ndarray, sides: int) -> tuple:
    """The algorithm boxes' refresh and rotation lines: returns (P_t, Q_t, G~_t = P^T G Q)."""
    Gt = P.T @ G @ Q
    if sides > 0 and _refresh_due(t, T):
        svd = canonical_svd(G)
        P = svd.P
        Q = svd.Q if sides == 2 else np.eye(G.shape[1])
        Gt = _refresh_structure(P.T @ G @ Q, svd.rank, sides)
    return P, Q, Gt


def _refresh_structure(Gt: np.ndarray, rank: int, sides: int) -> np.ndarray:
    """The refresh-step convention of docs/spec.md, section 5, with the refresh's own rank: G~ is Sigma (two-sided:
    the diagonal entries i < rank kept, every other entry zero) or Sigma Q^T (one-sided: the rows i >= rank zero)."""
    m, n = Gt.shape
    out = np.zeros((m, n))
    for i in range(rank):
        if sides == 2:
            out[i, i] = Gt[i, i]
        else:
            for j in range(n):
                out[i, j] = Gt[i, j]
    return out


def _rms(A: np.ndarray) -> float:
    m, n = A.shape
    return math.sqrt(sum(A[i, j] ** 2 for i in range(m) for j in range(n)) / (m * n))


def _clip(U: np.ndarray, d: float | None) -> np.ndarray:
    """clip(U) = U / max(1, RMS(U) / d)."""
    if d is None:
        return U
    return U / max(1.0, _rms(U) / d)


def adam_family(W, grads, *, lr, betas, eps, wd, T, sides):
    """Algorithm 1 (AdaDiag: sides=1, AdaDiag++: sides=2; AdamW: sides=0)."""
    b1, b2 = betas
    m, n = W.shape
    M = np.zeros((m, n))
    V = np.zeros((m, n))
    P, Q = np.eye(m), np.eye(n)
    out = []
    for t, G in enumerate(grads, start=1):
        P, Q, Gt = _rotated_gradient(G, t, T, P, Q, sides)
        bh1, bh2 = beta_hat(b1, t), beta_hat(b2, t)
        U = np.zeros((m, n))
        for i in range(m):
            for j in range(n):
                M[i, j] = bh1 * M[i, j] + (1 - bh1) * Gt[i, j]
                V[i, j] = bh2 * V[i, j] + (1 - bh2) * Gt[i, j] ** 2
                U[i, j] = M[i, j] / (math.sqrt(V[i, j]) + eps)
        W = W - lr * (P @ U @ Q.T + wd * W)
        out.append(W.copy())
    return out


def adafactor_family(W, grads, *, lr, betas, eps, wd, T, sides, momentum, d=1.0):
    """Algorithm AdafacDiag (sides=1), its two-sided form (sides=2) and Adafactor (sides=0)."""
    b1, b2 = betas
    m, n = W.shape
    M = np.zeros((m, n))
    r = np.zeros(m)
    s = np.zeros(n)
    P, Q = np.eye(m), np.eye(n)
    out = []
    for t, G in enumerate(grads, start=1):
        P, Q, Gt = _rotated_gradient(G, t, T, P, Q, sides)
        bh1, bh2 = beta_hat(b1, t), beta_hat(b2, t)
        for i in range(m):  # r_t = EMA[(G~^2 + eps) 1_n]
            r[i] = bh2 * r[i] + (1 - bh2) * sum(Gt[i, j] ** 2 + eps for j in range(n))
        for j in range(n):  # s_t = EMA[(G~^T)^2 + eps) 1_m]
            s[j] = bh2 * s[j] + (1 - bh2) * sum(Gt[i, j] ** 2 + eps for i in range(m))
        total = sum(r)
        N = np.zeros((m, n))
        for i in range(m):
            for j in range(n):
                N[i, j] = Gt[i, j] / math.sqrt(r[i] * s[j] / total)
        U = _clip(N, d)
        if momentum:
            M = bh1 * M + (1 - bh1) * U
            U = M
        W = W - lr * (P @ U @ Q.T + wd * W)
        out.append(W.copy())
    return out


def hfac_family(W, grads, *, lr, betas, eps, wd, T, sides, d=1.0):
    """Algorithm HfacDiag (sides=1) and Hfac (sides=0), read literally."""
    b1, b2 = betas
    m, n = W.shape
    u, v, r, s = np.zeros(m), np.zeros(n), np.zeros(m), np.zeros(n)
    P, Q = np.eye(m), np.eye(n)
    out = []
    for t, G in enumerate(grads, start=1):
        P, Q, Gt = _rotated_gradient(G, t, T, P, Q, sides)
        bh1, bh2 = beta_hat(b1, t), beta_hat(b2, t)
        row_mean = [sum(Gt[i, j] for j in range(n)) / n for i in range(m)]  # G~ 1_n / n
        col_mean = [sum(Gt[i, j] for i in range(m)) / m for j in range(n)]  # G~^T 1_m / m
        for i in range(m):
            u[i] = bh1 * u[i] + (1 - bh1) * row_mean[i]
            r[i] = bh2 * r[i] + (1 - bh2) * sum(Gt[i, j] ** 2 + eps for j in range(n))
        for j in range(n):
            v[j] = bh1 * v[j] + (1 - bh1) * col_mean[j]
            s[j] = bh2 * s[j] + (1 - bh2) * sum(Gt[i, j] ** 2 + eps for i in range(m))
        total = sum(r)
        N = np.zeros((m, n))
        U = np.zeros((m, n))
        for i in range(m):
            for j in range(n):
                N[i, j] = Gt[i, j] / math.sqrt(r[i] * s[j] / total)
        N = _clip(N, d)
        for i in range(m):
            for j in range(n):
                phi = bh1 * (u[i] - row_mean[i]) / math.sqrt(r[i] / n)
                psi = bh1 * (v[j] - col_mean[j]) / math.sqrt(s[j] / m)
                U[i, j] = 0.5 * (phi + psi) + N[i, j]
        W = W - lr * (P @ U @ Q.T + wd * W)
        out.append(W.copy())
    return out


def reference(name: str, W, grads, *, lr, betas, eps, wd, T, momentum=True):
    """Dispatch by the library's optimizer name."""
    kw = dict(lr=lr, betas=betas, eps=eps, wd=wd, T=T)
    table = {
        "adamw": lambda: adam_family(W, grads, sides=0, **kw),
        "adadiag": lambda: adam_family(W, grads, sides=1, **kw),
        "adadiag_pp": lambda: adam_family(W, grads, sides=2, **kw),
        "adafactor": lambda: adafactor_family(W, grads, sides=0, momentum=momentum, **kw),
        "adafacdiag": lambda: adafactor_family(W, grads, sides=1, momentum=momentum, **kw),
        "adafacdiag_pp": lambda: adafactor_family(W, grads, sides=2, momentum=momentum, **kw),
        "hfac": lambda: hfac_family(W, grads, sides=0, **kw),
        "hfacdiag": lambda: hfac_family(W, grads, sides=1, **kw),
    }
    return np.stack(table[name]())
