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
    # the conventions of real code (each subclass below plants one)
    eps_before_bias = False  # HF's correct_bias: lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)
    decay = "decoupled"  # "decoupled" (the spec's, of W_t), "after" (of the updated W), "coupled" (L2), "none"
    raw_update = False  # the raw EMAs m, v in the update (no bias correction)
    raw_state = False  # keep the raw EMAs in the state under M, V (the update is right)
    skip_first = False  # no update at step 1 (the state is built)
    other_side = False  # a square matrix rotated on its right side
    svd_dtype = None  # the basis from an SVD in this dtype (float32: a float32 SVD of a float64 gradient)
    refresh_structure = True  # the refresh-step structure of docs/spec.md section 5

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

    def _frame(self, p: torch.Tensor) -> tuple[bool, int, int]:
        a, b = (p.shape[0], math.prod(p.shape[1:])) if p.dim() >= 2 else (1, p.numel())
        return a > b or (self.other_side and a == b), min(a, b), max(a, b)

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
                if self.decay == "coupled":
                    G = G + group["weight_decay"] * (p.reshape(n, m).T if tall else p.reshape(m, n))
                W = p.reshape(n, m).T if tall else p.reshape(m, n)
                if t == 1:
                    state["M"], state["V"] = torch.zeros_like(G), torch.zeros_like(G)
                rotated = m <= group["max_basis_dim"]  # a side longer than max_basis_dim is not rotated
                refresh = rotated and (t == 1 or (T is not None and (t - 1) % T == 0))
                if refresh:
                    g = G.numpy() if self.svd_dtype is None else G.numpy().astype(self.svd_dtype)
                    P = torch.from_numpy(ar.canonical_svd(g, compute_q=False).P.astype(G.numpy().dtype)) * self.sign
                    state["P"] = P.T.clone() if self.store_transposed else P
                P = (state["P"].T if self.store_transposed else state["P"]) if rotated else torch.eye(m, dtype=G.dtype)
                Gt = P.T @ G
                if (
                    refresh and self.refresh_structure
                ):  # the refresh-step structure of docs/spec.md section 5: rows beyond the rank are zero
                    sizes = (Gt / Gt.abs().max().clamp_min(torch.finfo(G.dtype).tiny)).norm(dim=1)
                    rank = int((sizes > max(m, n) * torch.finfo(G.dtype).eps * sizes.max()).sum())
                    Gt[rank:] = 0
                h1, h2 = self._beta_hat(b1, t), self._beta_hat(b2, t)
                bc = group["bias_correction"]
                c1, c2 = (1 - b1**t, 1 - b2**t) if bc else (1.0, 1.0)  # raw EMA = corrected EMA * (1 - beta^t)
                key_m, key_v = ("Mc", "Vc") if self.raw_state else ("M", "V")  # the corrected EMAs' keys
                if t == 1:
                    state[key_m], state[key_v] = torch.zeros_like(G), torch.zeros_like(G)
                M = h1 * state[key_m] + (1 - h1) * Gt
                V = h2 * state[key_v] + (1 - h2) * Gt * Gt
                state[key_m], state[key_v] = M, V
                if self.eps_before_bias:
                    D = P @ ((M * c1) / ((V * c2).sqrt() + group["eps"])) * (math.sqrt(c2) / c1)
                elif self.raw_update:
                    D = P @ ((M * c1) / ((V * c2).sqrt() + group["eps"]))
                else:
                    D = P @ (M / (V.sqrt() + group["eps"]))
                if self.raw_state:
                    state["M"], state["V"] = M * c1, V * c2
                lr, wd = group["lr"], group["weight_decay"]
                if self.decay == "after":
                    W_new = (W - lr * D) * (1 - lr * wd)
                elif self.decay in ("coupled", "none"):
                    W_new = W - lr * D
                else:
                    W_new = W - lr * (D + wd * W)
                if self.skip_first and t == 1:
                    W_new = W
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


class EpsBeforeBiasAdaDiag(PortAdaDiag):
    """Convention: eps added before the bias correction (HF's correct_bias, GaLore)."""

    eps_before_bias = True


class DecayAfterUpdateAdaDiag(PortAdaDiag):
    """Convention: the decay of the updated W, (W_t - lr U)(1 - lr wd)."""

    decay = "after"


class CoupledL2AdaDiag(PortAdaDiag):
    """Convention: coupled L2 decay (wd W_t added to the gradient)."""

    decay = "coupled"


class MissingDecayAdaDiag(PortAdaDiag):
    """Bug: no weight decay term."""

    decay = "none"


class RawUpdateAdaDiag(PortAdaDiag):
    """Convention: the raw EMAs in the update (no bias correction); the state kept as the fixture's."""

    raw_update = True


class RawStateAdaDiag(PortAdaDiag):
    """Convention (state only): the raw EMAs kept under M, V; the parameters are right."""

    raw_state = True


class SkipFirstAdaDiag(PortAdaDiag):
    """Convention: no update at step 1 (the first step builds the state only)."""

    skip_first = True


class OtherSideAdaDiag(PortAdaDiag):
    """Convention: a square matrix rotated on its right side."""

    other_side = True


class Float32SvdAdaDiag(PortAdaDiag):
    """Bug: the basis from a float32 SVD of a float64 gradient."""

    svd_dtype = "float32"


class NoStructureAdaDiag(PortAdaDiag):
    """Bug: G~ used as computed on a refresh step (no structural zeros beyond the numerical rank)."""

    refresh_structure = False
