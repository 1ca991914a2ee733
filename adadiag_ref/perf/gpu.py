"""``adadiag-ref bench --gpu``: the GPU path on the current CUDA device, against its peers and bounds.

Everything is measured in one process, float32, over a LLaMA parameter set (``--model``, default
LLaMA-60M; ``--quick``: the tiny :data:`~adadiag_ref.perf.params.QUICK` model).  Parameter rule
``paper`` (the default, as in the CPU bench): the optimizer under test rotates the transformer blocks'
matrices; embedding, LM head and norms take the unrotated AdamW update.  ``all`` rotates every matrix.

Non-refresh step (every row: one optimizer step of the whole parameter set, after a warm-up that includes the
``t = 1`` refresh; the median over ``reps`` timings, each the wall time of ``inner`` consecutive steps between
two device synchronisations, divided by ``inner``):

* ``cupy_<name>`` for ``adamw``, ``adadiag``, ``adadiag_pp``, ``adafacdiag``, ``hfacdiag``: the core on CuPy
  arrays through the engine, ``engine.step(grads, params, check=False)`` (:class:`adadiag_ref.Engine`: one
  engine for the rotated parameters, one for the AdamW ones; its host step counter, so a step reads nothing
  back from the device; the parameters updated in place);
* ``torch_fused_adamw``: ``torch.optim.AdamW(fused=True)`` on CUDA;
* ``torch_direct_adadiag``: AdaDiag written directly in torch ops (:func:`torch_direct_adadiag`:
  ``G~ = P^T G``, Adam moments, ``U~ = M / (sqrt(V) + eps)``, ``W -= lr P U~``; ``P`` fixed);
* ``torch_adapter_<name>`` for ``adamw``, ``adadiag``, ``adadiag_pp``: the torch adapter's ``opt.step()`` on CUDA
  (its groups' engines: with CuPy installed, the CUDA group kernels); ``torch_adapter_<name>_no_cupy``: the same
  with ``kernels="reference"``, the route it takes where CuPy is not installed (the engine's gathering path);
* ``torch_engine_adamw``: AdamW through :class:`adadiag_ref.Engine` over the torch CUDA parameters
  (``engine.step(grads, params, check=False)``: with CuPy installed, the CUDA group kernels launched on torch's
  stream, :class:`~adadiag_ref.optim.families.adam.cupy_group.TorchCudaLauncher`), the engine the adapter
  steps its groups through on CUDA, without the adapter around it;
* ``optax_adamw``: ``optax.adamw`` jitted on the JAX GPU device; ``optax_adapter_adamw`` /
  ``optax_adapter_adadiag``: the optax adapter's ``adamw`` / ``adadiag`` (the latter through
  ``optax.transforms.partition`` with the adapter's ``adamw`` for the unrotated parameters), jitted.

Bounds, measured in the same run:

* ``bandwidth``: the device bandwidth, the best of a device-to-device ``memcpy`` and a ``cupy.copyto`` kernel
  over a large float32 array (``2 x nbytes`` moved per copy);
* ``bandwidth`` bound: the bytes an AdamW step must move (``W, G, M, V`` read, ``W, M, V`` written: ``7 x 4``
  bytes per element) at that bandwidth;
* ``gemm_1`` / ``gemm_2``: the time of the step's GEMMs alone on preallocated operands, per rotated matrix in
  its work frame ``m x n``: one-sided ``P^T G`` and ``P U~`` (``4 m^2 n`` flops), two-sided also ``G~ Q`` and
  ``U~ Q^T`` (AdaDiag++);
* ``gemm_1+bandwidth`` / ``gemm_2+bandwidth``: the bound of the rotated optimizers' steps.

Refresh of the rotated matrices (gradients with ``sigma_i = 1/i``,
:func:`~adadiag_ref.perf.params.gradient_with_spectrum`; a median over ``reps``): ``cupy_refresh_<method>``,
``ar.refresh_basis`` one matrix at a time with ``basis_method`` ``svd``/``gram``/``auto``;
``cupy_refresh_batched_<method>``, ``ar.refresh_bases`` over all of them (one stacked decomposition per work
shape, as the engine refreshes); ``torch_adapter_refresh_step``, the
adapter's first ``opt.step()`` (a refresh and a step); ``torch_svd``, ``torch.linalg.svd`` one matrix at a
time; ``cupy_eigh_float32``/``float64`` and ``torch_eigh_float32``/``float64``, the bare ``eigh`` of the stack
of Gram matrices ``G G^T`` (one batched call per distinct ``m``).  Each row's ``share`` is its time amortised
over ``T = --period`` steps against the CuPy AdaDiag step: ``t_refresh / (T t_step)``.

JSON (``--json PATH``), all times in milliseconds::

    {"device": {"name", "cupy", "cuda_runtime", "torch", "jax"},
     "setup": {"model", "quick", "rule", "parameters", "elements", "rotated", "reps", "inner", "period"},
     "bandwidth_gbs": float,
     "bounds_ms": {"bandwidth", "gemm_1", "gemm_2", "gemm_1+bandwidth", "gemm_2+bandwidth"},
     "step": {key: {"label", "ms", "na", "bound", "ratio_to_bound", "peer", "ratio_to_peer"}},
     "refresh": {key: {"label", "ms", "na", "share"}}}

``ms`` is ``null`` and ``na`` a reason (``"torch without CUDA"``, an exception's text) where a row could not
be measured; ``bound``/``peer`` name a key of ``bounds_ms``/``step`` (or are ``null``), and the ratios are
``ms`` divided by theirs.  CuPy with a CUDA device is required (:func:`missing_requirement`); torch and JAX
are optional.  JAX preallocates 75 % of the device when its backend starts (unless
``XLA_PYTHON_CLIENT_PREALLOCATE=false``): its backend is started first, so that CuPy and torch work in the
rest (LLaMA-60M's rows need a few GB).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm import tqdm

from .._cli import bar_disable
from ..memory import LLAMA_CONFIGS, ParamSpec, llama_parameters
from .params import (
    BETAS,
    EPS,
    LR,
    QUICK,
    gradient_with_spectrum,
    is_rotated,
    torch_direct_adadiag,
    torch_params,
    work_shape,
)

__all__ = [
    "CORE_OPTIMIZERS",
    "copy_bandwidth",
    "device_times",
    "missing_requirement",
    "run",
    "torch_direct_adadiag",
]

CORE_OPTIMIZERS = ("adamw", "adadiag", "adadiag_pp", "adafacdiag", "hfacdiag")
"""The optimizers whose CuPy step is measured."""
ADAPTER_OPTIMIZERS = ("adamw", "adadiag", "adadiag_pp")
REFRESH_METHODS = ("svd", "gram", "auto")


def missing_requirement() -> str | None:
    """Why ``bench --gpu`` cannot run here, as the message of a one-line error, or ``None``.

    Needs CuPy importable and at least one CUDA device it can use; nothing else is touched (no array is
    allocated)."""
    install = 'pip install "adadiag-ref[cuda]" (CUDA 12) or "adadiag-ref[cuda13]" (CUDA 13)'
    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        return f"bench --gpu needs CuPy and a CUDA device; CuPy is not installed: {install}"
    except Exception as exc:  # a broken install (missing CUDA libraries) fails at import
        return f"bench --gpu needs CuPy and a CUDA device; CuPy failed to import ({exc}): {install}"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, or no device: CUDARuntimeError
        return f"bench --gpu needs a CUDA device; CuPy found none ({exc})"
    if count < 1:
        return "bench --gpu needs a CUDA device; CuPy found none"
    return None


def device_times(
    fn: Callable[[], Any],
    sync: Callable[[], Any],
    reps: int,
    inner: int = 1,
    warmup: int = 2,
    budget_s: float | None = None,
) -> list[float]:
    """Seconds per call of ``fn`` on an asynchronous device: ``reps`` timings of ``inner`` calls each.

    ``warmup`` untimed calls first; each timing is the wall time from a ``sync()`` (the device idle) through
    ``inner`` calls to the ``sync()`` that waits for their work, divided by ``inner``, so the host's launch
    overhead and the device's work both count, as in a training loop.  With ``budget_s``, the timings stop
    early once they have taken that long together (at least one is taken): a row whose one call takes seconds
    (CuPy's ``gesvd`` of 56 matrices: 25 s on an H100) then fits a device session."""
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / inner)
        if budget_s is not None and inner * sum(times) >= budget_s:
            break
    return times


def _median_ms(*args: Any, **kwargs: Any) -> float:
    """Milliseconds: the median of :func:`device_times` (same arguments)."""
    return 1e3 * statistics.median(device_times(*args, **kwargs))


#: Seconds of timing after the warm-up a refresh row may take before it stops repeating (:func:`device_times`).
REFRESH_BUDGET_S = 5.0


def copy_bandwidth(cp: Any, n: int, reps: int) -> float:
    """Bytes/s of the better of two device copies of ``n`` float32 entries (``2 x 4n`` bytes moved per copy):
    a device-to-device ``memcpy`` and ``cupy.copyto`` (an elementwise kernel, as an optimizer's passes are)."""
    a = cp.ones(n, dtype=cp.float32)
    b = cp.empty_like(a)
    sync = cp.cuda.Device().synchronize
    memcpy = statistics.median(device_times(lambda: b.data.copy_from_device(a.data, a.nbytes), sync, reps, 5))
    kernel = statistics.median(device_times(lambda: cp.copyto(b, a), sync, reps, 5))
    return 2.0 * 4 * n / min(memcpy, kernel)


# ----------------------------------------------------------------------------- CuPy core


class _CupySteps:
    """The core stepping ``specs`` on CuPy arrays through the engine (:class:`adadiag_ref.Engine`): one engine for
    the parameters rotated under ``name``, one for the others under ``adamw``; a call is one ``engine.step`` of
    each, ``check=False`` (the engine's host counter: a step without refresh reads nothing back from the device),
    the parameters updated in place.  ``cp`` is the array module (CuPy; a test passes a NumPy stand-in)."""

    def __init__(self, cp: Any, name: str, specs: list[ParamSpec], rule: str, seed: int = 1) -> None:
        import adadiag_ref as ar

        cfg = ar.make_config(name, update_freq=None)
        base = ar.make_config("adamw", update_freq=None)
        rs = cp.random.RandomState(seed)
        split: dict[int, tuple[Any, list[ParamSpec]]] = {0: (cfg, []), 1: (base, [])}
        for s in specs:
            split[0 if (name != "adamw" and is_rotated(s, rule)) else 1][1].append(s)
        self.groups: list[tuple[Any, list[Any], list[Any]]] = []
        for c, group in split.values():
            if not group:
                continue
            params = [rs.standard_normal(s.shape, dtype=cp.float32) for s in group]
            grads = [rs.standard_normal(s.shape, dtype=cp.float32) for s in group]
            self.groups.append((ar.Engine(params, c), params, grads))
        # the first call is t = 1, the refresh; the later ones are not refreshes

    def __call__(self) -> None:
        for engine, params, grads in self.groups:
            engine.step(grads, params, check=False)


def _gemm_ms(cp: Any, shapes: list[tuple[int, int]], sides: int, reps: int) -> float:
    """The step's GEMMs alone over the rotated matrices (work frames ``shapes``), preallocated operands."""
    rs = cp.random.RandomState(2)
    ops = {}
    for m, n in set(shapes):
        P = rs.standard_normal((m, m), dtype=cp.float32)
        Q = rs.standard_normal((n, n), dtype=cp.float32) if sides == 2 else None
        ops[(m, n)] = (P, Q, rs.standard_normal((m, n), dtype=cp.float32), cp.empty((m, n), cp.float32),
                       cp.empty((m, n), cp.float32))  # fmt: skip

    def gemms() -> None:
        for shape in shapes:
            P, Q, G, Gt, D = ops[shape]
            cp.matmul(P.T, G, out=Gt)
            if Q is not None:
                cp.matmul(Gt, Q, out=D)  # G~ = P^T G Q (D as scratch)
                cp.matmul(P, D, out=Gt)  # P U~
                cp.matmul(Gt, Q.T, out=D)  # P U~ Q^T
            else:
                cp.matmul(P, Gt, out=D)

    return _median_ms(gemms, cp.cuda.Device().synchronize, reps, inner=3)


# ----------------------------------------------------------------------------- torch


class _TorchEngineSteps:
    """AdamW through :class:`adadiag_ref.Engine` over torch parameters on ``device``; a call is one
    ``engine.step(grads, params, check=False)`` (the host counter: nothing read back), in place."""

    def __init__(self, specs: list[ParamSpec], device: Any) -> None:
        import adadiag_ref as ar

        self.params = torch_params(specs, device)
        self.grads = [p.grad for p in self.params]
        self.engine = ar.Engine(self.params, ar.make_config("adamw", lr=LR, update_freq=None))

    def __call__(self) -> None:
        self.engine.step(self.grads, self.params, check=False)


def _torch_adapter_step(
    torch: Any, name: str, specs: list[ParamSpec], rule: str, device: Any = "cuda", **options: Any
) -> Callable[[], None]:
    """The torch adapter's ``opt.step()`` on ``device``: ``name`` for the rotated parameters, AdamW for the rest
    (``options``: more hyperparameters of both, e.g. ``kernels="reference"``)."""
    from adadiag_ref.adapters import pytorch

    params = torch_params(specs, torch.device(device))
    rotated = [p for p, s in zip(params, specs, strict=True) if name != "adamw" and is_rotated(s, rule)]
    ids = {id(p) for p in rotated}
    others = [p for p in params if id(p) not in ids]
    opts = [pytorch.OPTIMIZER_CLASSES[name](rotated, lr=LR, update_freq=None, **options)] if rotated else []
    if others:
        opts.append(pytorch.OPTIMIZER_CLASSES["adamw"](others, lr=LR, update_freq=None, **options))

    def step() -> None:
        for opt in opts:
            opt.step()

    return step


# ----------------------------------------------------------------------------- JAX / optax


def _jax_gpu() -> tuple[Any, Any]:
    """``(jax, device)`` for the first JAX GPU device; raises ``RuntimeError`` naming what is missing."""
    try:
        jax = importlib.import_module("jax")
        importlib.import_module("optax")
    except ImportError as exc:
        raise RuntimeError(f"{exc.name} not installed") from None
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        raise RuntimeError("JAX without a GPU backend (install jax[cuda12] or jax[cuda13])") from None
    if not devices:
        raise RuntimeError("JAX sees no GPU")
    return jax, devices[0]


def _optax_step(jax: Any, device: Any, kind: str, specs: list[ParamSpec], rule: str) -> tuple[Callable, Callable]:
    """``(step, sync)``: one jitted optimizer step of ``kind`` (``optax_adamw``, ``optax_adapter_adamw``,
    ``optax_adapter_adadiag``) over the parameter set on ``device``."""
    import jax.numpy as jnp
    import optax

    with jax.default_device(device):
        key = jax.random.key(5)
        params, grads = {}, {}
        for i, s in enumerate(specs):
            k1, k2 = jax.random.split(jax.random.fold_in(key, i))
            params[s.name] = jax.random.normal(k1, s.shape, dtype=jnp.float32)
            grads[s.name] = jax.random.normal(k2, s.shape, dtype=jnp.float32)
        if kind == "optax_adamw":
            opt = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=0.0)
        else:
            from adadiag_ref.adapters import optax as ox

            if kind == "optax_adapter_adamw":
                opt = ox.ALIASES["adamw"](LR, update_freq=None)
            else:
                labels = {s.name: "rotated" if is_rotated(s, rule) else "base" for s in specs}
                parts = {"rotated": ox.ALIASES["adadiag"](LR, update_freq=None),
                         "base": ox.ALIASES["adamw"](LR, update_freq=None)}  # fmt: skip
                transforms = getattr(optax, "transforms", None)  # optax.transforms.partition: the newer name
                partition = getattr(transforms, "partition", None) or optax.multi_transform
                opt = partition(parts, labels)
        state = opt.init(params)

    @jax.jit
    def update(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    holder = [params, state]

    def step() -> None:
        holder[0], holder[1] = update(holder[0], holder[1], grads)

    return step, lambda: jax.block_until_ready(holder)


# ----------------------------------------------------------------------------- refresh


def _refresh_rows(cp: Any, torch: Any, specs: list[ParamSpec], reps: int) -> dict[str, tuple[str, Callable[[], float]]]:
    """``{key: (label, measure)}`` for the refresh table; ``measure()`` returns milliseconds."""
    import adadiag_ref as ar

    rng = np.random.default_rng(5)
    host = [gradient_with_spectrum(s.shape, "decaying", rng) for s in specs]
    sync = cp.cuda.Device().synchronize
    rows: dict[str, tuple[str, Callable[[], float]]] = {}

    def cupy_refresh(method: str, batched: bool) -> float:
        cfg = ar.make_config("adadiag", basis_method=method)
        grads = [cp.asarray(h) for h in host]
        states = [ar.init(g, cfg) for g in grads]
        if batched:  # as the engine refreshes: one stacked decomposition per work shape
            return _median_ms(lambda: ar.refresh_bases(states, grads, cfg, count=0), sync, reps, 1, 1, REFRESH_BUDGET_S)
        pairs = list(zip(states, grads, strict=True))
        refresh_each = lambda: [ar.refresh_basis(st, g, cfg, count=0) for st, g in pairs]  # noqa: E731
        return _median_ms(refresh_each, sync, reps, 1, 1, REFRESH_BUDGET_S)

    for method in REFRESH_METHODS:
        rows[f"cupy_refresh_{method}"] = (f"CuPy ar.refresh_basis one by one, basis_method={method}",
                                          lambda method=method: cupy_refresh(method, False))  # type: ignore[misc]  # fmt: skip
        rows[f"cupy_refresh_batched_{method}"] = (f"CuPy ar.refresh_bases (batched), basis_method={method}",
                                                  lambda method=method: cupy_refresh(method, True))  # type: ignore[misc]  # fmt: skip

    def work_frames(xp_asarray: Callable[[np.ndarray], Any]) -> list[Any]:
        return [xp_asarray(np.ascontiguousarray(h if h.shape[0] <= h.shape[1] else h.T)) for h in host]

    def grams(xp: Any, frames: list[Any], cast: Callable[[Any], Any]) -> list[Any]:
        """The Gram matrices ``G G^T`` of the work frames, in the precision of ``cast``, stacked per ``m``."""
        by_m: dict[int, list[Any]] = {}
        for g in frames:
            g = cast(g)
            by_m.setdefault(int(g.shape[0]), []).append(g @ g.T)
        return [xp.stack(v) for v in by_m.values()]

    def cupy_eigh(dtype: Any) -> float:
        stacks = grams(cp, work_frames(cp.asarray), lambda g: g.astype(dtype))
        return _median_ms(lambda: [cp.linalg.eigh(a) for a in stacks], sync, reps, warmup=1)

    rows["cupy_eigh_float32"] = ("cupy.linalg.eigh of the Gram stack, float32", lambda: cupy_eigh(cp.float32))
    rows["cupy_eigh_float64"] = ("cupy.linalg.eigh of the Gram stack, float64", lambda: cupy_eigh(cp.float64))
    if torch is not None:
        dev = torch.device("cuda")

        def to_torch(h: np.ndarray) -> Any:
            return torch.from_numpy(h).to(dev)

        def torch_svd() -> float:
            frames = work_frames(to_torch)
            return _median_ms(lambda: [torch.linalg.svd(g, full_matrices=False) for g in frames],
                              torch.cuda.synchronize, reps, 1, 1, REFRESH_BUDGET_S)  # fmt: skip

        def torch_eigh(dtype: Any) -> float:
            stacks = grams(torch, work_frames(to_torch), lambda g: g.to(dtype))
            return _median_ms(lambda: [torch.linalg.eigh(a) for a in stacks], torch.cuda.synchronize, reps, warmup=1)

        def adapter_refresh() -> float:
            from adadiag_ref.adapters import pytorch

            times = []
            for _ in range(reps + 1):  # the first is a warm-up (cuSOLVER handles, the adapter's first use)
                params = []
                for h in host:
                    p = torch.nn.Parameter(torch.zeros(h.shape, device=dev))
                    p.grad = to_torch(h)
                    params.append(p)
                opt = pytorch.OPTIMIZER_CLASSES["adadiag"](params, lr=LR, update_freq=None)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                opt.step()  # t = 1: the refresh of every matrix, then the step
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            return 1e3 * statistics.median(times[1:])

        rows["torch_adapter_refresh_step"] = ("torch adapter AdaDiag, first opt.step() (refresh + step)",
                                              adapter_refresh)  # fmt: skip
        rows["torch_svd"] = ("torch.linalg.svd, one matrix at a time", torch_svd)
        rows["torch_eigh_float32"] = ("torch.linalg.eigh of the Gram stack, float32",
                                      lambda: torch_eigh(torch.float32))  # fmt: skip
        rows["torch_eigh_float64"] = ("torch.linalg.eigh of the Gram stack, float64",
                                      lambda: torch_eigh(torch.float64))  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- driver


def _row(key: str, label: str, measure: Callable[[], float], bar: Any) -> dict[str, Any]:
    """One measured row: ``ms``, or ``na`` with the reason when the measurement raised."""
    bar.set_postfix_str(key)
    try:
        ms, na = float(measure()), None
    except Exception as exc:  # a peer library missing a feature on this machine: the row says so
        ms, na = None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    bar.update()
    return {"label": label, "ms": ms, "na": na}


def _na(label: str, reason: str) -> dict[str, Any]:
    return {"label": label, "ms": None, "na": reason}


def _rows(labels: dict[str, str], measure: Callable[[str], float], missing: str | None, bar: Any) -> dict[str, Any]:
    """``{key: row}`` for every ``key: label``: measured by ``measure(key)`` (:func:`_row`), or all ``n/a`` with
    the reason ``missing`` when their library or its GPU is absent."""
    rows = {}
    for key, label in labels.items():
        if missing is None:
            rows[key] = _row(key, label, functools.partial(measure, key), bar)
        else:
            rows[key] = _na(label, missing)
            bar.update()
    return rows


def _versions(cp: Any, torch: Any) -> dict[str, Any]:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    jax = sys.modules.get("jax")
    return {"name": name, "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "torch": getattr(torch, "__version__", None), "jax": getattr(jax, "__version__", None)}  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(
    model: str = "llama-60m",
    *,
    quick: bool = False,
    reps: int = 5,
    period: int = 200,
    rule: str = "paper",
    use_torch: bool = True,
    refresh: bool = True,
    json_path: str | None = None,
    progress: bool | None = None,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure the tables of the module docstring on the current CUDA device, print them, write ``json_path``.

    Requires CuPy with a CUDA device (:func:`missing_requirement`, which the CLI checks first); rows of torch
    and JAX say ``n/a (reason)`` where those are missing or have no GPU.  Returns the JSON document."""
    import cupy as cp

    reason = missing_requirement()
    if reason:
        raise RuntimeError(reason)
    jax: Any = None
    jax_device: Any = None
    jax_reason = ""
    try:  # first, so that its preallocation (75 % of the device by default) leaves CuPy and torch the rest
        jax, jax_device = _jax_gpu()
    except RuntimeError as exc:
        jax_reason = str(exc)
    torch: Any = None
    torch_reason = "--no-torch"
    if use_torch:
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            torch_reason = "torch not installed"
        else:
            if not torch.cuda.is_available():
                torch, torch_reason = None, "torch without CUDA"
    config = QUICK if quick else LLAMA_CONFIGS[model]
    specs = llama_parameters(config)
    rotated = [s for s in specs if is_rotated(s, rule)]
    shapes = [work_shape(s.shape) for s in rotated]
    size = sum(math.prod(s.shape) for s in specs)
    inner = 3 if quick else 10
    sync = cp.cuda.Device().synchronize
    res: dict[str, Any] = {
        "device": _versions(cp, torch),
        "setup": {"model": "quick" if quick else model, "quick": quick, "rule": rule, "parameters": len(specs),
                  "elements": size, "rotated": len(rotated), "reps": reps, "inner": inner, "period": period},
    }  # fmt: skip
    n_rows = (
        3
        + len(CORE_OPTIMIZERS)
        + 3
        + 2 * len(ADAPTER_OPTIMIZERS)
        + 3
        + (2 * len(REFRESH_METHODS) + 6 if refresh else 0)
    )
    bar = tqdm(total=n_rows, desc="bench --gpu", file=sys.stderr, leave=False, disable=bar_disable(progress))
    with bar:
        bw = copy_bandwidth(cp, (1 << 24) if quick else (1 << 28), reps)  # 64 MiB / 1 GiB: beyond the L2 cache
        bar.update()
        res["bandwidth_gbs"] = bw / 1e9
        bounds = {"bandwidth": 1e3 * 7 * 4 * size / bw}
        for sides in (1, 2):
            bar.set_postfix_str(f"gemm_{sides}")
            bounds[f"gemm_{sides}"] = _gemm_ms(cp, shapes, sides, reps) if shapes else 0.0
            bounds[f"gemm_{sides}+bandwidth"] = bounds[f"gemm_{sides}"] + bounds["bandwidth"]
            bar.update()
        res["bounds_ms"] = bounds

        step: dict[str, dict[str, Any]] = {}
        for name in CORE_OPTIMIZERS:

            def core(name: str = name) -> float:
                steps = _CupySteps(cp, name, specs, rule)
                try:
                    return _median_ms(steps, sync, reps, inner)
                finally:
                    del steps
                    cp.get_default_memory_pool().free_all_blocks()

            step[f"cupy_{name}"] = _row(f"cupy_{name}", f"{name}, CuPy core ar.Engine", core, bar)

        torch_rows = {
            "torch_fused_adamw": "torch.optim.AdamW(fused=True)",
            "torch_direct_adadiag": "adadiag, direct torch ops",
            **{f"torch_adapter_{n}": f"{n}, torch adapter opt.step()" for n in ADAPTER_OPTIMIZERS},
            **{
                f"torch_adapter_{n}_no_cupy": f"{n}, torch adapter opt.step(), the route without CuPy"
                for n in ADAPTER_OPTIMIZERS
            },
            "torch_engine_adamw": "adamw, ar.Engine over torch CUDA tensors",
        }

        def measure_torch(key: str) -> float:
            if key == "torch_fused_adamw":
                params = torch_params(specs, torch.device("cuda"))
                fn = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True).step
                del params  # held by the optimizer: freed with it
            elif key == "torch_direct_adadiag":
                fn = torch_direct_adadiag(specs, rule, torch.device("cuda"))
            elif key == "torch_engine_adamw":
                fn = _TorchEngineSteps(specs, torch.device("cuda"))
            elif key.endswith("_no_cupy"):  # kernels="reference": the engine's route where CuPy is not installed
                name = key.removeprefix("torch_adapter_").removesuffix("_no_cupy")
                fn = _torch_adapter_step(torch, name, specs, rule, kernels="reference")
            else:
                fn = _torch_adapter_step(torch, key.removeprefix("torch_adapter_"), specs, rule)
            try:
                return _median_ms(fn, torch.cuda.synchronize, reps, inner)
            finally:
                del fn
                torch.cuda.empty_cache()

        step.update(_rows(torch_rows, measure_torch, None if torch is not None else torch_reason, bar))

        jax_rows = {
            "optax_adamw": "optax.adamw, jitted",
            "optax_adapter_adamw": "adamw, optax adapter, jitted",
            "optax_adapter_adadiag": "adadiag, optax adapter, jitted",
        }

        def measure_jax(key: str) -> float:
            fn, jsync = _optax_step(jax, jax_device, key, specs, rule)
            return _median_ms(fn, jsync, reps, inner)

        step.update(_rows(jax_rows, measure_jax, None if jax_device is not None else jax_reason, bar))

        peers = {"cupy_adamw": "torch_fused_adamw", "cupy_adadiag": "torch_direct_adadiag",
                 "cupy_adadiag_pp": "cupy_adadiag", "cupy_adafacdiag": "cupy_adadiag", "cupy_hfacdiag": "cupy_adadiag",
                 "torch_direct_adadiag": "torch_fused_adamw", "torch_adapter_adamw": "torch_fused_adamw",
                 "torch_adapter_adadiag": "torch_direct_adadiag", "torch_adapter_adadiag_pp": "torch_adapter_adadiag",
                 "torch_engine_adamw": "torch_fused_adamw", "torch_adapter_adamw_no_cupy": "torch_fused_adamw",
                 "torch_adapter_adadiag_no_cupy": "torch_direct_adadiag",
                 "torch_adapter_adadiag_pp_no_cupy": "torch_adapter_adadiag_no_cupy",
                 "optax_adapter_adamw": "optax_adamw", "optax_adapter_adadiag": "optax_adamw"}  # fmt: skip
        for key, row in step.items():
            optimizer = key.removesuffix("_no_cupy")
            if "adamw" in optimizer:
                bound = "bandwidth"
            elif optimizer.endswith("_pp"):
                bound = "gemm_2+bandwidth"
            elif optimizer.endswith("adadiag"):
                bound = "gemm_1+bandwidth"
            else:
                bound = None  # AdafacDiag, HfacDiag: factored moments move fewer bytes than AdamW's bound counts
            peer = peers.get(key)
            row.update(bound=bound, ratio_to_bound=_ratio(row["ms"], bounds.get(bound) if bound else None),
                       peer=peer, ratio_to_peer=_ratio(row["ms"], step[peer]["ms"] if peer else None))  # fmt: skip
        res["step"] = step

        table: dict[str, dict[str, Any]] = {}
        if refresh:
            base_ms = step["cupy_adadiag"]["ms"]
            for key, (label, fn) in _refresh_rows(cp, torch, rotated, reps).items():
                table[key] = _row(key, label, fn, bar)
                share = table[key]["ms"] / (period * base_ms) if table[key]["ms"] is not None and base_ms else None
                table[key]["share"] = share
            if torch is None:
                for key, label in (("torch_adapter_refresh_step", "torch adapter AdaDiag, first opt.step()"),
                                   ("torch_svd", "torch.linalg.svd, one matrix at a time"),
                                   ("torch_eigh_float32", "torch.linalg.eigh of the Gram stack, float32"),
                                   ("torch_eigh_float64", "torch.linalg.eigh of the Gram stack, float64")):  # fmt: skip
                    table[key] = {**_na(label, torch_reason), "share": None}
                    bar.update()
        res["refresh"] = table

    _print(res, out)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        out(f"tables written to {json_path}")
    return res


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _print(res: dict[str, Any], out: Callable[[str], None]) -> None:
    setup, bounds = res["setup"], res["bounds_ms"]
    out(f"adadiag-ref bench --gpu: {res['device']['name']}, {setup['model']}, rule {setup['rule']!r}, "
        f"float32, {setup['parameters']} parameters ({setup['elements'] / 1e6:.2f}M elements, "
        f"{setup['rotated']} rotated)")  # fmt: skip
    out(f"versions: CuPy {res['device']['cupy']} (CUDA runtime {res['device']['cuda_runtime']}), torch "
        f"{res['device']['torch']}, jax {res['device']['jax']}; median of {setup['reps']} timings of "
        f"{setup['inner']} steps")  # fmt: skip
    out(f"bounds: copy bandwidth {res['bandwidth_gbs']:.0f} GB/s -> AdamW bytes {bounds['bandwidth']:.3f} ms; "
        f"GEMMs one-sided {bounds['gemm_1']:.3f} ms, two-sided {bounds['gemm_2']:.3f} ms")  # fmt: skip
    out("")
    out("| non-refresh step | ms | bound | ms / bound | peer | ms / peer |")
    out("|---|---:|---|---:|---|---:|")
    for row in res["step"].values():
        if row["ms"] is None:
            out(f"| {row['label']} | n/a ({row['na']}) | | | | |")
            continue
        bound = f"{row['bound']} {bounds[row['bound']]:.3f}" if row["bound"] else "-"
        peer = res["step"][row["peer"]]["label"] if row["peer"] else "-"
        out(f"| {row['label']} | {row['ms']:.3f} | {bound} | {_fmt(row['ratio_to_bound'], '.2f')} | {peer} | "
            f"{_fmt(row['ratio_to_peer'], '.2f')} |")  # fmt: skip
    if res["refresh"]:
        out("")
        out(f"| refresh of the {setup['rotated']} rotated matrices (sigma_i = 1/i) | ms | share at T={setup['period']} "
            f"vs CuPy AdaDiag step |")  # fmt: skip
        out("|---|---:|---:|")
        for row in res["refresh"].values():
            if row["ms"] is None:
                out(f"| {row['label']} | n/a ({row['na']}) | |")
            else:
                out(f"| {row['label']} | {row['ms']:.3f} | {_fmt(row['share'], '.2%')} |")
