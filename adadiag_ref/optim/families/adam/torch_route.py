"""The Adam family's torch route: ``update_in_place`` on float32/float64 CPU torch tensors (the torch adapter).

The Adam kernels of :mod:`.numba_route` run on zero-copy NumPy views of the tensors, with ``sqrt(V_t)`` taken
by ``torch.sqrt`` (torch's CPU square root is not always correctly rounded, and the result must equal the
torch reference bit for bit): no parameter-sized array is allocated for an unrotated parameter, and each array
crosses memory about once (:func:`_adam_torch_cpu`).  Declines (``False``, nothing written) for every other
backend, device or layout; :mod:`.inplace` then runs the backend's own ufuncs.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import is_torch_namespace

from .... import _kernels
from ...._kernels import alike, flat
from ...._xp import Array
from ....config import BaseConfig
from ...layout import from_work
from ...rotation import unrotate
from ...schedules import beta_hats
from . import numba_route
from .numba_route import kernel_scalars
from .reference import AdamState

__all__ = ["in_place"]


def _host_views(*tensors: Any) -> list[Any] | None:
    """Zero-copy NumPy views of dense CPU torch tensors of one float32/float64 dtype (the same memory: writing a
    view writes the tensor), or ``None`` when any tensor cannot be viewed that way; ``None`` entries stay ``None``."""
    import numpy
    import torch

    views: list[Any] = []
    for x in tensors:
        if x is None:
            views.append(None)
            continue
        if (
            not isinstance(x, torch.Tensor)
            or x.device.type != "cpu"
            or x.layout != torch.strided
            or x.dtype not in (torch.float32, torch.float64)
            or x.is_neg()  # a lazily negated view has no NumPy form
            or x.is_conj()
        ):
            return None
        try:
            view = x.detach().numpy()
        except (RuntimeError, TypeError):  # subclasses without host storage (fake, meta-like wrappers)
            return None
        if type(view) is not numpy.ndarray:
            return None
        views.append(view)
    dtypes = {v.dtype for v in views if v is not None}
    return views if len(dtypes) == 1 else None


BLOCK = 1 << 14


def _adam_torch_cpu(
    state: AdamState,
    layout: Any,
    betas_t: tuple[Array, Array],
    g_rot: Array,
    w: Array,
    param: Array,
    cfg: BaseConfig,
    eta: Any,
    xp: Any,
) -> bool:
    """The Adam-family step of CPU torch tensors through the numba kernels, on zero-copy NumPy views.

    Returns ``False``, having written nothing, when the route does not apply (``cfg.kernels == "reference"``,
    numba missing, ``eta`` not a Python number, the parameter's dtype not the state dtype or the parameter
    not contiguous, tensors that are not plain dense CPU float32/float64 ones or not laid out alike); the
    caller then runs the backend ufuncs.

    Bit-identical to the reference on torch: the same formulas in the same order, the coefficients
    ``b_hat`` computed by torch as there, the same torch GEMMs, and ``sqrt(V_t)`` by ``torch.sqrt`` itself
    (torch's CPU square root is not always the correctly rounded one, so the kernels must not use their
    own); kernels compiled without fastmath.  The flat arrays are processed in blocks of :data:`BLOCK`
    entries: a kernel writes ``V_t`` of the block into scratch, ``torch.sqrt`` takes its root, a second
    kernel finishes the block, so each array crosses memory about once.

    * no rotation: ``M``, ``V`` and ``W <- W + (-eta) (U + lambda W)`` are written in place, block by block;
      nothing of the parameter's size is allocated (the embedding and LM head of a language model: fresh
      arrays of their size cost page faults of the order of the arithmetic).  Everything that can fail is
      checked before the first block; the blocks run only kernels and ``torch.sqrt`` into scratch.
    * with rotation: ``M_t``, ``V_t`` go into two new tensors and ``U~`` over ``G~`` (this call's own GEMM
      output), ``D = P U~ Q^T`` (torch GEMM, new), one pass ``W <- W + (-eta) (D + lambda W)``, then ``M``
      and ``V`` adopt the new tensors' storage (``Tensor.set_``): the state is written only after the GEMM.
    """
    if (
        cfg.kernels == "reference"
        or not _kernels.AVAILABLE
        or isinstance(eta, bool)
        or not isinstance(eta, int | float)
    ):
        return False
    M, V = state.M, state.V
    if param.dtype != M.dtype or not param.is_contiguous() or w.data_ptr() != param.data_ptr():
        return False  # W must be the parameter's own memory, in the state dtype, to be written in place
    rotated = state.P is not None or state.Q is not None
    views = _host_views(g_rot, w, M, V)
    if views is None:
        return False
    g_np, w_np, M_np, V_np = views
    if not alike(g_np, M_np, V_np, *(() if rotated else (w_np,))):
        return False
    # torch's own b_hat (as the reference computes them), read from host memory
    coefficients = _host_views(*betas_t)
    if coefficients is None:
        return False
    b1, c1, b2, c2, eps, neg_lr, wd, decay = kernel_scalars(coefficients[0], coefficients[1], cfg, eta, M_np.dtype)
    import torch

    size = M_np.size
    fg, fM, fV = flat(g_np), flat(M_np), flat(V_np)
    if not rotated:
        block = min(BLOCK, size)
        scratch = torch.empty((2, block), dtype=M.dtype)  # V_t and sqrt(V_t) of one block
        v_t, root_t = scratch[0], scratch[1]
        v_np, root_np = scratch.numpy()
        fw = flat(w_np)
        for start in range(0, size, block):
            stop = min(start + block, size)
            k = stop - start
            numba_route.adam_second_moment_flat(fV[start:stop], fg[start:stop], b2, c2, v_np[:k])
            torch.sqrt(v_t[:k], out=root_t[:k])
            numba_route.adam_apply_root_flat(fw[start:stop], fg[start:stop], fM[start:stop], fV[start:stop],
                                          v_np[:k], root_np[:k], b1, c1, eps, neg_lr, wd, decay)  # fmt: skip
        return True
    # rotated: three whole-array passes into the new moments (no blocks: G~ and the new M, V are this call's own
    # memory); sqrt(V_t) is parked in the new M's memory until M_t overwrites it.  The passes run on this thread,
    # never on numba's pool: they follow torch GEMMs and torch.sqrt, whose OpenMP threads keep spinning after a
    # parallel region, and a numba pool next to them was slower than one thread (LLaMA-60M, adapter / direct
    # torch in alternation: 1.15-1.28 with the pool, 0.80 without, two runs each)
    new_M, new_V = torch.empty_like(M), torch.empty_like(V)  # dense inputs: the same strides
    new_views = _host_views(new_M, new_V)
    if new_views is None or not alike(M_np, *new_views):  # pragma: no cover - empty_like keeps dense strides
        return False
    fnM, fnV = (flat(v) for v in new_views)
    numba_route.adam_second_moment_flat(fV, fg, b2, c2, fnV)
    torch.sqrt(torch.from_numpy(fnV), out=torch.from_numpy(fnM))
    numba_route.adam_direction_root_flat(fM, fg, fnM, b1, c1, eps)
    D = unrotate(g_rot, state.P, state.Q, xp, transposed=layout.transposed)  # U~ lives in G~'s buffer now
    D_views = _host_views(D)
    if D_views is not None and alike(D_views[0], w_np):
        _kernels.apply_direction_flat(flat(w_np), flat(D_views[0]), neg_lr, wd, decay)  # commit: nothing below fails
    else:  # pragma: no cover - torch GEMM outputs are dense in G~'s order; the reference expressions otherwise
        if decay:
            D = D + cfg.weight_decay * w
        param += from_work(D * -eta, layout, xp)
    M.set_(new_M)
    V.set_(new_V)
    return True


def in_place(state: AdamState, step_in: Any, cfg: BaseConfig, param: Array, eta: Any, xp: Any) -> bool:
    """``update_in_place``'s Adam step on CPU torch tensors (:func:`_adam_torch_cpu`); ``False`` when it does not
    apply (not torch, not CPU, ``kernels="reference"``, numba missing, another layout)."""
    if not is_torch_namespace(xp):
        return False
    betas_t = beta_hats(cfg, step_in.t, xp)
    return _adam_torch_cpu(state, step_in.layout, betas_t, step_in.g_rot, step_in.w, param, cfg, eta, xp)
