"""A small torch.optim AdaDiag written from docs/golden.md, and single-bug versions of it, for the conformance runner.

``PortAdaDiag`` is AdaDiag (Algorithm 1) as a porter writes it: its own moments, refresh schedule, refresh-step
structure and tall/conv work frame in torch, the canonical basis from :func:`adadiag_ref.canonical_svd` (as in the
walkthrough).
It keeps ``state["step"]``, ``state["P"]``, ``state["M"]``, ``state["V"]`` in the work frame, the names the runner
compares.  Each subclass plants one bug.
"""

from __future__ import annotations

import math

import torch

import adadiag_ref as ar


class PortAdaDiag(torch.optim.Optimizer):
    """W <- W - lr (P (M / (sqrt(V) + eps)) + wd W), M, V beta-hat EMAs of G~ = P^T G, P refreshed at t = 1 + kT."""

    sign = 1.0  # the sign rule: +1 is docs/spec.md's
    bias_offset = 0  # the step whose beta-hat is used, relative to t
    store_transposed = False  # keep P^T in the state (and read it back transposed)

    def __init__(  # type: ignore[no-untyped-def]
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        update_freq=200,
        bias_correction=True,
        max_basis_dim=8192,
        **_,
    ):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "T": update_freq}
        super().__init__(params, {**defaults, "bias_correction": bias_correction, "max_basis_dim": max_basis_dim})

    @staticmethod
    def _frame(p: torch.Tensor) -> tuple[bool, int, int]:
        a, b = (p.shape[0], math.prod(p.shape[1:])) if p.dim() >= 2 else (1, p.numel())
        return a > b, min(a, b), max(a, b)

    def _beta_hat(self, beta: float, t: int) -> float:
        s = t + self.bias_offset
        if not self.defaults["bias_correction"]:  # the raw betas
            return beta
        return 0.0 if beta == 0 else beta * (1 - beta ** (s - 1)) / (1 - beta**s)

    def check(self, p: torch.Tensor, t: int) -> None:
        """A hook for a planted failure (none here)."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            (b1, b2), T = group["betas"], group["T"]
            for p in group["params"]:
                tall, m, n = self._frame(p)
                state = self.state[p]
                t = int(state.get("step", 0)) + 1
                self.check(p, t)
                G = p.grad.reshape(n, m).T if tall else p.grad.reshape(m, n)
                W = p.reshape(n, m).T if tall else p.reshape(m, n)
                if t == 1:
                    state["M"], state["V"] = torch.zeros_like(G), torch.zeros_like(G)
                rotated = m <= group["max_basis_dim"]  # a side longer than max_basis_dim is not rotated
                refresh = rotated and (t == 1 or (T is not None and (t - 1) % T == 0))
                if refresh:
                    P = torch.from_numpy(ar.canonical_svd(G.numpy(), compute_q=False).P.copy()) * self.sign
                    state["P"] = P.T.clone() if self.store_transposed else P
                P = (state["P"].T if self.store_transposed else state["P"]) if rotated else torch.eye(m, dtype=G.dtype)
                Gt = P.T @ G
                if refresh:  # the refresh-step structure of docs/spec.md section 5: rows beyond the rank are zero
                    sizes = (Gt / Gt.abs().max().clamp_min(torch.finfo(G.dtype).tiny)).norm(dim=1)
                    rank = int((sizes > max(m, n) * torch.finfo(G.dtype).eps * sizes.max()).sum())
                    Gt[rank:] = 0
                h1, h2 = self._beta_hat(b1, t), self._beta_hat(b2, t)
                state["M"] = h1 * state["M"] + (1 - h1) * Gt
                state["V"] = h2 * state["V"] + (1 - h2) * Gt * Gt
                D = P @ (state["M"] / (state["V"].sqrt() + group["eps"]))
                W_new = W - group["lr"] * (D + group["weight_decay"] * W)
                p.copy_((W_new.T if tall else W_new).reshape(p.shape))
                state["step"] = torch.tensor(t)


class FlippedSignAdaDiag(PortAdaDiag):
    """Bug: every column of P takes the other sign (the sign rule reversed)."""

    sign = -1.0


class OffByOneBiasAdaDiag(PortAdaDiag):
    """Bug: the bias correction of step t + 1 at step t."""

    bias_offset = 1


class RaisesAtStep3AdaDiag(PortAdaDiag):
    """Bug: a conv kernel (4-D parameter) raises at step 3; every other shape is right."""

    def check(self, p: torch.Tensor, t: int) -> None:
        if p.dim() > 2 and t == 3:
            raise RuntimeError("planted failure at step 3")


class TransposedPAdaDiag(PortAdaDiag):
    """Bug (in the state only): P is kept as P^T; the parameters are right."""

    store_transposed = True
