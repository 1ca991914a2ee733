"""In-place application of one update, for frameworks that own mutable buffers.

:func:`update_in_place` computes exactly what ``delta, new = update(state, G, cfg, W)``
followed by ``W += delta`` computes, bit for bit, but overwrites ``W`` and the
moment arrays of ``state`` instead of allocating new ones.  On a large parameter
the functional form allocates about ten temporaries of its size per step; the
in-place form of the Adam family allocates at most two.  It is how the torch
adapter applies updates.

The Adam-family arithmetic is the functional one reordered only where IEEE
arithmetic is exactly commutative (``b * M`` vs ``M * b``), so results are
identical; the tests compare with ``array_equal``.  On NumPy arrays, when the
config's ``kernels`` option selects numba (:mod:`adadiag_ref.optim.dispatch`),
the moments and ``U~`` come from the fused kernel that also serves the
functional Adam direction, in one pass.  On float32/float64 CPU torch tensors
(the torch adapter) the same config option sends the Adam family through numba
kernels on zero-copy NumPy views of the tensors, with ``sqrt(V_t)`` taken by
``torch.sqrt`` (torch's CPU square root is not always correctly rounded, and the
result must equal the torch reference bit for bit): no parameter-sized array is
allocated for an unrotated parameter, and each array crosses memory about once
(:func:`_adam_torch_cpu`).  The Adafactor and Hfac families use the
functional update (kernel or reference, as ``kernels`` says) and copy its
results into the buffers.

Only backends with mutable arrays qualify (NumPy, CuPy, PyTorch); JAX arrays are
immutable and get a ``TypeError``.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import is_cupy_namespace, is_numpy_namespace, is_torch_namespace

from .. import _kernels, buffers
from .._xp import Array, Namespace, namespace
from ..config import BaseConfig
from .core import prepare_step, unrotate, update
from .dispatch import uses_kernels
from .families import AdamState, State
from .fused import alike, flat, kernel_scalars
from .layout import from_work
from .schedules import beta_hat

__all__ = ["supports_in_place", "update_in_place"]


def _native(xp: Namespace) -> Any:
    """The backend module whose ufuncs take ``out=`` (numpy, cupy or torch)."""
    if is_numpy_namespace(xp):
        import numpy

        return numpy
    if is_cupy_namespace(xp):
        import cupy

        return cupy
    if is_torch_namespace(xp):
        import torch

        return torch
    raise TypeError(f"update_in_place needs mutable arrays (numpy, cupy, torch), not {xp.__name__}")


def supports_in_place(x: Array) -> bool:
    """Whether :func:`update_in_place` accepts arrays like ``x``."""
    xp = namespace(x)
    return bool(is_numpy_namespace(xp) or is_cupy_namespace(xp) or is_torch_namespace(xp))


def _check_writable(arrays: dict[str, Array | None]) -> None:
    """Refuse read-only buffers before anything is written (the call must be all or nothing)."""
    for label, a in arrays.items():
        if a is None:
            continue
        flags = getattr(a, "flags", None)
        if flags is not None and not flags.writeable:
            raise ValueError(f"update_in_place needs writable arrays; the {label} is read-only (nothing was changed)")
        if getattr(a, "requires_grad", False) and getattr(a, "is_leaf", False):
            import torch

            if torch.is_grad_enabled():
                raise ValueError(
                    f"update_in_place: the {label} is a leaf tensor that requires grad; "
                    "call it under torch.no_grad() (nothing was changed)"
                )


def _adam_moments_ufuncs(
    M: Array, V: Array, g_rot: Array, owned: bool, b1_t: Array, b2_t: Array, eps: float, native: Any
) -> tuple[Array, Array, Array]:
    """``(M_t, V_t, U~)`` of the Adam direction with backend ufuncs, at most two new arrays (``owned``: ``G~``
    may be overwritten).  The functional EMA is ``b * old + (1 - b) * new``; IEEE addition and multiplication
    commute exactly, so the results are the family function's bit for bit."""
    new_V = native.multiply(V, b2_t)
    buf = g_rot * g_rot  # G~^2, later the scratch for b1 * M, sqrt(V) and U~
    buf *= 1.0 - b2_t
    new_V += buf
    if owned:
        new_M = g_rot
        new_M *= 1.0 - b1_t
    else:
        new_M = native.multiply(g_rot, 1.0 - b1_t)
    native.multiply(M, b1_t, out=buf)
    new_M += buf
    native.sqrt(new_V, out=buf)
    buf += eps
    native.divide(new_M, buf, out=buf)  # U~ = M / (sqrt(V) + eps)
    return new_M, new_V, buf


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
"""Entries per block of the torch CPU route: ``V_t`` and ``sqrt(V_t)`` of one block (128 KiB in float64) stay in
the core's cache between the kernel passes and torch's ``sqrt``; and a block is below torch's parallel grain
(32768 entries), so ``torch.sqrt`` runs on the calling thread instead of waking its OpenMP team every block."""


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
            _kernels.adam_second_moment_flat(fV[start:stop], fg[start:stop], b2, c2, v_np[:k])
            torch.sqrt(v_t[:k], out=root_t[:k])
            _kernels.adam_apply_root_flat(fw[start:stop], fg[start:stop], fM[start:stop], fV[start:stop],
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
    _kernels.adam_second_moment_flat(fV, fg, b2, c2, fnV)
    torch.sqrt(torch.from_numpy(fnV), out=torch.from_numpy(fnM))
    _kernels.adam_direction_root_flat(fM, fg, fnM, b1, c1, eps)
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


def update_in_place(
    state: State,
    grad: Array,
    cfg: BaseConfig,
    param: Array,
    *,
    lr: Any = None,
    refreshed: Any = False,
    xp: Namespace | None = None,
) -> State:
    """``W <- W + delta`` and the moments overwritten, as :func:`~adadiag_ref.optim.update` defines them.

    Returns the new state: the same moment arrays (now updated), the same bases
    and ``count + 1``.  ``grad`` is never modified.  Like ``update`` it never
    refreshes the basis and does not validate finiteness (see ``check_inputs``):
    NaN or Inf in ``G`` propagate into the moments and ``W`` as in Adam.

    All or nothing: everything that can fail (shapes, writability, GEMMs,
    allocations) runs before the first write to ``W``, ``M`` and ``V``; a call
    that raises leaves the parameter and the state bit-identical.  Every route
    but one computes the new values into scratch buffers and writes them at the
    end; the CPU torch route of an unrotated parameter (:func:`_adam_torch_cpu`)
    writes ``W``, ``M`` and ``V`` in place block by block, running only numba
    kernels and ``torch.sqrt`` into a preallocated block between its writes.
    On PyTorch the Adam family's ``M`` and ``V`` otherwise take over their scratch
    tensors' storage (``Tensor.set_``) instead of copying it: the same tensor
    objects, the same values, one pass over memory less each (views taken of
    them earlier keep the old values; on the in-place CPU route they see the new ones,
    as with ``torch.optim.AdamW``).
    """
    xp = namespace(grad, param, xp=xp)
    native = _native(xp)
    fields = {f"state field {k!r}": v for k, v in zip(state._fields[1:], state[1:])}
    _check_writable({"parameter": param, **fields})
    if not isinstance(state, AdamState):
        delta, new = update(state, grad, cfg, param, lr=lr, refreshed=refreshed, xp=xp)
        param += delta
        for old, fresh in zip(state[1:], new[1:]):
            if old is not None and old is not fresh:
                old[...] = fresh
        return state._replace(count=new.count)

    layout, t, g, w, g_rot = prepare_step(state, grad, cfg, param, refreshed, xp)
    owned = g_rot is not g  # a fresh GEMM output may serve as scratch space

    b1_t = beta_hat(cfg.betas[0], t, xp, bias_correction=cfg.bias_correction)
    b2_t = beta_hat(cfg.betas[1], t, xp, bias_correction=cfg.bias_correction)
    if is_torch_namespace(xp) and _adam_torch_cpu(
        state, layout, (b1_t, b2_t), g_rot, w, param, cfg, cfg.lr if lr is None else lr, xp
    ):
        return state._replace(count=state.count + 1)
    M, V = state.M, state.V
    if uses_kernels(cfg, xp, g_rot, M, V):  # one fused pass: the kernel of the functional Adam direction
        # NumPy arrays (the kernels' condition); scratch for this call only, from the output pool: resident pages
        # instead of fresh ones on every step (adadiag_ref.buffers)
        buf = buffers.empty_like(M)
        new_M = g_rot if owned else buffers.empty_like(M)  # the kernel reads each G~_ij before writing M_ij
        new_V = buffers.empty_like(V)
        rows = _kernels.rows_in_memory_order(M, V, g_rot, new_M, new_V, buf)  # a tall parameter's F-order frame
        _kernels.adam_moments_inplace(*rows[:3], *_kernels.adam_coefficients(b1_t, b2_t, M.dtype),
                                      _kernels.scalar(cfg.eps, M.dtype), *rows[3:])  # fmt: skip
    else:
        new_M, new_V, buf = _adam_moments_ufuncs(M, V, g_rot, owned, b1_t, b2_t, cfg.eps, native)
    direction = unrotate(buf, state.P, state.Q, xp, transposed=layout.transposed)
    if cfg.weight_decay:
        direction += cfg.weight_decay * w
    eta = cfg.lr if lr is None else lr
    direction *= -eta
    delta = xp.astype(from_work(direction, layout, xp), param.dtype, copy=False)
    # commit: nothing below can fail on writable buffers of matching shape and dtype
    param += delta
    if is_torch_namespace(xp):  # the tensors M and V adopt the scratch storage: O(1), no copy pass, same objects
        M.set_(new_M)
        V.set_(new_V)
    else:
        M[...] = new_M
        V[...] = new_V
    return state._replace(count=state.count + 1)
