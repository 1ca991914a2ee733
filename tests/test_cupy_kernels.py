"""The CuPy kernels (``optim/families/<family>/cupy_route.py``) against the generic CuPy path.

Both are selected through the config option ``kernels``: ``"auto"`` runs the CuPy kernels on CuPy arrays,
``"reference"`` (and ``"numba"``, which names the NumPy kernels) the generic array-API code.  The kernels run
the reference's operations in its order without multiply-add contraction; only the summation order of
``sum(U^2)`` differs, so the two agree to rounding: ``rtol = 1e-12`` in float64, ``1e-5`` in float32, as for the
numba kernels (``tests/test_kernels.py``).

The tests marked ``gpu`` need CuPy and a CUDA device (skipped otherwise); the others check on the CPU what can
be checked without one: when the routes apply, the scalars they pass, the kernel sources' constants, and that
nothing imports CuPy before a CuPy array arrives.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _cuda_c import ElementwiseKernel, ReductionKernel, Unsupported
from array_api_compat import is_numpy_namespace
from conftest import _load_backend, routed_step, to_np
from hypothesis import given, settings
from hypothesis import strategies as st

import adadiag_ref as ar
from adadiag_ref import _kernels
from adadiag_ref._kernels import cupy_kernels as ck
from adadiag_ref._xp import namespace
from adadiag_ref.optim.core import prepare_step
from adadiag_ref.optim.engine import routed_direction
from adadiag_ref.optim.families import FAMILIES
from adadiag_ref.optim.families.adafactor import cupy_route as adafactor_route
from adadiag_ref.optim.families.adam import cupy_route as adam_route
from adadiag_ref.optim.families.hfac import cupy_route as hfac_route
from adadiag_ref.optim.rotation import unrotate

NAMES = list(ar.OPTIMIZERS)
ROUTES = {"adam": adam_route, "adafactor": adafactor_route, "hfac": hfac_route}
RTOL = {"float64": 1e-12, "float32": 1e-5}

# ----------------------------------------------------------------------------- CPU: registration and selection


def test_every_family_registers_its_cupy_routes() -> None:
    for family, module in ROUTES.items():
        assert module.direction in FAMILIES[family].routes.direction
    routes = FAMILIES["adam"].routes
    assert adam_route.update in routes.update


def _cpu_backend(name: str) -> Any:
    return _load_backend(name)


@pytest.mark.parametrize("backend", ["numpy", "array_api_strict", "torch"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_cupy_routes_decline_other_backends(backend: str, name: str, kernels: str) -> None:
    mod = _cpu_backend(backend)
    cfg = ar.make_config(name, kernels=kernels, weight_decay=0.1)
    rng = np.random.default_rng(0)
    w = mod.asarray(rng.standard_normal((3, 5)))
    g = mod.asarray(rng.standard_normal((3, 5)))
    xp = namespace(w)
    state = ar.refresh_basis(ar.init(w, cfg), g, cfg)
    step_in = prepare_step(state, g, cfg, w, True, xp)
    route = ROUTES[cfg.family]
    assert route.direction(state, step_in.g_rot, step_in.t, cfg, xp) is None
    if cfg.family == "adam":
        assert (
            adam_route.update(state, step_in.layout, step_in.t, step_in.g_rot, step_in.w, cfg, 1e-2, unrotate, xp)
            is None
        )


class _FakeDeviceArray:
    """Stands for a CuPy array in the selection logic only (nothing is computed with it)."""

    def __init__(self, dtype: Any, ndim: int = 2) -> None:
        self.dtype = np.dtype(dtype)
        self.ndim = ndim


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A namespace named ``cupy`` and :class:`_FakeDeviceArray` recognised as its arrays (by the selection only)."""
    monkeypatch.setattr(ck, "is_cupy_array", lambda a: isinstance(a, _FakeDeviceArray))
    return types.ModuleType("cupy")


def test_only_auto_selects_the_cupy_kernels(fake_cupy: Any) -> None:
    # "numba" names the NumPy kernels: on CuPy it takes the reference, as "reference" does
    a, b = _FakeDeviceArray(np.float32), _FakeDeviceArray(np.float32)
    assert ck.selected(ar.make_config("adamw", kernels="auto"), fake_cupy, a, None, b)
    for kernels in ("numba", "reference"):
        assert not ck.selected(ar.make_config("adamw", kernels=kernels), fake_cupy, a, b)


def test_cupy_kernels_need_one_float_dtype_and_cupy_arrays(fake_cupy: Any) -> None:
    f32, f64 = _FakeDeviceArray(np.float32), _FakeDeviceArray(np.float64)
    assert ck.usable(fake_cupy, f64, f64)
    assert not ck.usable(fake_cupy, f32, f64)  # mixed dtypes
    assert not ck.usable(fake_cupy, _FakeDeviceArray(np.float16))
    assert not ck.usable(fake_cupy, f32, np.zeros(3, np.float32))  # a host array among device ones
    assert not ck.usable(fake_cupy, None)  # no array at all
    assert not ck.usable(np, f32)  # another namespace


def test_host_coefficients_are_scalars_of_the_state_dtype() -> None:
    # a Python number is rounded to the state dtype as CuPy rounds the generic code's weak scalar
    c = ck.coefficient(0.1, np.float32)
    assert type(c) is np.float32 and c == np.float32(0.1)
    assert type(ck.coefficient(3, np.float64)) is np.float64
    assert ck.coefficient(np.float32(2.5), np.float32) == 2.5
    assert ck.coefficient(np.asarray(2.5, np.float32), np.float32) == 2.5
    # a strong NumPy value of another dtype would promote the generic code's result: the route declines
    assert ck.coefficient(np.float64(0.1), np.float32) is None
    assert ck.coefficient(np.zeros(2, np.float32), np.float32) is None
    assert ck.coefficient(True, np.float32) is None
    assert ck.coefficient(object(), np.float32) is None


def test_ema_coefficients_round_one_minus_beta_as_the_reference() -> None:
    # the reference computes (1.0 - beta_t) from the host float and the array op rounds it to the state dtype
    beta = 0.9 * (1 - 0.9**3) / (1 - 0.9**4)
    b, c = ck.ema_coefficients(beta, np.float32)
    assert b == np.float32(beta) and c == np.float32(1.0 - beta)
    assert ck.ema_coefficients(np.float64(beta), np.float32) is None


def test_tail_expression_adds_decay_only_when_it_is_nonzero() -> None:
    assert ck.tail_expression("u", "w", True) == "neg_lr * (u + wd * w)"
    assert ck.tail_expression("u", "w", False) == "neg_lr * u"


def _every_kernel() -> list[Any]:
    """What every kernel builder of the routes returns (``_*_kernel``, with each value of its flag: ``decay``,
    ``clip``), through :func:`adadiag_ref._kernels.cupy_kernels.elementwise` as the routes call it."""
    built = []
    for module in ROUTES.values():
        for attr, builder in vars(module).items():
            if attr.startswith("_") and attr.endswith("_kernel") and callable(builder):
                params = builder.__code__.co_varnames[: builder.__code__.co_argcount]
                for flag in [False, True] if params else [None]:
                    built.append(builder(*(() if flag is None else (flag,))))
    return built


def _kernel_sources(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str, str]]:
    """Every kernel the routes build, as ``(name, in_params, out_params, operation)`` (recorded, not compiled)."""
    monkeypatch.setattr(ck, "elementwise", lambda *source: source)
    return _every_kernel()


def test_kernel_sources_are_consistent(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _kernel_sources(monkeypatch)
    assert len({name for name, *_ in seen}) >= 14
    by_name: dict[str, tuple[str, str, str]] = {}
    for name, in_params, out_params, operation in seen:
        # one name, one source (the cache is keyed by name)
        assert by_name.setdefault(name, (in_params, out_params, operation)) == (in_params, out_params, operation)
        # every constant in the kernel's type T: a bare 0.5 is a C double, and would round differently
        bare = re.findall(r"(?<![\w.)])\d+\.\d*|(?<![\w.])\.\d+", operation.replace("(T)", "(T) "))
        assert not [x for x in bare if not re.search(r"\(T\)\s*" + re.escape(x), operation)], (name, operation)
        # every parameter is typed T (one dtype), named as CuPy allows ('i' is the loop index)
        names = [p.split()[-1] for p in (in_params + ", " + out_params).split(",")]
        assert all(p.split()[0] == "T" for p in (in_params + ", " + out_params).split(",")), name
        assert "i" not in names and len(names) == len(set(names)), name
        # every output is written
        for out in out_params.split(","):
            assert re.search(rf"\b{out.split()[-1]}\s*=[^=]", operation), (name, out)


def test_importing_the_library_and_stepping_on_numpy_never_imports_cupy() -> None:
    code = """
import sys

class Refuse:
    attempts = []
    def find_spec(self, name, path=None, target=None):
        if name == "cupy" or name.startswith("cupy."):
            Refuse.attempts.append(name)
            raise ImportError("cupy is refused here")
        return None

sys.meta_path.insert(0, Refuse())
import numpy as np
import adadiag_ref as ar
import adadiag_ref.optim.families.adam.cupy_route
import adadiag_ref.optim.families.adafactor.cupy_route
import adadiag_ref.optim.families.hfac.cupy_route
import adadiag_ref._kernels.cupy_kernels
w = np.ones((3, 4))
for name in ar.OPTIMIZERS:
    cfg = ar.make_config(name)
    state = ar.init(w, cfg)
    w2, state = ar.step(state, np.full((3, 4), 0.5), cfg, w)
    ar.update_in_place(state, np.full((3, 4), 0.25), cfg, w2.copy())
assert Refuse.attempts == [] and "cupy" not in sys.modules, Refuse.attempts
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ----------------------------------------------------------------------------- CPU: NVRTC compiles the sources
#
# No device is needed to compile: CuPy generates each kernel's CUDA source (its own code generation, as a launch
# does) and NVRTC compiles it to PTX for compute_80 (A100) and compute_90 (H100/H200).  Each kernel is compiled in
# the forms a launch may take: float32/float64; "flat" (1-d contiguous arguments with 32-bit indexing: what CuPy
# reduces same-shape contiguous arrays to) and "strided" (2-d non-contiguous arguments with 64-bit indexing:
# transposed work frames, broadcast vectors); "host" (the coefficients as kernel scalars) and "device" (the
# coefficients as broadcast 0-d arrays).  The PTX then shows what the arithmetic is: no fused multiply-add, IEEE
# division and square root, and no float64 in a float32 kernel.

ARCHS = ("80", "90")
_ARG_NDARRAY, _ARG_INDEXER, _ARG_SCALAR = 1, 2, 3  # CuPy's _ArgKind (cupy/_core/_kernel.pxd)


@pytest.fixture(scope="module")
def cupy_nvrtc() -> Any:
    """CuPy and its NVRTC, no device needed (pip install "adadiag-ref[gpucheck]"; skipped when absent)."""
    cupy = pytest.importorskip("cupy", reason='needs CuPy and NVRTC: pip install "adadiag-ref[gpucheck]"')
    try:
        cupy.cuda.nvrtc.getVersion()
        cupy._core.core.assemble_cupy_compiler_options(())  # finds the CUDA headers
    except Exception as exc:  # the NVRTC library or the headers missing: CuPy raises its own error types
        pytest.skip(f'NVRTC or the CUDA headers cannot be found ({exc}): pip install "adadiag-ref[gpucheck]"')
    return cupy


def _arg(cupy: Any, dtype: Any, ndim: int, contiguous: bool, index32: bool, scalar: bool) -> Any:
    from cupy._core import _kernel, _scalar

    if scalar:
        return _kernel._ArgInfo(_ARG_SCALAR, _scalar.CScalar, np.dtype(dtype), 0, True, True)
    return _kernel._ArgInfo(_ARG_NDARRAY, cupy.ndarray, np.dtype(dtype), ndim, contiguous, index32)


def _indexer(ndim: int, index32: bool) -> Any:
    from cupy._core import _carray, _kernel

    return _kernel._ArgInfo(_ARG_INDEXER, _carray.Indexer, None, ndim, True, index32)


LAYOUTS = {"flat": (1, True, True), "strided": (2, False, False)}
"""``(ndim, contiguous, 32-bit indexing)`` of the array arguments."""


def _elementwise_source(cupy: Any, kernel: Any, dtype: Any, layout: str, coefficients: str) -> str:
    """CuPy's CUDA source of ``kernel`` (a ``cupy.ElementwiseKernel`` built by a route) for one launch form."""
    from cupy._core import _kernel

    assert kernel.kwargs == {"options": ck.OPTIONS}  # the routes' options reach NVRTC
    ndim, contiguous, index32 = LAYOUTS[layout]
    scalar = [coefficients == "host" and p.name in COEFFICIENTS for p in kernel.in_params]
    broadcast = [coefficients == "device" and p.name in COEFFICIENTS for p in kernel.in_params]
    in_types = tuple(None if s else np.dtype(dtype) for s in scalar)
    _, _, type_map = kernel._decide_params_type(in_types, (np.dtype(dtype),) * kernel.nout)
    args = [_arg(cupy, dtype, ndim, contiguous and not b, index32, s) for s, b in zip(scalar, broadcast, strict=True)]
    args += [_arg(cupy, dtype, ndim, contiguous, index32, False) for _ in kernel.out_params]
    code = _kernel._get_elementwise_kernel_code(
        (*args, _indexer(ndim, index32)),
        type_map,
        kernel.params,
        kernel.operation,
        kernel.name,
        kernel.preamble,
        **kernel.kwargs,
    )
    for p, s in zip(kernel.in_params, scalar, strict=True):  # the argument kinds reached the source as meant
        ctype = {"float32": "float", "float64": "double"}[str(np.dtype(dtype))]
        assert bool(re.search(rf"\bconst {ctype} {p.name}\b", code)) == s, (kernel.name, p.name)
    return code


def _reduction_source(cupy: Any, dtype: Any) -> tuple[str, tuple[str, ...]]:
    """CuPy's CUDA source of the routes' summation kernel (``cupy_kernels.sum_of_squares``) reducing a 1-d
    contiguous array, and its options.  The kernel is the one the route builds (building needs no device); its
    launch is not made."""
    from cupy._core import _kernel, _reduction

    built = []
    with pytest.MonkeyPatch.context() as m:
        real = cupy.ReductionKernel
        m.setattr(cupy, "ReductionKernel", lambda *a, **kw: built.append(real(*a, **kw)) or (lambda x: None))
        m.setattr(ck, "_KERNELS", {})
        ck.sum_of_squares(None)
    (kernel,) = built
    params = (*kernel.in_params, *kernel.out_params, *_kernel._get_param_info("CIndexer _in_ind, CIndexer _out_ind",
              False), *_kernel._get_param_info("int32 _block_stride", True))  # fmt: skip
    args = (_arg(cupy, dtype, 1, True, True, False), _arg(cupy, dtype, 0, True, True, False), _indexer(1, True),
            _indexer(0, True), _arg(cupy, np.int32, 0, True, True, True))  # fmt: skip
    type_map = _kernel._TypeMap((("T", np.dtype(dtype)), ("IndexT", "int32")))
    block_size = _reduction._get_block_specs(1 << 20, 1, 1 << 20, -1)[0]
    code = _reduction._ReductionKernel_get_cached_function_code(
        1,
        1,
        params,
        args,
        type_map,
        kernel.name,
        block_size,
        kernel.reduce_type,
        kernel.identity,
        kernel.map_expr,
        kernel.reduce_expr,
        kernel.post_map_expr,
        kernel.preamble,
        kernel.options,
    )
    return code, tuple(kernel.options)


class _Compiled(Exception):
    """Raised once NVRTC has compiled: what follows (loading the module onto a device) needs a GPU."""


def _nvrtc_ptx(source: str, options: tuple[str, ...], arch: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any]:
    """``(PTX, NVRTC options)`` of ``source`` compiled as CuPy compiles a kernel (``compile_with_cache``: its
    headers, include paths, ``-ftz=true``, ``--std=c++17``), for ``compute_<arch>`` instead of the device's."""
    from cupy._core import core
    from cupy.cuda import compiler

    got: dict[str, Any] = {}
    nvrtc = compiler._compile_using_nvrtc_no_warning

    def compile_only(src: str, opts: tuple = (), arch_: Any = None, *args: Any, **kwargs: Any) -> Any:
        got["options"], got["arch"] = opts, arch_
        got["ptx"] = nvrtc(src, opts, arch_, *args, **kwargs)[0]
        raise _Compiled

    with monkeypatch.context() as m:
        m.setattr(compiler, "_compile_using_nvrtc_no_warning", compile_only)
        m.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=compute_{arch}", "ptx"))
        m.setenv("CUPY_CACHE_IN_MEMORY", "1")  # no disk cache: a cached binary would be loaded onto a device
        with pytest.raises(_Compiled):
            core.compile_with_cache(source, options, arch=arch)
    assert got["arch"] == arch
    ptx = got["ptx"]
    return ptx.decode() if isinstance(ptx, bytes) else ptx, got["options"]


def _ptx_entries(ptx: str) -> dict[str, str]:
    """Each kernel's PTX body, by name."""
    parts = re.split(r"\.(?:visible\s+)?\.?entry\s+(\w+)\s*\(", ptx)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _ptx_problems(body: str, dtype: str) -> list[str]:
    """What in one kernel's PTX would round differently from the reference's separate IEEE operations."""
    problems = []
    fused = re.findall(r"\b(?:fma|mad)(?:\.\w+)*\.f(?:16|32|64)\b", body)
    if fused:
        problems.append(f"fused multiply-add {sorted(set(fused))}")
    inexact = [op for op in re.findall(r"\b(?:div|sqrt|rcp|rsqrt)(?:\.\w+)*\.f(?:32|64)\b", body) if ".rn" not in op]
    if inexact:
        problems.append(f"division or square root not IEEE round-to-nearest {sorted(set(inexact))}")
    if dtype == "float32" and re.search(r"\.f64\b", body):
        problems.append("float64 in a float32 kernel: " + ", ".join(sorted(set(re.findall(r"\S*\.f64\b", body)))))
    own = {"float32": r"\.f32\b", "float64": r"\.f64\b"}[dtype]
    if not re.search(r"\b(?:add|sub|mul|div|sqrt)(?:\.\w+)*" + own, body):
        problems.append(f"no {dtype} arithmetic at all")
    return problems


FORMS = [(layout, coefficients) for layout in LAYOUTS for coefficients in ("host", "device")]


def _compile_and_check(
    cupy: Any, arch: str, dtype: str, forms_of: dict[str, list[tuple[str, str]]], monkeypatch: pytest.MonkeyPatch
) -> int:
    """Compile every route kernel in the forms ``forms_of[name]`` and the summation kernel, for ``compute_<arch>``;
    assert that NVRTC accepts each and that its PTX has none of :func:`_ptx_problems`; the number compiled."""
    kernels = {k.name: k for k in _every_kernel()}  # the routes' own cupy.ElementwiseKernel objects
    assert set(forms_of) == set(kernels)
    # NVRTC programs of several kernels, no name twice in one (CuPy compiles one per kernel; here only the typedef
    # of T repeats): the k-th form of every kernel in program k, so one program when each kernel has one form
    programs: list[tuple[dict[str, str], tuple[str, ...], dict[str, tuple[str, str]]]] = []
    for name, forms in forms_of.items():
        for k, form in enumerate(forms):
            if k == len(programs):
                programs.append(({}, ck.OPTIONS, {}))
            programs[k][0][name] = _elementwise_source(cupy, kernels[name], dtype, *form)
            programs[k][2][name] = form
    code, options = _reduction_source(cupy, dtype)
    programs.append(({"adadiag_sum_of_squares": code}, options, {"adadiag_sum_of_squares": ("flat", "reduction")}))
    compiled, problems = 0, {}
    for sources, opts, form_of in programs:
        ptx, used = _nvrtc_ptx("\n".join(sources.values()), opts, arch, monkeypatch)
        entries = _ptx_entries(ptx)
        assert set(entries) == set(sources)
        for name, body in entries.items():
            found = _ptx_problems(body, dtype) + ([] if "--fmad=false" in used else ["compiled without --fmad=false"])
            if found:
                problems[(name, *form_of[name])] = found
        compiled += len(entries)
    assert not problems, problems
    return compiled


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_kernel_sources_compile_with_nvrtc(
    cupy_nvrtc: Any, arch: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every kernel once, the forms taken in turn (each form several times); all forms: the slow test below
    monkeypatch.setattr(ck, "_KERNELS", {})
    names = sorted(k.name for k in _every_kernel())
    assert len(names) == len(set(names)) >= 14
    forms_of = {name: [FORMS[i % len(FORMS)]] for i, name in enumerate(names)}
    assert _compile_and_check(cupy_nvrtc, arch, dtype, forms_of, monkeypatch) == len(names) + 1


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_kernel_sources_compile_with_nvrtc_in_every_form(
    cupy_nvrtc: Any, arch: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ck, "_KERNELS", {})
    names = [k.name for k in _every_kernel()]
    assert _compile_and_check(cupy_nvrtc, arch, dtype, dict.fromkeys(names, FORMS), monkeypatch) == 4 * len(names) + 1


# ------------------------------------------------------------------- CPU: the kernel bodies evaluated by NumPy
#
# tests/_cuda_c.py evaluates each kernel body's C over NumPy arrays of the kernel's dtype, one correctly rounded
# operation per C operation (as CUDA does with --fmad=false); the fixture below puts it in CuPy's place, so that
# the CuPy routes run on NumPy arrays.  Everything else a step computes is NumPy's in both runs (the same
# operations on the same values as on CuPy), so a body that performs the reference's operations in its order
# reproduces kernels="reference" bit for bit.  The one summation the routes do in a kernel of their own, RMS(U)
# (cupy_kernels.sum_of_squares), is evaluated in NumPy's order here; in another order it agrees to rounding only
# (test_a_reduction_in_another_order_agrees_to_rounding), which is why the GPU tests compare with RTOL.


def _emulated_cases(family: str) -> list[dict[str, Any]]:
    """The trajectories compared for one optimizer and dtype: wide, tall (the work frame a transposed view, so the
    kernels see strided arguments) and vector parameters, with and without weight decay, with host coefficients
    (``count=``) and device ones (the state's counter); a 3-d and a larger matrix once; in place; the options
    that change which kernels run (Adafactor's momentum and clip, Hfac's clip).  Chosen to cover each of these
    at least once in every combination that selects different kernels, in a few seconds."""
    grid = itertools.product([(6, 9), (9, 6)], (0.05, 0.0), (True, False))
    cases = [dict(shape=shape, weight_decay=wd, host_count=host) for shape, wd, host in grid]
    cases += [dict(shape=(7,), weight_decay=0.05, host_count=True),
              dict(shape=(7,), weight_decay=0.0, host_count=False),
              dict(shape=(2, 3, 4), weight_decay=0.0, host_count=True),
              dict(shape=(48, 80), weight_decay=0.05, host_count=False)]  # fmt: skip
    cases += [dict(shape=(9, 6), weight_decay=0.0, host_count=k % 2 == 0, **options)
              for k, options in enumerate(FAMILY_OPTIONS[family])]  # fmt: skip
    return cases


FAMILY_OPTIONS: dict[str, list[dict[str, Any]]] = {
    "adam": [],
    "adafactor": [dict(momentum=False), dict(clip_threshold=None), dict(momentum=False, clip_threshold=None),
                  dict(beta2_schedule="adafactor"), dict(relative_step=True, scale_parameter=True)],
    "hfac": [dict(clip_threshold=None)],
}  # fmt: skip
"""The options beyond the defaults whose kernels differ (momentum and clip change which Adafactor and Hfac
kernels run), as the GPU tests sweep them."""


@pytest.mark.parametrize(
    "body",
    ["y = x * 0.5;", "y = x; y += x;", "float z = x; y = z;", "y = max(x, x);", "y = x[0];", "y = x && x;",
     "z = x;", "x = y;", "y = x < x < x ? x : x;", "T y2 = x; T y2 = x; y = y2;", "y = f(x);"],
)  # fmt: skip
def test_the_c_evaluator_refuses_what_it_does_not_know(body: str) -> None:
    with pytest.raises(Unsupported):
        ElementwiseKernel("T x", "T y", body, "refused")(np.ones(3), np.empty(3))


def test_the_c_evaluator_rounds_each_operation_in_the_kernel_type() -> None:
    kernel = ElementwiseKernel(
        "T a, T b, T s", "T y, T z", "T t = -a / (T)3 + b * s;\ny = t > (T)0 ? fmax(t, sqrt(b)) : T(0.1);\nz = y;", "ok"
    )
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        a, b = rng.standard_normal((2, 4, 5)).astype(dtype)
        b = np.abs(b)
        s = dtype(0.3)
        y, z = np.empty((4, 5), dtype), np.empty((4, 5), dtype)
        kernel(a, b[:1], s, y, z)  # a broadcast row
        t = -a / dtype(3) + b[:1] * s
        want = np.where(t > 0, np.fmax(t, np.sqrt(b[:1])), dtype(0.1))
        assert y.dtype == dtype and np.array_equal(y, want) and np.array_equal(z, y)
    with pytest.raises(Unsupported):  # a Python float or another dtype is not a kernel argument of type T
        kernel(a, b, 0.3, y, z)
    with pytest.raises(Unsupported):
        kernel(a.astype(np.float32), b, np.float64(0.3), y, z)


@pytest.fixture
def emulated_cupy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, tuple[Any, ...]]]:
    """The CuPy routes on NumPy arrays, their kernels evaluated by :mod:`_cuda_c`; returns the record of the
    kernel calls ``(name, dtype, argument kinds)``.

    ``import cupy`` inside the routes finds a module with the stand-ins and NumPy's ``empty_like`` and
    ``may_share_memory``; the selection takes NumPy for CuPy; the numba routes, which would be selected first on
    NumPy, decline."""
    fake = types.ModuleType("cupy")
    fake.ElementwiseKernel = ElementwiseKernel  # type: ignore[attr-defined]
    fake.ReductionKernel = ReductionKernel  # type: ignore[attr-defined]
    fake.empty_like = np.empty_like  # type: ignore[attr-defined]
    fake.may_share_memory = np.may_share_memory  # type: ignore[attr-defined]
    fake.ndarray = type("ndarray", (), {})  # type: ignore[attr-defined]  # no array is one (array_api_compat asks)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(ck, "_KERNELS", {})
    monkeypatch.setattr(ck, "is_cupy_namespace", is_numpy_namespace)
    monkeypatch.setattr(ck, "is_cupy_array", lambda a: type(a) is np.ndarray)
    monkeypatch.setattr(_kernels, "selected", lambda *args: False)
    monkeypatch.setattr(ElementwiseKernel, "calls", [])
    monkeypatch.setattr(ReductionKernel, "order", "numpy")
    return ElementwiseKernel.calls


def _assert_identical(got: Any, want: Any) -> None:
    """The same dtype, shape and bits (a signed zero or a NaN payload included)."""
    got, want = to_np(got), to_np(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = {4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(bits), np.ascontiguousarray(want).view(bits))


def _assert_states_identical(got: Any, want: Any) -> None:
    for field, a, b in zip(got._fields, got, want):
        if field in ("count", "param_shape") or (a is None and b is None):
            continue
        _assert_identical(a, b)


def _emulated_pair(calls: list[Any], name: str, dtype: str, shape: tuple[int, ...], **kw: Any) -> None:
    """One trajectory with the CuPy routes (``kernels="auto"``) against the reference's, bit for bit."""
    w_ref, s_ref = _trajectory(np, name, dtype, shape, "reference", **kw)
    before = len(calls)
    w_fast, s_fast = _trajectory(np, name, dtype, shape, "auto", **kw)
    assert len(calls) > before, "no kernel ran"
    _assert_identical(w_fast, w_ref)
    _assert_states_identical(s_fast, s_ref)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_kernel_bodies_evaluated_on_the_cpu_equal_the_reference_bit_for_bit(
    emulated_cupy: list[Any], name: str, dtype: str
) -> None:
    family = ar.make_config(name).family
    for case in _emulated_cases(family):
        _emulated_pair(emulated_cupy, name, dtype, **case)
    ran = {call[0] for call in emulated_cupy}
    if family == "adam":  # the tail kernels ran with and without the decay term
        assert any(k.endswith("_decay") for k in ran) and any(k + "_decay" in ran for k in ran)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_direction_kernels_evaluated_on_the_cpu_equal_the_reference_bit_for_bit(
    emulated_cupy: list[Any], name: str, dtype: str
) -> None:
    # the direction alone (the engine's routed_direction)
    rng = np.random.default_rng(5)
    w, g = (rng.standard_normal((5, 8)).astype(dtype) for _ in range(2))
    found = {kernels: _routed_direction(name, kernels, w, g) for kernels in ("reference", "auto")}
    assert emulated_cupy
    _assert_identical(found["auto"][0], found["reference"][0])
    _assert_states_identical(found["auto"][1], found["reference"][1])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_multi_step_with_the_kernels_evaluated_on_the_cpu_equals_step_bit_for_bit(
    emulated_cupy: list[Any], name: str, dtype: str
) -> None:
    # multi_step runs through the engine, whose flat groups are the same on NumPy as on a device backend
    shapes = [(6, 9), (9, 6), (7,)]
    for weight_decay, host_count in [(0.05, True), (0.0, False)]:
        before = len(emulated_cupy)
        params, states = _multi_trajectory(np, name, dtype, shapes, "auto", host_count=host_count,
                                           weight_decay=weight_decay)  # fmt: skip
        assert len(emulated_cupy) > before, "no kernel ran"
        for shape, w, state in zip(shapes, params, states, strict=True):
            w_ref, s_ref = _trajectory(np, name, dtype, shape, "reference", host_count=host_count,
                                       weight_decay=weight_decay)  # fmt: skip
            _assert_identical(w, w_ref)
            _assert_states_identical(state, s_ref)


COEFFICIENTS = frozenset({"b1", "c1", "b2", "c2", "eps", "neg_lr", "wd", "b", "c"})
"""The kernel parameters the routes pass as host scalars (kernel arguments) or 0-d device arrays: the two forms
of every kernel that ``test_kernel_sources_compile_with_nvrtc`` compiles."""


def test_the_cpu_evaluation_runs_every_kernel(emulated_cupy: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # the cases above, in float32 for one optimizer of each family (and a rotated Adam) and multi_step, run every
    # kernel the routes build
    for name in ("adamw", "adadiag", "adafactor", "hfac"):
        for case in _emulated_cases(ar.make_config(name).family):
            if case["shape"] in [(9, 6), (7,)]:
                _trajectory(np, name, "float32", **case, kernels="auto")
    _multi_trajectory(np, "adamw", "float32", [(7,)], "auto", host_count=True)
    sources = {name for name, *_ in _kernel_sources(monkeypatch)}
    assert {call[0] for call in emulated_cupy} == sources | {"adadiag_sum_of_squares"}
    # the scalars are the coefficients, and only they (what the NVRTC variants take as CScalar); the clip's divisor
    # d is a 0-d array on CuPy, a scalar here only because NumPy's maximum of 0-d arrays returns one
    for name, _, kinds in emulated_cupy:
        kernel = ck._KERNELS[name]
        scalars = {p for p, kind in zip(kernel.in_names, kinds, strict=False) if kind == "scalar"} - {"d"}
        assert scalars <= COEFFICIENTS, (name, scalars)


@pytest.mark.parametrize("name", ["adafactor", "adafacdiag", "hfacdiag"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_reduction_in_another_order_agrees_to_rounding(emulated_cupy: list[Any], name: str, dtype: str) -> None:
    # RMS(U) summed as a GPU might (pairwise halving, not NumPy's blocked pairwise sum): the clip's divisor may
    # differ in its last bit, and the trajectories agree to the tolerance the GPU tests use
    ReductionKernel.order = "tree"
    for shape in [(6, 9), (48, 80)]:
        w_ref, s_ref = _trajectory(np, name, dtype, shape, "reference", host_count=True, clip_threshold=0.1)
        w_fast, s_fast = _trajectory(np, name, dtype, shape, "auto", host_count=True, clip_threshold=0.1)
        assert "adadiag_sum_of_squares" in {call[0] for call in emulated_cupy}
        _assert_close(w_fast, w_ref, dtype)
        _assert_states_close(s_fast, s_ref, dtype)


# ----------------------------------------------------------------------------- GPU: against the reference


@pytest.fixture
def cp() -> Any:
    """CuPy with a CUDA device (skipped otherwise)."""
    return _load_backend("cupy")


SHAPES = [(6, 9), (9, 6), (7,), (2, 3, 4), (48, 80)]


def _trajectory(
    cp: Any, name: str, dtype: str, shape: tuple[int, ...], kernels: str, *, host_count: bool, in_place: bool = False,
    weight_decay: float = 0.05, **options: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """Seven steps (bases refreshed at t = 1, 4, 7; a zero gradient at t = 4) from fixed inputs on CuPy (or on
    NumPy, ``cp=np``, with the kernels evaluated on the CPU: the fixture ``emulated_cupy``): ``kernels="reference"``
    by ``ar.step``, ``"auto"`` by the engine's per-parameter step (the routes run only there), ``in_place`` by
    ``ar.update_in_place`` (the reference's arithmetic, whatever ``kernels`` says).  ``weight_decay=0``
    runs the kernels without the decay term (the default configuration's)."""
    cfg = ar.make_config(name, kernels=kernels, lr=2e-2, betas=(0.9, 0.99), weight_decay=weight_decay, update_freq=3,
                         **options)  # fmt: skip
    w, grads = _inputs(cp, dtype, shape)
    state = ar.init(w, cfg)
    for k, g_host in enumerate(grads):
        g = cp.asarray(g_host)
        count = k if host_count else None
        if in_place:
            refreshed = ar.refresh_due(k, cfg)
            if refreshed:
                state = ar.refresh_basis(state, g, cfg)
            state = ar.update_in_place(state, g, cfg, w, refreshed=refreshed, count=count)
        elif kernels == "reference":
            w, state = ar.step(state, g, cfg, w, count=count)
        else:  # the routes run in the engine only: its per-parameter step
            w, state = routed_step(state, g, cfg, w, k, count)
    return w, state


def _routed_direction(name: str, kernels: str, w: Any, g: Any) -> tuple[Any, Any]:
    """``U~`` and the state with the new moments of a refresh step, by the engine's ``routed_direction``."""
    cfg = ar.make_config(name, kernels=kernels)
    state = ar.refresh_basis(ar.init(w, cfg), g, cfg)
    xp = namespace(g, w)
    step_in = prepare_step(state, g, cfg, w, True, xp, 0)
    u, moments = routed_direction(state, step_in.g_rot, step_in.t, cfg, xp)
    return u, state._replace(**moments)


def _inputs(cp: Any, dtype: str, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """The trajectories' parameter (on ``cp``) and seven gradients (host; the fourth zero)."""
    rng = np.random.default_rng(11)
    w = cp.asarray(rng.standard_normal(shape).astype(dtype))
    grads = rng.standard_normal((7, *shape)).astype(dtype)
    grads[3] = 0.0
    return w, grads


def _multi_trajectory(
    cp: Any, name: str, dtype: str, shapes: list[tuple[int, ...]], kernels: str, *, host_count: bool,
    weight_decay: float = 0.05,
) -> tuple[list[Any], list[Any]]:  # fmt: skip
    """:func:`_trajectory`'s seven steps for one parameter of each shape at once, by ``ar.multi_step`` (each
    parameter sees the inputs :func:`_trajectory` gives it)."""
    cfg = ar.make_config(name, kernels=kernels, lr=2e-2, betas=(0.9, 0.99), weight_decay=weight_decay, update_freq=3)
    inputs = [_inputs(cp, dtype, shape) for shape in shapes]
    params = [w for w, _ in inputs]
    states = [ar.init(w, cfg) for w in params]
    for k in range(7):
        grads = [cp.asarray(g[k]) for _, g in inputs]
        params, states = ar.multi_step(states, grads, cfg, params, count=k if host_count else None)
    return params, states


def _assert_close(got: Any, want: Any, dtype: str) -> None:
    got, want = to_np(got), to_np(want)
    assert got.dtype == want.dtype == np.dtype(dtype)
    rtol = RTOL[dtype]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(float(np.max(np.abs(want))), 1e-30))


def _assert_states_close(got: Any, want: Any, dtype: str) -> None:
    for field, a, b in zip(got._fields, got, want):
        if field in ("count", "param_shape") or (a is None and b is None):
            continue
        _assert_close(a, b, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("host_count", [True, False])
@pytest.mark.parametrize("weight_decay", [0.05, 0.0])
def test_cupy_kernels_equal_the_cupy_reference(
    cp: Any, name: str, dtype: str, shape: tuple[int, ...], host_count: bool, weight_decay: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # host_count: the coefficients are host numbers (kernel scalars); else 0-d device arrays (broadcast).
    # weight_decay=0: the kernels without the decay term, the default configuration's
    monkeypatch.setattr(ck, "_KERNELS", {})
    w_ref, s_ref = _trajectory(cp, name, dtype, shape, "reference", host_count=host_count, weight_decay=weight_decay)
    assert ck._KERNELS == {}  # the reference built no kernel
    w_fast, s_fast = _trajectory(cp, name, dtype, shape, "auto", host_count=host_count, weight_decay=weight_decay)
    assert ck._KERNELS, "the CuPy route did not run"
    if ar.make_config(name).family == "adam":  # the tail kernels of this weight decay ran, and only they
        decay_kernels = {k for k in ck._KERNELS if k.endswith("_decay")}
        assert bool(decay_kernels) == (weight_decay != 0.0), sorted(ck._KERNELS)
    _assert_close(w_fast, w_ref, dtype)
    _assert_states_close(s_fast, s_ref, dtype)
    # "numba" names the NumPy kernels: on CuPy it is the reference
    if not _kernels.AVAILABLE:
        return  # kernels="numba" needs numba installed
    monkeypatch.setattr(ck, "_KERNELS", {})
    w_numba, _ = _trajectory(cp, name, dtype, shape, "numba", host_count=host_count, weight_decay=weight_decay)
    assert ck._KERNELS == {}
    _assert_close(w_numba, w_ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cupy_kernels_equal_numpy(cp: Any, name: str, dtype: str) -> None:
    # against the NumPy reference (its own LAPACK and summation order): the backends' tolerance
    for shape in SHAPES[:-1]:  # small shapes: the two backends' bases differ by their LAPACK's rounding
        w_fast, _ = _trajectory(cp, name, dtype, shape, "auto", host_count=True)
        cfg = ar.make_config(name, kernels="reference", lr=2e-2, betas=(0.9, 0.99), weight_decay=0.05, update_freq=3)
        rng = np.random.default_rng(11)
        w = rng.standard_normal(shape).astype(dtype)
        grads = rng.standard_normal((7, *shape)).astype(dtype)
        grads[3] = 0.0
        state = ar.init(w, cfg)
        for g in grads:
            w, state = ar.step(state, g, cfg, w)
        _assert_close(w_fast, w, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adafactor", "adafacdiag", "adafacdiag_pp"])
@pytest.mark.parametrize(
    "options", [dict(momentum=False), dict(clip_threshold=None), dict(momentum=False, clip_threshold=None),
                dict(beta2_schedule="adafactor"), dict(relative_step=True, scale_parameter=True)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cupy_kernels_adafactor_options(cp: Any, name: str, options: dict, dtype: str) -> None:
    for shape in [(6, 9), (9, 6), (7,)]:
        w_ref, s_ref = _trajectory(cp, name, dtype, shape, "reference", host_count=True, **options)
        w_fast, s_fast = _trajectory(cp, name, dtype, shape, "auto", host_count=True, **options)
        _assert_close(w_fast, w_ref, dtype)
        _assert_states_close(s_fast, s_ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hfac", "hfacdiag"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cupy_kernels_hfac_without_clip(cp: Any, name: str, dtype: str) -> None:
    w_ref, _ = _trajectory(cp, name, dtype, (6, 9), "reference", host_count=True, clip_threshold=None)
    w_fast, _ = _trajectory(cp, name, dtype, (6, 9), "auto", host_count=True, clip_threshold=None)
    _assert_close(w_fast, w_ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cupy_direction_route_equals_the_reference(cp: Any, name: str, dtype: str) -> None:
    # the direction alone (the engine's routed_direction)
    rng = np.random.default_rng(5)
    w = cp.asarray(rng.standard_normal((5, 8)).astype(dtype))
    g = cp.asarray(rng.standard_normal((5, 8)).astype(dtype))
    found = {kernels: _routed_direction(name, kernels, w, g) for kernels in ("reference", "auto")}
    _assert_close(found["auto"][0], found["reference"][0], dtype)
    _assert_states_close(found["auto"][1], found["reference"][1], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape", [(6, 9), (9, 6), (7,), (2, 3, 4)])
@pytest.mark.parametrize("host_count", [True, False])
@pytest.mark.parametrize("weight_decay", [0.05, 0.0])
def test_cupy_update_in_place_equals_the_functional_update(
    cp: Any, name: str, dtype: str, shape: tuple[int, ...], host_count: bool, weight_decay: float
) -> None:
    kw = dict(host_count=host_count, weight_decay=weight_decay)
    w_f, s_f = _trajectory(cp, name, dtype, shape, "reference", **kw)
    w_i, s_i = _trajectory(cp, name, dtype, shape, "auto", in_place=True, **kw)
    # the same operations on the same operands (no contraction): expected bit for bit; checked to rounding
    tight = {"float64": 1e-14, "float32": 1e-6}[dtype]
    np.testing.assert_allclose(to_np(w_i), to_np(w_f), rtol=tight, atol=tight * float(np.max(np.abs(to_np(w_f)))))
    _assert_states_close(s_i, s_f, dtype)
    w_a, _ = _trajectory(cp, name, dtype, shape, "auto", **kw)  # the routes: to rounding
    _assert_close(w_i, w_a, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("host_count", [True, False])
@pytest.mark.parametrize("weight_decay", [0.05, 0.0])
def test_cupy_multi_step_equals_step(
    cp: Any, name: str, dtype: str, host_count: bool, weight_decay: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # multi_step's device path (an entrywise family's moments and direction in one flat group per dtype and step,
    # the refreshes due batched by refresh_bases) against ar.step per parameter.  A stacked decomposition gives
    # refresh_basis's bases to rounding, so RTOL, on the small shapes, as between two backends
    # (test_cupy_kernels_equal_numpy); bit for bit on the CPU (the test ..._evaluated_on_the_cpu_equals_step...)
    shapes = SHAPES[:-1]
    monkeypatch.setattr(ck, "_KERNELS", {})
    params, states = _multi_trajectory(cp, name, dtype, shapes, "auto", host_count=host_count,
                                       weight_decay=weight_decay)  # fmt: skip
    assert ck._KERNELS, "the CuPy route did not run"
    for shape, w, state in zip(shapes, params, states, strict=True):
        w_ref, s_ref = _trajectory(cp, name, dtype, shape, "auto", host_count=host_count, weight_decay=weight_decay)
        assert tuple(w.shape) == shape and int(state.count) == int(s_ref.count) == 7
        _assert_close(w, w_ref, dtype)
        _assert_states_close(state, s_ref, dtype)


@pytest.mark.gpu
def test_cupy_update_in_place_writes_the_callers_buffers(cp: Any) -> None:
    rng = np.random.default_rng(3)
    for name in ("adamw", "adadiag"):
        cfg = ar.make_config(name, weight_decay=0.1)
        w = cp.asarray(rng.standard_normal((9, 6)))  # tall: the work frame is a transposed view
        g = cp.asarray(rng.standard_normal((9, 6)))
        state = ar.refresh_basis(ar.init(w, cfg), g, cfg)
        delta, expected = ar.update(state, g, cfg, w, refreshed=True)
        w_expected = w + delta
        M, V, w_before = state.M, state.V, w.copy()
        new = ar.update_in_place(state, g, cfg, w, refreshed=True, count=0)
        assert new.M is M and new.V is V and not np.array_equal(to_np(w), to_np(w_before))
        _assert_close(w, w_expected, "float64")
        _assert_close(M, expected.M, "float64")
        _assert_close(V, expected.V, "float64")


@pytest.mark.gpu
def test_cupy_update_in_place_with_a_state_of_another_dtype(cp: Any) -> None:
    # float32 parameter, float64 state: the work-frame W is a copy, written back in the parameter's dtype
    rng = np.random.default_rng(4)
    cfg = ar.make_config("adamw", state_dtype="float64", weight_decay=0.1)
    w = cp.asarray(rng.standard_normal((4, 6)).astype(np.float32))
    g = cp.asarray(rng.standard_normal((4, 6)).astype(np.float32))
    state = ar.init(w, cfg)
    delta, _ = ar.update(state, g, cfg, w, count=0)
    expected = w + delta
    ar.update_in_place(state, g, cfg, w, count=0)
    _assert_close(w, expected, "float32")


# ----------------------------------------------------------------------------- CPU: the engine's group kernels


def test_group_step_kernel_carries_the_update_kernels_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA group step kernel's arithmetic is, line for line, that of the CuPy route's fused update kernel,
    whose bits the CPU evaluation above checks against the reference: ``ADAM_ENTRY`` and the tail ``w + tail``."""
    from adadiag_ref.optim.families.adam import cupy_group

    monkeypatch.setattr(ck, "elementwise", lambda *source: source)
    for decay in (False, True):
        _, _, _, fused = adam_route._delta_kernel(decay)
        source = cupy_group.step_source("float32", decay)
        for line in adam_route.ADAM_ENTRY.splitlines():
            assert not line or line in source, line
        tail = ck.tail_expression("u", "w", decay)
        assert f"D = {tail};" in fused and f"wp[j] = w + {tail};" in source
        assert "const T x = reinterpret_cast<const T*>(g_at[lo])[j];" in source
        assert "const T m0 = M[i]; const T v0 = V[i]; const T w = wp[j];" in source
        assert "M[i] = m; V[i] = v;" in source
        assert "if (!proceed[0]) return;" in source
    moments = cupy_group.moments_source("float32")  # a rotated group's moments and U~ over its flat G~
    for line in adam_route.ADAM_ENTRY.splitlines():
        assert not line or line in moments, line
    assert "const T x = G[i]; const T m0 = M[i]; const T v0 = V[i];" in moments
    assert "M[i] = m; V[i] = v; G[i] = u;" in moments
    for decay in (False, True):  # the tail, D the group's flat direction
        tail = ck.tail_expression("D[i]", "w", decay)
        assert f"wp[j] = w + {tail};" in cupy_group.tail_source("float32", decay)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_group_kernel_sources_compile_with_nvrtc(
    cupy_nvrtc: Any, arch: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVRTC compiles the group kernels (step with and without decay, the NaN/Inf count) as ``cupy.RawKernel``
    compiles them, for ``compute_<arch>``, with the routes' options; the step's PTX has no fused multiply-add,
    IEEE division and square root, and no float64 in a float32 kernel."""
    from adadiag_ref.optim.families.adam import cupy_group

    sources = {cupy_group._name("step", dtype, d): cupy_group.step_source(dtype, d) for d in (False, True)}
    sources[cupy_group._name("nonfinite", dtype)] = cupy_group.nonfinite_source(dtype)
    sources[cupy_group._name("moments", dtype)] = cupy_group.moments_source(dtype)
    sources.update({cupy_group._name("tail", dtype, d): cupy_group.tail_source(dtype, d) for d in (False, True)})
    for name, source in sources.items():
        ptx, used = _nvrtc_ptx(source, ck.OPTIONS, arch, monkeypatch)
        assert "--fmad=false" in used
        (body,) = _ptx_entries(ptx).values()
        problems = _ptx_problems(body, dtype)
        if "nonfinite" in name:  # a comparison, no arithmetic of the dtype
            problems = [p for p in problems if not p.startswith("no ")]
        assert not problems, (name, problems)


_HOST_PRELUDE = """\
#include <cmath>
using std::isfinite;
using std::sqrt;
struct Dim3 { long long x; };
static const Dim3 blockIdx = {0}, blockDim = {1}, threadIdx = {0}, gridDim = {1};
static int atomicAdd(int* p, int v) { int old = *p; *p += v; return old; }
#define __global__
"""


def _host_library(sources: dict[str, str], tmp_path: Any) -> Any:
    """The kernels' CUDA sources compiled as C++ for the host (one thread walking the whole grid-stride loop),
    with IEEE arithmetic and no contraction (``-ffp-contract=off``, as ``--fmad=false``); skipped without g++."""
    import ctypes
    import shutil
    import subprocess

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("needs a C++ compiler (g++) to run the CUDA sources on the host")
    parts = []
    for name, source in sources.items():  # each its own typedef of T: one namespace-free unit per kernel
        parts.append(f"namespace k_{name} {{\n" + source.replace('extern "C" ', "") + "}\n")
        parts.append(f'extern "C" auto {name} = &k_{name}::{name};\n')
    (tmp_path / "kernels.cpp").write_text(_HOST_PRELUDE + "".join(parts))
    library = tmp_path / "kernels.so"
    command = [compiler, "-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-std=c++17",
               str(tmp_path / "kernels.cpp"), "-o", str(library)]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(library))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no-decay", "decay"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_group_kernels_run_on_the_host_give_the_engines_bits(dtype: str, weight_decay: float, tmp_path: Any) -> None:
    """The group kernels' CUDA sources, compiled as C++ and run on the host through the members' addresses,
    give the NumPy engine's bits (its numba group kernels: the reference's entry arithmetic) over several steps
    of AdamW, for members of many sizes; a false ``proceed`` writes nothing; the NaN/Inf count counts."""
    import ctypes

    from adadiag_ref.optim.families.adam import cupy_group
    from adadiag_ref.optim.families.adam.numba_route import kernel_scalars
    from adadiag_ref.optim.schedules import beta_hats, host_step

    pytest.importorskip("numba")
    decay = weight_decay != 0.0
    step_name, count_name = cupy_group._name("step", dtype, decay), cupy_group._name("nonfinite", dtype)
    lib = _host_library({step_name: cupy_group.step_source(dtype, decay),
                         count_name: cupy_group.nonfinite_source(dtype)}, tmp_path)  # fmt: skip
    step_fn, count_fn = (ctypes.cast(getattr(lib, n), ctypes.POINTER(ctypes.c_void_p)).contents for n in
                         (step_name, count_name))  # fmt: skip
    real = ctypes.c_double if dtype == "float64" else ctypes.c_float
    step = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 3, ctypes.c_int, ctypes.c_longlong, *[ctypes.c_void_p] * 3,
                            *[real] * 7)(step_fn.value)  # fmt: skip
    count = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 2, ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p)(
        count_fn.value
    )
    cfg = ar.make_config("adamw", weight_decay=weight_decay)
    rng = np.random.default_rng(4)
    shapes = [(30, 20), (1,), (7,), (), (5, 3, 2)]
    host = [rng.standard_normal(s).astype(dtype) for s in shapes]
    params = [p.copy() for p in host]
    engine = ar.Engine(params, cfg)  # NumPy: the numba group kernels
    assert engine._flat[0].kernels is not None
    mine = [p.copy() for p in host]
    sizes = [p.size for p in host]
    starts = np.cumsum([0, *sizes], dtype=np.int64)
    M, V = np.zeros(sum(sizes), dtype), np.zeros(sum(sizes), dtype)
    go = np.ones((), dtype=np.bool_)

    def at(arrays: list[np.ndarray]) -> np.ndarray:
        return np.array([a.ctypes.data for a in arrays], dtype=np.uint64)

    for t in range(4):
        grads = [rng.standard_normal(s).astype(dtype) for s in shapes]
        engine.step(grads, params)
        b1_t, b2_t = beta_hats(cfg, host_step(t, np.dtype(dtype), np), np)
        *sc, _ = kernel_scalars(b1_t, b2_t, cfg, cfg.lr, np.dtype(dtype))
        w_at, g_at = at(mine), at(grads)
        step(w_at.ctypes.data, g_at.ctypes.data, starts.ctypes.data, len(sizes), M.size, M.ctypes.data,
             V.ctypes.data, go.ctypes.data, *(float(x) for x in sc))  # fmt: skip
    for got, want in zip(mine, params, strict=True):
        np.testing.assert_array_equal(got, want)
    flat = engine.state(0)
    np.testing.assert_array_equal(M[: sizes[0]], np.ravel(flat.M, order="K"))  # the memory order
    # proceed false: nothing written
    frozen = [w.copy() for w in mine], M.copy(), V.copy()
    stop = np.zeros((), dtype=np.bool_)
    step(at(mine).ctypes.data, g_at.ctypes.data, starts.ctypes.data, len(sizes), M.size, M.ctypes.data,
         V.ctypes.data, stop.ctypes.data, *(float(x) for x in sc))  # fmt: skip
    for a, b in zip(mine, frozen[0], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(M, frozen[1])
    # the NaN/Inf count
    grads[1][0], grads[4][2, 1, 0], grads[0][29, 19] = np.nan, np.inf, -np.inf
    bad = np.zeros((), dtype=np.int32)
    count(at(grads).ctypes.data, starts.ctypes.data, len(sizes), M.size, bad.ctypes.data)
    assert int(bad) == 3


@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no-decay", "decay"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_group_tail_kernel_run_on_the_host_gives_the_tails_bits(dtype: str, weight_decay: float, tmp_path: Any) -> None:
    """A rotated group's tail kernel, compiled as C++ and run on the host: ``W <- W + (-eta)(D + lambda W)`` in
    each member's memory from the flat direction, the bits of the shared tail (``tail.decayed_step`` and the
    parameter update, NumPy); a false ``proceed`` writes nothing."""
    import ctypes

    from adadiag_ref.optim.families.adam import cupy_group
    from adadiag_ref.optim.tail import decayed_step

    cfg = ar.make_config("adadiag", weight_decay=weight_decay)
    decay = weight_decay != 0.0
    name = cupy_group._name("tail", dtype, decay)
    lib = _host_library({name: cupy_group.tail_source(dtype, decay)}, tmp_path)
    real = ctypes.c_double if dtype == "float64" else ctypes.c_float
    address = ctypes.cast(getattr(lib, name), ctypes.POINTER(ctypes.c_void_p)).contents.value
    tail = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong,
                            ctypes.c_void_p, ctypes.c_void_p, real, real)(address)  # fmt: skip
    rng = np.random.default_rng(6)
    params = [rng.standard_normal(s).astype(dtype) for s in [(9, 4), (), (13,)]]
    sizes = [p.size for p in params]
    D = rng.standard_normal(sum(sizes)).astype(dtype)
    eta = 3e-3
    flat_w = np.concatenate([p.ravel() for p in params])
    want = flat_w + decayed_step(D.copy(), flat_w, eta, cfg, owned=False)
    starts = np.cumsum([0, *sizes], dtype=np.int64)
    w_at = np.array([p.ctypes.data for p in params], dtype=np.uint64)
    neg_lr, wd = np.asarray(-eta, dtype)[()], np.asarray(weight_decay, dtype)[()]
    stop = np.zeros((), dtype=np.bool_)
    tail(w_at.ctypes.data, starts.ctypes.data, len(sizes), D.size, D.ctypes.data, stop.ctypes.data, neg_lr, wd)
    np.testing.assert_array_equal(np.concatenate([p.ravel() for p in params]), flat_w)
    go = np.ones((), dtype=np.bool_)
    tail(w_at.ctypes.data, starts.ctypes.data, len(sizes), D.size, D.ctypes.data, go.ctypes.data, neg_lr, wd)
    np.testing.assert_array_equal(np.concatenate([p.ravel() for p in params]), want)


# ----------------------------------------------------------------------------- CPU: the engine on the host kernels


_C_TYPES = {"int": "c_int", "long long": "c_longlong"}


def _parameters(source: str) -> list[str]:
    """The C types of a kernel's parameters, in order (``T*`` and every pointer: ``pointer``)."""
    head = source[source.index("(", source.index("__global__")) + 1 : source.index(")", source.index("__global__"))]
    kinds = []
    for parameter in head.split(","):
        words = parameter.replace("const ", "").split()
        kinds.append("pointer" if "*" in parameter else " ".join(words[:-1]))
    return kinds


class _HostLauncher:
    """A :class:`~adadiag_ref.optim.families.adam.cupy_group.CudaGroup` launcher that runs the CUDA kernels
    compiled as C++ on the host (:func:`_host_library`) over host memory: an engine on NumPy or ``array_api_strict``
    arrays, or the torch adapter over CPU tensors, as ``TorchCudaLauncher`` over CUDA ones (``xp``: the namespace
    of the small arrays it makes)."""

    def __init__(self, tmp_path: Any, xp: Any) -> None:
        self.tmp_path, self.xp, self.functions = tmp_path, xp, {}
        self.launches: list[str] = []

    @staticmethod
    def host(a: Any) -> np.ndarray:
        """The NumPy view of ``a``'s memory: a NumPy array, an ``array_api_strict`` array's, a torch CPU tensor's."""
        if isinstance(a, np.ndarray):
            return a
        detach = getattr(a, "detach", None)
        return a._array if detach is None else detach().numpy()

    def address(self, a: Any) -> int | None:
        x = self.host(a)
        return int(x.ctypes.data) if x.flags.c_contiguous else None

    def upload(self, table: np.ndarray) -> Any:
        return self.xp.asarray(table.astype(np.int64))

    def zeros_int32(self) -> Any:
        return self.xp.zeros((), dtype=self.xp.int32)

    def true(self) -> Any:
        return self.xp.ones((), dtype=self.xp.bool)

    def launch(self, name: str, source: str, grid: int, args: tuple[Any, ...]) -> None:
        import ctypes

        if name not in self.functions:
            (self.tmp_path / name).mkdir()
            lib = _host_library({name: source}, self.tmp_path / name)
            kinds = _parameters(source)
            real = ctypes.c_double if "typedef double T" in source else ctypes.c_float
            types = [ctypes.c_void_p if k == "pointer" else real if k == "T" else getattr(ctypes, _C_TYPES[k])
                     for k in kinds]  # fmt: skip
            address = ctypes.cast(getattr(lib, name), ctypes.POINTER(ctypes.c_void_p)).contents.value
            self.functions[name] = (lib, ctypes.CFUNCTYPE(None, *types)(address), kinds)
        _, function, kinds = self.functions[name]
        assert len(args) == len(kinds), (name, kinds)
        values = [self.host(a).ctypes.data if k == "pointer" else a.item() for a, k in zip(args, kinds, strict=True)]
        self.launches.append(name)
        function(*values)


SCHEDULED = [((0.9, 0.999), 0.1), ((0.85, 0.99), 0.05), ((0.95, 0.999), 0.2), ((0.3, 0.5), 0.1), ((0.9, 0.9), 0.01)]
"""A scheduler's per-step ``(betas, weight_decay)``, the decay kept on (the CUDA kernel variant probed)."""


@pytest.mark.parametrize("scheduled", [False, True], ids=["own", "scheduled"])
@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
def test_the_engine_on_the_cuda_group_kernels_run_on_the_host(
    name: str, check: bool, scheduled: bool, tmp_path: Any
) -> None:
    """The engine with the CUDA group kernels (``CudaGroup``, the CuPy and torch launchers' code) launched on the host,
    over ``array_api_strict`` arrays: every step the bits of per-parameter ``ar.step`` (AdamW: the whole step by the
    kernels; AdaDiag and AdaDiag++: the moments in place and the tail), the verdict left on the "device", gating
    the launches, and read after them; then a NaN at a step without refresh: the launches it gated wrote nothing
    (the moments included), and the error names the parameter.  ``scheduled``: every step with its own betas and
    weight decay, the kernels' scalars of that step; a step turning the decay off is not the kernels' to take."""
    from adadiag_ref.optim.families.adam.cupy_group import CudaGroup

    xs = pytest.importorskip("array_api_strict")
    if not any(os.access(os.path.join(d, "g++"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("needs g++")
    cfg = ar.make_config(name, update_freq=3, weight_decay=0.1)
    rng = np.random.default_rng(7)
    shapes = [(8, 8), (8, 20), (20, 8), (20,), ()]
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [xs.asarray(p.copy()) for p in host]
    engine = ar.Engine(params, cfg)
    launcher = _HostLauncher(tmp_path, xs)
    for group in engine._flat:
        group.kernels = CudaGroup(cfg, "float32", [m.size for m in group.members], launcher)
    singles, states = [xs.asarray(p.copy()) for p in host], [ar.init(xs.asarray(p.copy()), cfg) for p in host]
    stream = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(5)]
    moments_launched = []
    for k, grads in enumerate(stream):
        hyper = dict(zip(("betas", "weight_decay"), SCHEDULED[k], strict=True)) if scheduled else {}
        before = launcher.launches.count("adadiag_adam_group_moments_float32")
        engine.step([xs.asarray(g) for g in grads], params, check=check, **hyper)
        moments_launched.append(launcher.launches.count("adadiag_adam_group_moments_float32") > before)
        pairs = [ar.step(s, xs.asarray(g), cfg, w, count=k, **hyper)
                 for s, g, w in zip(states, grads, singles, strict=True)]  # fmt: skip
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
    kinds = {n.split("_")[3] for n in launcher.launches}  # adadiag_adam_group_<kind>...
    if name == "adamw":
        assert kinds == ({"nonfinite", "step"} if check else {"step"}), kinds
    else:  # the moments in place at every step, gated by the verdict where it is left on the device
        assert kinds == {"moments", "tail"}, kinds
        assert moments_launched == [True] * 5, moments_launched
    if scheduled:
        group = engine._flat[0]
        members = [params[m.index] for m in group.members]
        assert group.kernels.prepare(members, None, 1e-3, cfg.replace(weight_decay=0.0)) is None
    for i, (w, want) in enumerate(zip(params, singles, strict=True)):
        np.testing.assert_array_equal(np.asarray(w._array), np.asarray(want._array))
        for field in ("M", "V"):
            np.testing.assert_array_equal(getattr(engine.state(i), field)._array, getattr(states[i], field)._array)
    if not check:
        return
    before = [p._array.copy() for p in params] + [engine.state(i).M._array.copy() for i in range(len(params))]
    bad = [xs.asarray(g) for g in stream[0]]
    bad[3] = xs.asarray(np.where(np.arange(20) == 4, np.nan, stream[0][3]).astype(np.float32))
    launched = len(launcher.launches)
    with pytest.raises(ValueError, match=r"1 NaN or Inf entry in the gradient of parameter \(shape \(20,\)\)"):
        engine.step(bad, params)  # t = 6: no refresh (T = 3 refreshes at t = 1, 4, 7): the verdict is deferred
    assert len(launcher.launches) > launched  # the kernels were launched, gated by the device verdict
    after = [p._array for p in params] + [engine.state(i).M._array for i in range(len(params))]
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_engines_gated_kernels_run_again_when_an_overflowing_sum_was_only_a_suspicion(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a device the engine's verdict is a sum per gathered group, which overflows on finite entries of about
    ``3e38`` in float32: then the verdict is false, the gated kernels (an unrotated group's step, a rotated group's
    tail) wrote nothing, and the exact test finds no NaN or Inf.  The kernels must run again ungated: every step
    equals per-parameter ``ar.step`` (before, the parameters of that step were silently left unchanged while their
    moments and counters advanced).  The CUDA group kernels compiled for the host, over ``array_api_strict``."""
    from adadiag_ref.optim.families.adam import cupy_group

    xs = pytest.importorskip("array_api_strict")
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    cfg = ar.make_config("adadiag", update_freq=3, weight_decay=0.1, max_basis_dim=8)
    rng = np.random.default_rng(7)
    shapes = [(8, 8), (20,), (9, 20)]  # rotated (a tail kernel); (9, 20) unrotated, a group of its own (a step kernel)
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [xs.asarray(p.copy()) for p in host]
    launcher = _HostLauncher(tmp_path, xs)
    monkeypatch.setattr(cupy_group, "_READY", {})
    monkeypatch.setattr(cupy_group, "launcher_for", lambda cfg, dtype, device, xp: launcher)  # as for CuPy arrays
    engine = ar.Engine(params, cfg)
    assert len(engine._flat) == 2 and all(group.kernels is not None for group in engine._flat)
    launcher.launches.clear()  # the probe's
    singles, states = [xs.asarray(p.copy()) for p in host], [ar.init(xs.asarray(p.copy()), cfg) for p in host]
    stream = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    stream[1][0][0, :] = np.float32(3e38)  # t = 2, no refresh: the rotated group's float32 sum overflows
    for k, grads in enumerate(stream):
        with np.errstate(over="ignore", invalid="ignore"):
            engine.step([xs.asarray(g) for g in grads], params)
            pairs = [ar.step(s, xs.asarray(g), cfg, w, count=k)
                     for s, g, w in zip(states, grads, singles, strict=True)]  # fmt: skip
        singles, states = [w for w, _ in pairs], [s for _, s in pairs]
        for i, (w, want) in enumerate(zip(params, singles, strict=True)):
            np.testing.assert_array_equal(w._array, want._array, err_msg=f"step {k}, parameter {i}")
            np.testing.assert_array_equal(engine.state(i).V._array, states[i].V._array)
    kinds = [n.split("_")[3] for n in launcher.launches]
    assert kinds.count("step") == 4 and kinds.count("tail") == 4, kinds  # t = 2 twice: gated, then ungated


def _torch_host_launcher(tmp_path: Any) -> _HostLauncher:
    """:class:`_HostLauncher` over torch CPU tensors, its small arrays torch tensors."""
    import torch

    return _HostLauncher(tmp_path, namespace(torch.zeros(())))


@contextlib.contextmanager
def _adapter_engines_on(launcher: Any, on: list[bool]) -> Iterator[None]:
    """The torch adapter's engines over CPU tensors take the CUDA group kernels through ``launcher`` (compiled for
    the host) while ``on[0]``, as they take them over CUDA tensors where CuPy is installed; else the numba kernels.
    The kernels' probe is run afresh."""
    from adadiag_ref.optim.families.adam import cupy_group, group_route

    host_dtype = group_route._host_dtype
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cupy_group, "_READY", {})
        patch.setattr(cupy_group, "launcher_for", lambda cfg, dtype, device, xp: launcher if on[0] else None)
        patch.setattr(group_route, "_host_dtype", lambda *args: None if on[0] else host_dtype(*args))
        yield


@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no-decay", "decay"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp"])
def test_the_torch_adapters_engine_steps_a_group_by_the_cuda_group_kernels(
    name: str, dtype: str, weight_decay: float, tmp_path: Any
) -> None:
    """The torch adapter steps its parameters through its group's engine on every device; on CUDA with CuPy the
    engine's groups take the CUDA group kernels (here the CUDA sources compiled for the host, launched over CPU
    tensors by address, as ``TorchCudaLauncher`` launches them over CUDA ones).  Against the same adapter on the
    numba kernels: the same bits, every parameter and moment at every step, refresh steps included, and
    ``routes()`` names the CUDA kernels.  Then a NaN: the error names the parameter, and nothing changed."""
    torch = pytest.importorskip("torch")
    from adapters import pytorch as tp

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    launcher = _torch_host_launcher(tmp_path)
    rng = np.random.default_rng(3)
    # (6, 5): rotated by AdaDiag(PP); (9, 20) and (20, 9) unrotated (max_basis_dim=8); (20,) and (): vectors
    shapes = [(6, 5), (9, 20), (20, 9), (20,), ()]
    values = [rng.standard_normal(s).astype(dtype) for s in shapes]
    stream = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(7)]
    options = {"lr": 1e-2, "weight_decay": weight_decay, "update_freq": 3}
    if name != "adamw":
        options["max_basis_dim"] = 8
    on = [False]
    runs = []
    with _adapter_engines_on(launcher, on):
        for kernels in (False, True):
            params = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in values]
            runs.append((tp.optimizer_class(name)(params, **options), params, kernels))

        def step_both(grads: list[np.ndarray]) -> None:
            for opt, params, kernels in runs:
                for p, g in zip(params, grads, strict=True):
                    p.grad = torch.from_numpy(g.copy())
                on[0] = kernels
                opt.step()

        for grads in stream:
            step_both(grads)
            (ref, ref_params, _), (opt, params, _) = runs
            for k, (q, p) in enumerate(zip(ref_params, params, strict=True)):
                np.testing.assert_array_equal(p.detach().numpy(), q.detach().numpy(), err_msg=f"parameter {k}")
                for field in ("M", "V", "step"):
                    np.testing.assert_array_equal(opt.state[p][field].numpy(), ref.state[q][field].numpy())
        on[0] = True
        engines = [entry["engine"] + entry["moments"] for entry in runs[1][0].routes().values()]
        assert all("cupy_group" in route for route in engines), engines
        kinds = {n.split("_group_")[1].rsplit("_", 1)[0] for n in launcher.launches}
        assert kinds >= {"nonfinite", "step" + ("_decay" if weight_decay else "")}, kinds
        if name != "adamw":
            assert "tail" + ("_decay" if weight_decay else "") in kinds, kinds

        bad = [g.copy() for g in stream[0]]
        bad[1].flat[4] = np.nan
        opt, params, _ = runs[1]
        before = [p.detach().numpy().copy() for p in params] + [
            opt.state[p][f].numpy().copy() for p in params for f in ("M", "V", "step")
        ]
        for p, g in zip(params, bad, strict=True):
            p.grad = torch.from_numpy(g.copy())
        with pytest.raises(ValueError, match=r"gradient of parameter 1 of param_groups\[0\] contains NaN or Inf"):
            opt.step()
        after = [p.detach().numpy() for p in params] + [
            opt.state[p][f].numpy() for p in params for f in ("M", "V", "step")
        ]
        for x, y in zip(before, after, strict=True):
            np.testing.assert_array_equal(x, y)


class _RaisingLauncher(_HostLauncher):
    """A launcher whose kernels cannot be built (as with a compiler or a CuPy the device cannot use)."""

    def launch(self, name: str, source: str, grid: int, args: tuple[Any, ...]) -> None:
        raise RuntimeError("NVRTC_ERROR_BUILTIN_OPERATION_FAILURE")


class _SilentLauncher(_HostLauncher):
    """A launcher whose launches do nothing (as kernels handed wrong pointers might)."""

    def launch(self, name: str, source: str, grid: int, args: tuple[Any, ...]) -> None:
        self.launches.append(name)


@pytest.mark.parametrize(("launcher_type", "why"), [(_RaisingLauncher, "RuntimeError: NVRTC"),
                                                    (_SilentLauncher, "step gave")])  # fmt: skip
def test_group_kernels_that_fail_their_probe_leave_the_engines_gathering_path_to_step(
    launcher_type: type, why: str, tmp_path: Any
) -> None:
    """Kernels that raise at their first launch, or give other bits than the namespace's own operations, are probed
    once (its launches over two tiny members), warn once (``RuntimeWarning`` naming the device and the reason) and
    are not used: the adapter's engine takes its gathering path (the reference's arithmetic), the routes say so, and
    the trajectory is that of the adapter on the numba kernels, bit for bit."""
    torch = pytest.importorskip("torch")
    from adapters import pytorch as tp

    launcher = launcher_type(tmp_path, namespace(torch.zeros(())))
    on = [False]
    runs = []
    with _adapter_engines_on(launcher, on):
        for kernels in (False, True):
            on[0] = kernels
            params = [torch.nn.Parameter(torch.ones(s)) for s in [(3, 4), (5,)]]
            opt = tp.AdaDiag(params, lr=0.1, update_freq=3)
            for k in range(4):
                for p in params:
                    p.grad = torch.full(p.shape, 0.5 + k)
                if kernels and not k:
                    with pytest.warns(RuntimeWarning, match=f"CUDA group kernels failed their probe on cpu .*{why}"):
                        opt.step()
                else:
                    opt.step()
            runs.append((params, opt))
        routes = [r["engine"] + r["moments"] for r in runs[1][1].routes().values()]
    assert len(launcher.launches) <= 3  # the probe's, once
    (ref_params, _), (params, opt) = runs
    assert all(torch.equal(p, q) for p, q in zip(ref_params, params, strict=True))
    assert not any("cupy_group" in route for route in routes), routes


@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["no-decay", "decay"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_probe_passes_the_kernels_and_refuses_launches_that_write_nothing(
    dtype: str, weight_decay: float, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cupy_group.probe``: the three launches (``step``, ``moments``, ``tail``), compiled for the host, equal
    the same arithmetic in the namespace's own operations (here ``array_api_strict``, as the engine's CuPy or torch
    arrays on a GPU); ``ready`` then says yes, once.  A launcher whose launches write nothing fails the probe: one
    warning, ``False``, and the engine's factory would give no kernels."""
    from adadiag_ref.optim.families.adam import cupy_group

    xs = pytest.importorskip("array_api_strict")
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    cfg = ar.make_config("adamw", weight_decay=weight_decay)
    launcher = _HostLauncher(tmp_path, xs)
    assert cupy_group.probe(cupy_group.CudaGroup(cfg, dtype, [1, 2], launcher), xs, None) is None
    assert {n.split("_group_")[1].rsplit("_", 1)[0] for n in launcher.launches} == {
        f"step{'_decay' if weight_decay else ''}", "moments", f"tail{'_decay' if weight_decay else ''}"}  # fmt: skip
    monkeypatch.setattr(cupy_group, "_READY", {})
    assert cupy_group.ready(cfg, dtype, launcher, xs, None)

    class WritesNothing(_HostLauncher):
        def launch(self, name: str, source: str, grid: int, args: tuple[Any, ...]) -> None:
            self.launches.append(name)

    with pytest.warns(RuntimeWarning, match="failed their probe on None .*step gave"):
        assert not cupy_group.ready(cfg, dtype, WritesNothing(tmp_path, xs), xs, None)
    assert not cupy_group.ready(cfg, dtype, WritesNothing(tmp_path, xs), xs, None)  # answered once, no new warning


@pytest.fixture(scope="module")
def torch_host_launcher(tmp_path_factory: Any) -> Any:
    """One :func:`_torch_host_launcher` for the module: each kernel compiled for the host once."""
    pytest.importorskip("torch")
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    return _torch_host_launcher(tmp_path_factory.mktemp("host_kernels"))


@settings(max_examples=20)
@given(
    shapes=st.lists(
        st.sampled_from([(), (1,), (7,), (3, 5), (5, 3), (9, 4), (2, 3, 4), (1, 6)]), min_size=1, max_size=5
    ),
    name=st.sampled_from(["adamw", "adadiag", "adadiag_pp"]),
    dtype=st.sampled_from(["float32", "float64"]),
    lr=st.sampled_from([1e-3, 0.3]),
    betas=st.sampled_from([(0.9, 0.999), (0.5, 0.9), (0.0, 0.0)]),
    eps=st.sampled_from([1e-8, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.1]),
    maximize=st.booleans(),
    max_basis_dim=st.sampled_from([8192, 4]),
)
def test_property_the_cuda_group_kernels_give_the_engines_bits(
    torch_host_launcher: Any,
    shapes: list[tuple[int, ...]],
    name: str,
    dtype: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    maximize: bool,
    max_basis_dim: int,
) -> None:
    """Any parameter shapes (0-d, vectors, wide, tall, conv-like, repeated), hyperparameters and ``maximize``: the
    torch adapter's engine on the CUDA group kernels (compiled for the host, launched over CPU tensors) gives its
    bits on the numba kernels at every step, refresh steps included; a ``max_basis_dim`` of 4 leaves the larger
    matrices unrotated (a group of their own)."""
    import torch

    from adapters import pytorch as tp

    on = [False]
    options: dict[str, Any] = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                               "maximize": maximize, "update_freq": 3}  # fmt: skip
    if name != "adamw":
        options["max_basis_dim"] = max_basis_dim
    gen = torch.Generator().manual_seed(len(shapes))
    start = [torch.randn(s, generator=gen, dtype=getattr(torch, dtype)) for s in shapes]
    stream = [[torch.randn(s, generator=gen, dtype=getattr(torch, dtype)) for s in shapes] for _ in range(5)]
    runs = []
    launched = len(torch_host_launcher.launches)
    with _adapter_engines_on(torch_host_launcher, on), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed probe would leave the kernels untested
        for kernels in (False, True):
            on[0] = kernels
            params = [torch.nn.Parameter(w.clone()) for w in start]
            opt = tp.optimizer_class(name)(params, **options)
            for grads in stream:
                for p, g in zip(params, grads, strict=True):
                    p.grad = g.clone()
                opt.step()
            runs.append((params, opt))
    assert len(torch_host_launcher.launches) >= launched + 5  # a launch at every step at least
    (ref_params, ref), (params, opt) = runs
    for q, p in zip(ref_params, params, strict=True):
        np.testing.assert_array_equal(p.detach().numpy(), q.detach().numpy())
        for field in ("M", "V"):
            np.testing.assert_array_equal(opt.state[p][field].numpy(), ref.state[q][field].numpy())


def test_the_cuda_group_factory_declines_what_it_cannot_launch() -> None:
    """No CUDA group kernels for NumPy, CPU torch tensors, ``kernels="reference"`` or float16: the factory says
    ``None`` (the numba kernels, or the gathering path, take those), without importing CuPy."""
    from adadiag_ref.optim.families.adam.cupy_group import engine_group

    cfg = ar.make_config("adamw")
    assert engine_group(cfg, np.float32, [3], "cpu", namespace(np.zeros(1))) is None
    torch = pytest.importorskip("torch")
    xp_torch = namespace(torch.zeros(1))
    assert engine_group(cfg, torch.float32, [3], torch.device("cpu"), xp_torch) is None
    assert engine_group(ar.make_config("adamw", kernels="reference"), torch.float32, [3], torch.device("cuda"),
                        xp_torch) is None  # fmt: skip
    assert engine_group(cfg, torch.float16, [3], torch.device("cuda"), xp_torch) is None


@pytest.mark.parametrize("kernels", [False, True], ids=["gathering-path", "cuda-kernels"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", ["adamw", "adadiag", "adadiag_pp", "adafacdiag"])
def test_the_torch_adapter_on_the_engines_device_path_emulated_on_the_cpu(
    name: str, dtype: str, kernels: bool, tmp_path: Any
) -> None:
    """The torch adapter's default route on CUDA, run on the CPU: its engines take their device path (the engine
    told that CPU tensors are off the host: batched GEMMs over stacks, the verdict left on the "device", a
    per-parameter family's stacks), without group kernels (CUDA without CuPy) or with the CUDA sources compiled for
    the host (CUDA with CuPy).  Against the same adapter on the host path: AdamW bit for bit, the rotated and
    factored optimizers to rounding (batched against single GEMMs; float64 1e-12, float32 1e-5 relative, the
    tolerances of the engine's own device tests; bfloat16 parameters, whose float32 states no group kernel takes,
    to a bfloat16 rounding); refresh steps included.  Then a NaN: the error names the
    parameter, and no parameter and no state changed."""
    torch = pytest.importorskip("torch")
    from adadiag_ref.optim import engine as engine_module
    from adapters import pytorch as tp

    if kernels and shutil.which("g++") is None:
        pytest.skip("needs g++")
    launcher = _torch_host_launcher(tmp_path) if kernels else None
    rng = np.random.default_rng(5)
    shapes = [(6, 5), (5, 6), (9, 20), (20,), ()]
    host_dtype = "float32" if dtype == "bfloat16" else dtype
    values = [rng.standard_normal(s).astype(host_dtype) for s in shapes]
    stream = [[rng.standard_normal(s).astype(host_dtype) for s in shapes] for _ in range(6)]

    def tensor(x: np.ndarray) -> Any:
        return torch.from_numpy(x.copy()).to(getattr(torch, dtype))

    options: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "update_freq": 3}
    if name != "adamw":
        options["max_basis_dim"] = 8
    on = [False]
    host = engine_module._in_host_memory
    runs = []
    with _adapter_engines_on(launcher, on), pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed probe would leave the kernels untested
        patch.setattr(engine_module, "_in_host_memory", lambda xp, a: host(xp, a) and not on[0])
        for device_path in (False, True):
            on[0] = device_path
            params = [torch.nn.Parameter(tensor(v)) for v in values]
            opt = tp.optimizer_class(name)(params, **options)
            for grads in stream:
                for p, g in zip(params, grads, strict=True):
                    p.grad = tensor(g)
                opt.step()
            runs.append((params, opt))
        (ref_params, ref), (params, opt) = runs
        tol = {"rtol": 1e-12, "atol": 1e-14} if dtype == "float64" else {"rtol": 1e-5, "atol": 1e-6}
        for q, p in zip(ref_params, params, strict=True):
            if name == "adamw":
                assert torch.equal(p, q)
            torch.testing.assert_close(p, q, **({} if dtype == "bfloat16" else tol))
            assert set(opt.state[p]) == set(ref.state[q])
            for field, value in opt.state[p].items():
                torch.testing.assert_close(value, ref.state[q][field], **tol)
        routes = list(opt.routes().values())
        taken = kernels and name != "adafacdiag" and dtype != "bfloat16"  # the group kernels: the state's dtype
        assert all(("cupy_group" in r["engine"] + r["moments"]) == taken for r in routes), routes
        if name in ("adadiag", "adadiag_pp"):  # the device path's GEMMs: one per stack
            assert all("xp.matmul on the stack" in r["rotate"] for r in routes[:2]), routes
        if taken and name in ("adadiag", "adadiag_pp"):  # the adapter steps with check=False: no verdict pending,
            moments = [n for n in launcher.launches if "_group_moments_" in n]  # the moments in place at every step
            assert len(moments) == len(stream) + 1, launcher.launches  # and the probe's
        bad = [g.copy() for g in stream[0]]
        bad[2].flat[3] = np.nan
        for clean_first in (False, True):  # at t = 7, a refresh step; then t = 7 without the NaN, t = 8 with it
            if clean_first:
                for p, g in zip(params, stream[1], strict=True):
                    p.grad = tensor(g)
                opt.step()
            before = [p.detach().clone() for p in params] + [t.clone() for p in params for t in opt.state[p].values()]
            for p, g in zip(params, bad, strict=True):
                p.grad = tensor(g)
            with pytest.raises(ValueError, match=r"gradient of parameter 2 of param_groups\[0\] contains NaN or Inf"):
                opt.step()
            after = [p.detach() for p in params] + [t for p in params for t in opt.state[p].values()]
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
