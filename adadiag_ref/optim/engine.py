r"""The multi-parameter engine: one stateful object that steps every parameter of a model (issue 31).

Per parameter it computes what :func:`~adadiag_ref.step` computes (``docs/spec.md``)::

    refresh (t = 1 or (t - 1) mod T == 0):  P, _, Q = canonical_svd(G)
    G~      = P^T G Q
    U~, M_t, V_t = family.direction(S_{t-1}, G~, t)
    W_{t+1} = W_t - eta_t (P U~ Q^T + lambda W_t)

What it adds is the organisation a device backend needs (each call on an array a kernel launch, each value read
back a synchronisation), decided once, when the engine is built:

* **groups**: the parameters are grouped by (family, state dtype, parameter dtype, device, kind, steps taken).
  The kind is ``flat`` for a family whose rule is entrywise (:attr:`~adadiag_ref.optim.families.FamilySpec.
  entrywise`, the Adam family or a registered entrywise family) and ``per-parameter`` otherwise (Adafactor,
  Hfac: their factored moments sum rows and columns).
* **flat state**: a flat group owns one flat array per moment field (``M``, ``V``), every parameter's moment a
  view of its slice, stored in the parameter's memory order (a tall parameter's work-frame moment is the
  transposed view, as :func:`~adadiag_ref.init` makes it).  Within a group the parameters are ordered by
  *rotation block*: the rotated ones sharing a memory shape ``a x b`` and rotated sides are adjacent, so that
  the gradients of a block, sliced from the group's flat gradient, are one contiguous stack of ``k`` matrices
  (a ``batch_dims`` stack counts its ``prod(B)`` matrices), and the block's bases are one stack ``(k, m, m)``
  (``(k, n, n)``).  The family's direction function is functional (it returns new moments), so a step
  *replaces* a group's flat moment arrays by the ones it returns (O(1) per group; nothing is concatenated per
  step for the state): a state handed out by :meth:`Engine.state` is a snapshot that later steps do not
  change.
* **routes resolved once**: the code of each part of a step is chosen per group when the engine is built
  (:meth:`Engine.routes`, :func:`explain_route`): the family's first applicable direction route for the flat
  group (numba on NumPy, the CuPy kernels on CuPy; probed once on a one-entry group), else its reference.
* **a host step counter** per group (a Python int): the refresh schedule and every coefficient come from it,
  never from a device counter.

One step of a flat group (:meth:`Engine.step`), whatever the number of its parameters:

1. ``G`` and ``W`` gathered into flat arrays by one concatenation each (of reshape views): into the group's
   scratch, allocated on first use, where the backend's ``concatenate`` writes into ``out=`` (NumPy, CuPy, torch), a new
   array of ``xp.concat`` otherwise (``array_api_strict``, JAX: no such call); cast to the state dtype once;
2. per rotation block, ``G~ = P^T G Q`` as batched GEMMs over the block's stack (``matmul`` on stacks on a
   device; in host memory one GEMM per matrix, as :func:`~adadiag_ref.optim.rotation.rotate` calls it, so the
   reference's bits: NumPy's BLAS per matrix, ``torch.mm``; on a refresh step set to its exact structure,
   :func:`~adadiag_ref.optim.core.refresh_step_structure`, per matrix), and ``G~`` of the group assembled by one
   concatenation;
3. ``U~, M_t, V_t`` by the group's direction route, once over the flat group, with the step's coefficients
   computed on the host from the counter (:func:`~adadiag_ref.optim.schedules.host_step`);
4. per block, ``P U~ Q^T`` by batched GEMMs; the directions assembled by one concatenation;
5. the tail ``delta = -eta_t (D + lambda W_t)`` once over the group
   (:func:`~adadiag_ref.optim.tail.decayed_step`, the expressions :func:`~adadiag_ref.optim.tail.parameter_delta`
   uses) and ``W_{t+1} = W_t + delta`` in the parameter dtype.

A group without rotation blocks (AdamW; every member unrotated) takes steps 3 and 5 in one call where its family
has a fused update route that applies (numba on NumPy, the CuPy kernels on CuPy: the one
:func:`routed_update` takes for one unrotated parameter), over the flat group as one ``1 x N``
matrix: moments, direction and tail in one kernel, the same per-entry arithmetic.

Where its family has *group kernels* for the backend and dtype (:class:`~adadiag_ref.optim.families.registry.
GroupKernels`: the Adam family's numba kernels on NumPy and CPU torch tensors, its CUDA kernels on CuPy), such a
group is stepped in place instead, by :meth:`Engine.step` with ``in_place=True`` (the default): the kernels walk
the members' own arrays by address, so nothing is gathered and nothing written back; one call counts the gradients'
NaN and Inf (the check), one call writes ``W``, ``M`` and ``V``: 7 array passes per entry (+1 for the check) where
the gathering path makes 16 (+1).  On a device the step's launch takes the verdict as a device flag and writes
nothing where it is false, so the one read-back still comes after everything is queued.
The same per-entry arithmetic, so the same bits; a step's own betas and weight decay are the kernels' scalars of
that step.  A step whose arrays the kernels do not take (a strided view, an array learning rate),
``in_place=False`` and :func:`~adadiag_ref.multi_step` take the gathering path.  A state handed out by
:meth:`Engine.state` stays a snapshot: the group's next in-place step first copies its moments.
Where a rotated optimizer has unrotated members (a side above ``cfg.max_basis_dim``: ``P = I``) and the kernels
apply to them, they form a group of their own, stepped so.  A group with rotation blocks still gathers ``G`` (one
stack per block for the batched GEMMs), but its kernels write the tail ``W <- W + (-eta)(D + lambda W)`` through
the members' addresses from the flat direction ``D``: ``W`` is neither gathered nor written back.  Group kernels
serve a family whose step size is its learning rate (:func:`~adadiag_ref.optim.families.common.
constant_step_size`).  The gathering scratch is allocated on first use, so a group its kernels step holds none.

A per-parameter group (Adafactor, Hfac) is split into *stacks*, one per parameter shape: the parameters of one
shape are stepped as one ``batch_dims`` stack (``cfg.batch_dims + 1``; each matrix its own factored moments, as
``batch_dims`` defines), so that one :func:`routed_update` (the family's routes tried per call, else the
reference) serves all of them: the stacked ``G`` and ``W`` are one ``stack`` call each, and the number of calls
of a step no longer grows with the number of layers.  A stack's state is kept stacked; :meth:`Engine.state` hands out a
member's slice.  On the CPU (NumPy, torch CPU tensors) every parameter is a stack of one: no launches to save,
and NumPy's fused numba update kernels take single matrices only (:func:`_in_host_memory`).

The refreshes due at a step are one :func:`~adadiag_ref.refresh_bases` call for every parameter of the engine
(one stacked decomposition per work shape on a device backend; only singular values go to the host).

**The finiteness check** (``check=True``): one reduced verdict for all parameters (a sum of every gradient per
group, all of them stacked), read back once: at most one device-to-host conversion per step.  On a step without
refresh the verdict is read *after* the step's work is queued: everything is computed into new arrays first (the
group kernels' in-place writes take the verdict as a device flag and write nothing where it is false), the
verdict read, and only then committed (moments and bases replaced, counters advanced, parameters written).
A non-finite verdict is examined exactly per gradient (only on that error path) and raises ``ValueError``
naming the first parameter whose gradient holds NaN or Inf; no state and no parameter has changed.  When it finds
none (finite entries whose sum overflowed), nothing has been written, and the step is taken again unchecked.  On a
refresh step the verdict is read before the decompositions (LAPACK never sees NaN or Inf).  On NumPy (no
device) it is read first, always.  ``check=False``: nothing is read back on a step without refresh, and a
non-finite gradient propagates as in :func:`~adadiag_ref.step`.

Backends: any array-API namespace.  NumPy, torch and CuPy parameters are written in place; so are
``array_api_strict``'s (``x[...] = value``, which its arrays support).  JAX arrays are immutable: the engine
steps them functionally (``step(..., in_place=False)``, the default for JAX, returns the new parameters).  The
engine runs one config for all of its parameters.

The engine is the only code that runs the families' fast routes (:class:`~adadiag_ref.optim.families.Routes`):
the reference (:func:`~adadiag_ref.update`, :func:`~adadiag_ref.step`) never tries one.  Results: per parameter
those of :func:`~adadiag_ref.step` with the same count, bit for bit where the engine takes the reference
arithmetic (``kernels="reference"``, and any backend without kernels, e.g. ``array_api_strict``) or a fused route
(the Adam family's update and group kernels, on NumPy and CPU torch: the same formulas in the same order, and in
host memory one GEMM per matrix); to rounding where a direction kernel sums in another order (Adafactor's and
Hfac's factored statistics on NumPy and CuPy), and on a device, where batched GEMMs and stacked decompositions
round otherwise than single ones.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from array_api_compat import is_jax_namespace, is_numpy_namespace, is_torch_namespace

from .._xp import Array, Namespace, count_nonfinite, creation_device, float_dtype_name, namespace, native_module
from ..config import BaseConfig, check_learning_rate, step_config
from .batched_refresh import host_counts, refresh_bases
from .blas_threads import run_balanced, spreads
from .core import (
    _check_static,
    _where,
    check_gradient_matches,
    init,
    prepare_step,
    refresh_due,
    refresh_step_structure,
    update_prepared,
    work_dtype,
)
from .families import FamilySpec, Moments, State, family_of
from .families.common import constant_step_size
from .families.registry import GroupKernels
from .layout import Layout, flatten_in_memory_order, from_work, layout_for, memory_shape, work_view
from .rotation import _product, unrotate
from .schedules import host_step, learning_rate
from .tail import decayed_step

__all__ = ["Engine", "Route", "explain_route", "routed_direction", "routed_update"]

Key = Any  # a parameter's key: its mapping key, its name, or its index


class Route(NamedTuple):
    """Which code runs each part of one parameter's step (:meth:`Engine.routes`), in words.

    Attributes:
        group: the parameter's group: its kind (``flat`` or ``per-parameter``), family, dtypes, device, size.
        refresh: the code of a refresh step's decomposition (batched over a stack, or per parameter), or none.
        rotate: ``G~ = P^T G Q``: batched GEMMs over the stack of the parameter's rotation block, or none.
        unrotate: ``P U~ Q^T``: likewise.
        entrywise: moments, direction and tail: the direction function over the flat group and the shared tail,
            or the per-parameter ``update``.
    """

    group: str
    refresh: str
    rotate: str
    unrotate: str
    entrywise: str


@dataclass(frozen=True)
class _Member:
    """One parameter of a flat group: where its entries lie in the group's flat arrays."""

    index: int  # its position in the engine's order
    layout: Layout
    offset: int  # first entry in the group's flat arrays
    size: int
    block: int | None  # its rotation block, None when no side rotates
    slot: int  # its first matrix in the block's stack
    matrices: int  # prod(B) of a stack (batch_dims), else 1
    param_shape: Array | None  # the state's zero-size shape record, kept as given


class _Block:
    """The rotated parameters of a flat group sharing a memory shape ``a x b``, orientation and sides: their
    gradients are one contiguous stack ``(k, a, b)`` of the group's flat arrays, their bases the stacks
    ``P`` ``(k, m, m)`` and ``Q`` ``(k, n, n)``."""

    def __init__(self, a: int, b: int, transposed: bool, right: bool, start: int) -> None:
        self.a, self.b, self.transposed, self.right = a, b, transposed, right
        self.start = self.stop = start
        self.matrices = 0
        self.P: Array | None = None
        self.Q: Array | None = None
        # in host memory (CPU torch): per direction, the bases it was made of and their factors as lists of matrices
        self.factors: dict[bool, tuple[Any, Any, list[Any], list[Any]]] = {}
        self.views: dict[int, tuple[Array, list[Array], list[bool]]] = {}  # per flat array: its matrices, aligned
        # per role and dtype, CPU torch: an aligned array of the block's entries, its matrices, their alignment
        self.staging: dict[tuple[str, Any], tuple[Array, list[Array], list[bool]]] = {}  # Engine._staged


class _FlatGroup:
    """A flat group of an entrywise family (module docstring): its members, blocks, flat moments and counter."""

    def __init__(self, label: str, dtype: Any, param_dtype: Any, device: Any, count: int) -> None:
        self.label, self.dtype, self.param_dtype, self.device, self.count = label, dtype, param_dtype, device, count
        self.members: list[_Member] = []
        self.blocks: list[_Block] = []
        self.unrotated_start = 0
        self.size = 0
        self.moments: dict[str, Array | None] = {}
        self.direction: Callable[..., Any] = lambda *args: None
        self.direction_name = ""
        self.update_route: Callable[..., Any] | None = None  # without rotation blocks: the family's fused update
        self.update_name = ""
        self.counter: tuple[int, Array] | None = None  # (count, the 0-d device counter made for it)
        self.scratch: dict[str, Array] = {}  # "G", "W": the gathered gradients and parameters, made on first use
        self.kernels: GroupKernels | None = None  # the family's group kernels: the whole step, or with blocks the tail
        self.shared = False  # its moments handed out by Engine.state since its last step (copy before writing)


class _Stack:
    """The members of a per-parameter group that share a shape, stepped as one ``batch_dims`` stack: ``cfg`` has
    one more batch dimension than the engine's, ``state`` is the stack's core state (every field but ``count``
    and ``param_shape`` the members' fields stacked along a new first axis).  A shape held by one parameter, or
    a group in host memory (:func:`_in_host_memory`), is a stack of one: the member's own state under the
    engine's config."""

    def __init__(self, indices: list[int], cfg: BaseConfig, state: State, param_shapes: list[Any]) -> None:
        self.indices, self.cfg, self.state, self.param_shapes = indices, cfg, state, param_shapes

    @property
    def stacked(self) -> bool:
        return len(self.indices) > 1


class _ParamGroup:
    """A per-parameter group (a family that is not entrywise): its stacks (one per parameter shape) and counter."""

    def __init__(self, label: str, count: int, indices: list[int]) -> None:
        self.label, self.count, self.indices = label, count, indices
        self.stacks: list[_Stack] = []
        self.place: dict[int, tuple[int, int]] = {}  # index -> (stack, position in it)


class _Pending(NamedTuple):
    """A step computed but not committed: the new flat moments per flat group, the new core states per
    per-parameter member, the new bases per block, and the new parameters (flat per group, or per member)."""

    moments: list[dict[str, Array | None] | None]  # None: a group its kernels step in place
    flat_params: list[Array | None]
    states: dict[tuple[int, int], State]  # (per-parameter group, stack) -> the stack's new state
    params: dict[int, Array]
    bases: dict[tuple[int, int], tuple[Array, Array | None]]
    tails: dict[int, Array]  # flat group -> its direction D = P U~ Q^T, for its tail kernel


def _native_concatenate(xp: Namespace) -> Callable[..., Any] | None:
    """The backend's ``concatenate`` that writes into ``out=`` (NumPy, CuPy, torch), or ``None`` (``array_api_strict``,
    JAX: no such call; the engine then gathers with ``xp.concat``, a new array per step)."""
    try:
        module = native_module(xp)
    except TypeError:
        return None
    concatenate: Callable[..., Any] = getattr(module, "cat", None) or module.concatenate
    return concatenate


def _in_host_memory(xp: Namespace, array: Array) -> bool:
    """Whether ``array`` is NumPy's or a torch CPU tensor: no device to wait on or launch for.  The engine then
    reads its verdict first, rotates one matrix at a time (the reference's products), and a per-parameter group
    keeps one :func:`routed_update` per parameter rather than stacks: a stack costs copies of ``G`` and ``W``,
    and NumPy's fused numba update kernels take single matrices only (LLaMA-60M's 16 block matrices, float32:
    Adafactor 61 ms per parameter against 127 ms stacked on NumPy, 62 against 84 ms on torch CPU)."""
    if is_numpy_namespace(xp):
        return True
    return is_torch_namespace(xp) and getattr(creation_device(array), "type", None) == "cpu"


def _flattened(moments: Mapping[str, Array | None], xp: Namespace) -> dict[str, Array | None]:
    """A route's new moments (``1 x N`` rows) as the flat group's arrays (views)."""
    return {f: None if v is None else xp.reshape(v, (-1,)) for f, v in moments.items()}


def _row_layout(size: int) -> Layout:
    """The layout of a flat group handed to a family's routes as one unrotated ``1 x size`` matrix."""
    return Layout((1, size), 1, size, False, False, False)


def _describe(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _factors(block: _Block, P: Array, Q: Array | None, back: bool) -> tuple[Array | None, Array | None]:
    """``(L, R)`` of a block's rotation in memory order, ``X -> L X R`` (``None``: no factor on that side):
    ``G~ = P^T G Q``, and for a tall parameter (``G^T`` in memory) ``Q^T G^T P``; ``back``: ``D = P U~ Q^T``, and
    ``Q U~^T P^T`` for a tall one (:func:`~adadiag_ref.optim.rotation.rotate` and ``unrotate``'s products)."""
    if back:
        return (Q, _transpose(P)) if block.transposed else (P, None if Q is None else _transpose(Q))
    return (None if Q is None else _transpose(Q), P) if block.transposed else (_transpose(P), Q)


def _sandwich(x: Array, L: Array | None, R: Array | None, left_first: bool, out: Array | None = None,
              product: Callable[..., Array] = _product) -> Array:  # fmt: skip
    """``L X R`` by :func:`~adadiag_ref.optim.rotation._product`: ``(L X) R`` when ``left_first`` (a wide
    parameter's order), else ``L (X R)`` (a tall one's); the last product into ``out`` where given.  ``product``:
    ``torch.mm`` for CPU torch matrices, the call ``_product`` makes for them (the same bits), without its
    dispatch, which costs more than a tiny product itself."""
    if L is None:
        return product(x, R, out=out)
    if R is None:
        return product(L, x, out=out)
    return product(product(L, x), R, out=out) if left_first else product(L, product(x, R), out=out)


def _rotate_stack(x: Array, block: _Block, P: Array, Q: Array | None, back: bool, out: Array | None = None) -> Array:
    """``G~ = P^T G Q`` of every matrix of a block's stack ``(k, a, b)``, in memory order: ``Q^T (G P)`` for a
    tall parameter (:func:`~adadiag_ref.optim.rotation.rotate`'s products, batched); ``back``: ``P U~ Q^T``
    (``unrotate``'s products).  The last product into ``out`` where given (NumPy)."""
    return _sandwich(x, *_factors(block, P, Q, back), not block.transposed, out)


def _bases_part(bases: tuple[Array, Array | None], part: slice | int) -> tuple[Array, Array | None]:
    """A block's ``(P, Q)`` stacks cut to the matrices ``part`` (the whole stacks for ``slice(None)``; one matrix's
    bases for an index)."""
    if part == slice(None):
        return bases
    P, Q = bases
    return P[part], None if Q is None else Q[part]


def _product_into(product: Callable[..., Array], b: int, block: _Block, source: Array, target: Array,
                  part: slice) -> None:  # fmt: skip
    """One job of a NumPy rotation phase: ``product`` of matrices ``part`` of a block's stack into ``target``'s."""
    out = target[part]
    made = product(b, block, source[part], out, part)
    if made is not out:  # a refresh step's structured G~: a new array
        out[...] = made


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


_ALIGNMENT = 64
"""Bytes: the alignment of a fresh CPU torch tensor, which the host path's GEMM operands keep."""


def _aligned_copy(x: Array) -> Array:
    """A CPU torch matrix (a view into a flat array) whose first entry is off a :data:`_ALIGNMENT`-byte boundary,
    copied to a fresh tensor's alignment to be a GEMM operand.  MKL's GEMM rounds otherwise on an operand at
    another alignment (measured: a 6 x 4 float32 view at an 80-byte offset gave other last bits), and
    :func:`~adadiag_ref.step`'s operands are fresh tensors; the blocks of real models (sizes multiples of 16
    entries) are aligned, so no copy is made for them.  Which views are off is known when they are made
    (:meth:`Engine._stack_views`), not asked per matrix and step."""
    return x.clone()


_STAGED_SIZE = 1 << 16
"""Entries: a rotation block off a fresh tensor's alignment up to this size goes through arrays of its own
(:meth:`Engine._staged`), kept; a larger one copies its matrices one at a time, as they are used."""


def _transpose(x: Array) -> Array:
    """The transposed view of every matrix of a stack (``matrix_transpose``, without the namespace look-up)."""
    return x.mT if hasattr(x, "mT") else x.swapaxes(-1, -2)


def key_mismatch(what: str, keys: Sequence[Any], given: Sequence[Any]) -> ValueError:
    """The one-line error for a mapping ``what`` whose keys are not ``keys``: the missing and the extra ones named
    (``grads lacks 'fc2.bias'; has 'fc3.bias', which is not a parameter``)."""
    missing = [k for k in keys if k not in set(given)]
    extra = [k for k in given if k not in set(keys)]
    parts = [f"lacks {', '.join(map(repr, missing))}"] if missing else []
    if extra:
        parts.append(f"has {', '.join(map(repr, extra))}, which {'is' if len(extra) == 1 else 'are'} not a parameter")
    return ValueError(f"{what} must have the parameters' keys: it {'; it '.join(parts)}; nothing was changed")


def _as_ordered(values: Any, keys: list[Key], what: str) -> list[Any]:
    """``values`` (a mapping with the engine's keys, or a sequence in its order) as a list in the engine's order."""
    if isinstance(values, Mapping):
        if set(values) != set(keys):
            raise key_mismatch(what, keys, list(values))
        return [values[k] for k in keys]
    if not isinstance(values, Sequence):
        raise TypeError(f"{what} must be a sequence (list, tuple) or a mapping of arrays")
    if len(values) != len(keys):
        raise ValueError(f"{what} has {len(values)} entries for the engine's {len(keys)} parameters")
    return list(values)


def _keys_of(params: Any, names: Sequence[str | None] | None) -> tuple[list[Key], list[Any], list[str | None]]:
    """``(keys, params, names)``: a mapping's keys name its parameters; a sequence's are ``names`` or indices."""
    if isinstance(params, Mapping):
        keys = list(params)
        return keys, [params[k] for k in keys], [str(k) for k in keys]
    if not isinstance(params, Sequence):
        raise TypeError("the engine takes a sequence (list, tuple) or a mapping of parameters")
    names_l: list[str | None] = [None] * len(params) if names is None else list(names)
    if len(names_l) != len(params):
        raise ValueError(f"names has {len(names_l)} entries for {len(params)} parameters")
    keys = [i if nm is None else nm for i, nm in enumerate(names_l)]
    return keys, list(params), names_l


class Engine:
    """A stateful optimizer over many parameters of one config: per parameter ``G~ = P^T G Q``,
    ``U~, M_t, V_t = direction(S_{t-1}, G~, t)``, ``W_{t+1} = W_t - eta_t (P U~ Q^T + lambda W_t)``, the bases
    refreshed at ``t = 1`` and every ``T`` steps, as :func:`~adadiag_ref.step` computes them.

    ``Engine(params, cfg)``: zero moments, identity bases, no step taken (:func:`~adadiag_ref.init` of each
    parameter).  ``params`` is a sequence (keys: ``names`` where given, else the indices) or a mapping (keys: its
    keys, which name the parameters in messages).  :meth:`from_states` builds it from existing core states.

    Built once (``adadiag_ref/optim/engine.py``'s module docstring has the whole design): the parameters grouped by
    (family, state dtype, parameter dtype, device, kind, steps taken); an entrywise family's group keeps one flat
    array per moment field and steps all of its parameters at once (one gather, batched GEMMs per work shape, the
    direction and the tail once; with the family's group kernels, NumPy, CPU torch and CuPy, a group without
    rotation is stepped in place through its members' addresses and a rotated group's tail written so, nothing
    gathered but the rotated gradients); Adafactor and Hfac step one ``batch_dims`` stack per parameter shape on a
    device backend, per parameter on the CPU; the step counter is a host int per group.

    * :meth:`step` ``(grads, params, *, lr=None, check=True, in_place=None)``: one step of every parameter,
      written into ``params`` (in place; JAX: returned); with ``check`` one value read back for all gradients,
      and a non-finite gradient raises ``ValueError`` naming its parameter with nothing changed;
    * :meth:`state` ``(key)``, :meth:`states` ``()``: the core states (NamedTuples), as ``step`` would hold them;
    * :meth:`count` ``(key)``: the steps taken; :attr:`keys`: the parameters' keys;
    * :meth:`routes` ``()``: per key, the :class:`Route` (which code runs each part of a step).
    """

    def __init__(
        self, params: Any, cfg: BaseConfig, *, names: Sequence[str | None] | None = None, xp: Namespace | None = None
    ) -> None:
        keys, params_l, names_l = _keys_of(params, names)
        if not params_l:
            raise ValueError("an engine needs at least one parameter")
        xp = namespace(*params_l, xp=xp)
        self._build(keys, names_l, params_l, [init(p, cfg, xp=xp) for p in params_l], cfg, [0] * len(params_l), xp)

    @classmethod
    def from_states(
        cls,
        states: Any,
        params: Any,
        cfg: BaseConfig,
        *,
        names: Sequence[str | None] | None = None,
        count: int | Sequence[int] | None = None,
        xp: Namespace | None = None,
        live: bool = False,
    ) -> Engine:
        """An engine holding existing core states (one per parameter, like ``params``: a sequence or a mapping
        with the same keys), each checked against its parameter and ``cfg`` (``ValueError``).  ``count`` (host
        ints, the steps taken): one for all, or one per parameter; ``None`` reads each state's counter once,
        here.  The states' moments and bases are copied into the engine's flat arrays (the states themselves
        are never modified), except a per-parameter member's in host memory, which the engine holds as given
        (and, ``live``, writes in place).

        ``live``: the arrays of a state handed out by :meth:`state` stay the engine's own, and every later step
        writes them in place (new moments and bases copied into them), so a caller may hold them as its
        per-parameter state (the torch adapter's ``optimizer.state[p]``); without it they are snapshots.  The
        counter of a handed-out state is not advanced (the caller keeps its own).  Not for JAX (immutable)."""
        keys, params_l, names_l = _keys_of(params, names)
        if not params_l:
            raise ValueError("an engine needs at least one parameter")
        states_l = _as_ordered(states, keys, "states")
        xp = namespace(*params_l, xp=xp)
        if live and is_jax_namespace(xp):
            raise TypeError("JAX arrays are immutable: an engine over them cannot keep live states (live=False)")
        for key, s, p in zip(keys, states_l, params_l, strict=True):
            _check_static(s, p, p, layout_for(tuple(p.shape), cfg), cfg, name=str(key))
        engine = cls.__new__(cls)
        engine._build(keys, names_l, params_l, states_l, cfg, host_counts(count, states_l, len(states_l)), xp)
        engine._live = live
        return engine

    @property
    def cfg(self) -> BaseConfig:
        """The config the engine was built for (read-only: its groups, routes and kernels were chosen for it).
        A step's own ``lr``, ``weight_decay`` and ``betas`` are keywords of :meth:`step`."""
        return self._cfg

    @cfg.setter
    def cfg(self, value: BaseConfig) -> None:
        raise AttributeError(
            "Engine.cfg is fixed when the engine is built (its groups, routes and kernels were chosen for it): pass "
            "lr=, weight_decay= or betas= to Engine.step for one step, or build another engine "
            "(Engine.from_states(engine.states(), params, cfg))"
        )

    # ------------------------------------------------------------------------------------------------ building

    def _build(
        self,
        keys: list[Key],
        names: list[str | None],
        params: list[Array],
        states: list[State],
        cfg: BaseConfig,
        counts: list[int],
        xp: Namespace,
    ) -> None:
        self._cfg, self.xp = cfg, xp
        self._live = False  # from_states(live=True): handed-out states are written in place (_commit)
        self._keys, self._names = keys, names
        self._shapes = [tuple(int(d) for d in p.shape) for p in params]
        self._param_dtypes = [p.dtype for p in params]
        self._family = family = family_of(cfg)
        self._immutable = is_jax_namespace(xp)
        self._host = all(_in_host_memory(xp, p) for p in params)
        self._native = _native_concatenate(xp)
        kind = "flat" if family.entrywise else "per-parameter"
        grouped: dict[tuple[Any, ...], list[int]] = {}
        for i, (p, s) in enumerate(zip(params, states, strict=True)):
            key = (family.name, str(work_dtype(s)), str(p.dtype), str(creation_device(p)), kind, counts[i])
            grouped.setdefault(key, []).append(i)
        self._flat: list[_FlatGroup] = []
        self._per_param: list[_ParamGroup] = []
        self._home: dict[int, tuple[str, int, int]] = {}  # index -> (kind, group, member position)
        for number, (key, indices) in enumerate(grouped.items()):
            state_name = float_dtype_name(work_dtype(states[indices[0]]), xp)
            label = (
                f"{kind} group {number}: family {key[0]}, state {state_name}, parameters "
                f"{float_dtype_name(params[indices[0]].dtype, xp)}, device {key[3]}, "
                f"{len(indices)} parameter{'s' if len(indices) > 1 else ''}"
            )
            if family.entrywise:
                for group in self._flat_groups(label, indices, params, states, counts[indices[0]], family):
                    self._home.update({m.index: ("flat", len(self._flat), j) for j, m in enumerate(group.members)})
                    self._flat.append(group)
            else:
                pgroup = self._param_group(label, indices, states, counts[indices[0]])
                self._home.update({i: ("per-parameter", len(self._per_param), j) for j, i in enumerate(indices)})
                self._per_param.append(pgroup)

    def _flat_groups(
        self, label: str, indices: list[int], params: list[Array], states: list[State], count: int, family: FamilySpec
    ) -> list[_FlatGroup]:
        """The flat group over ``indices``, or two where its unrotated members (AdaDiag's embedding, head and norms)
        can be stepped in place by the family's group kernels: those members alone, and the rotated ones (their
        gradients gathered for the batched GEMMs).  The entries' arithmetic is the same either way."""
        rotated = [i for i in indices if layout_for(self._shapes[i], self.cfg).rotate_left]
        unrotated = [i for i in indices if i not in set(rotated)]
        if rotated and unrotated:
            plain = self._flat_group(f"{label}; its {len(unrotated)} unrotated", unrotated, params, states, count,
                                     family)  # fmt: skip
            if plain.kernels is not None:
                return [self._flat_group(f"{label}; its {len(rotated)} rotated", rotated, params, states, count,
                                         family), plain]  # fmt: skip
        return [self._flat_group(label, indices, params, states, count, family)]

    def _param_group(self, label: str, indices: list[int], states: list[State], count: int) -> _ParamGroup:
        """A per-parameter group over ``indices``: one :class:`_Stack` per parameter shape (module docstring)."""
        cfg = self.cfg
        pgroup = _ParamGroup(label, count, indices)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i in indices:
            by_shape.setdefault(self._shapes[i], []).append(i)
        state = states[indices[0]]
        host = _in_host_memory(
            self.xp, next(v for v in (state.param_shape, state.count, *state) if hasattr(v, "shape"))
        )
        for shape, members in by_shape.items():
            if len(members) == 1 or host:
                stacks = [_Stack([i], cfg, states[i], [states[i].param_shape]) for i in members]
            else:
                stacks = [self._stack(members, shape, states)]
            for stack in stacks:
                for position, i in enumerate(stack.indices):
                    pgroup.place[i] = (len(pgroup.stacks), position)
                pgroup.stacks.append(stack)
        return pgroup

    def _stack(self, indices: list[int], shape: tuple[int, ...], states: list[State]) -> _Stack:
        """The stack of ``indices`` (parameters of one ``shape``): ``init`` of the stacked parameter under
        ``batch_dims + 1``, each array field then the members' fields stacked (``xp.stack``, a copy)."""
        xp, cfg = self.xp, self.cfg
        first = states[indices[0]]
        stack_cfg = cfg.replace(batch_dims=cfg.batch_dims + 1)
        fields = {f: xp.stack([getattr(states[i], f) for i in indices]) for f in first._fields
                  if f not in ("count", "param_shape") and getattr(first, f) is not None}  # fmt: skip
        device = creation_device(next(iter(fields.values())))
        template = init(xp.zeros((len(indices), *shape), dtype=work_dtype(first), device=device), stack_cfg, xp=xp)
        state = template._replace(count=first.count, **fields)
        return _Stack(indices, stack_cfg, state, [states[i].param_shape for i in indices])

    def _flat_group(
        self, label: str, indices: list[int], params: list[Array], states: list[State], count: int, family: FamilySpec
    ) -> _FlatGroup:
        """A flat group over ``indices``: members ordered by rotation block, then the unrotated ones; the states'
        moments and bases copied into the flat arrays and the block stacks; the direction route resolved."""
        xp, cfg = self.xp, self.cfg
        first = params[indices[0]]
        group = _FlatGroup(label, work_dtype(states[indices[0]]), first.dtype, creation_device(first), count)
        layouts = {i: layout_for(self._shapes[i], cfg) for i in indices}
        blocks: dict[tuple[int, int, bool, bool], list[int]] = {}
        for i in indices:
            lay = layouts[i]
            if lay.rotate_left:
                blocks.setdefault((*memory_shape(lay), lay.transposed, lay.rotate_right), []).append(i)
        offset = 0
        for (a, b, transposed, right), members in blocks.items():
            block = _Block(a, b, transposed, right, offset)
            for i in members:
                lay = layouts[i]
                k = math.prod(lay.batch)
                member = _Member(i, lay, offset, k * a * b, len(group.blocks), block.matrices, k,
                                 states[i].param_shape)  # fmt: skip
                group.members.append(member)
                offset += member.size
                block.matrices += k
            block.stop = offset
            m, n = layouts[members[0]].rows, layouts[members[0]].cols  # the work frame: P is m x m, Q n x n
            block.P = xp.concat([xp.reshape(states[i].P, (-1, m, m)) for i in members])
            if right:
                block.Q = xp.concat([xp.reshape(states[i].Q, (-1, n, n)) for i in members])
            group.blocks.append(block)
        group.unrotated_start = offset
        for i in indices:
            lay = layouts[i]
            if not lay.rotate_left:
                size = math.prod(self._shapes[i])  # 1 for a 0-d parameter
                group.members.append(_Member(i, lay, offset, size, None, 0, 1, states[i].param_shape))
                offset += size
        group.size = offset
        for field in family.moment_fields:
            values = [getattr(states[m.index], field) for m in group.members]
            group.moments[field] = (
                None if values[0] is None else
                xp.concat([flatten_in_memory_order(v, m.layout, xp)
                           for v, m in zip(values, group.members, strict=True)])
            )  # fmt: skip
        group.direction, group.direction_name = self._resolve_direction(group, family)
        if not group.blocks:
            group.update_route, group.update_name = self._resolve_update(group, family)
        group.kernels = self._resolve_kernels(group, family)
        return group

    def _resolve_direction(self, group: _FlatGroup, family: FamilySpec) -> tuple[Callable[..., Any], str]:
        """The group's direction code, chosen once: the family's first direction route that applies to a
        one-entry group of the group's dtype and device (routes decide by backend, dtype and ``cfg.kernels``,
        never by values), else the reference."""
        state, g, t = self._probe(group)
        for route in family.routes.direction:
            if route(state, g, t, self.cfg, self.xp) is not None:
                return route, _describe(route)
        return family.direction, f"{_describe(family.direction)} (the family's reference)"

    def _resolve_update(self, group: _FlatGroup, family: FamilySpec) -> tuple[Callable[..., Any] | None, str]:
        """For a group without rotation blocks (every member unrotated: AdamW, vectors): the family's first fused
        update route (moments, direction and tail in one call, as :func:`routed_update` takes it
        for one unrotated parameter) that applies to a one-entry group, else ``None`` (the direction route and
        the shared tail)."""
        state, g, t = self._probe(group)
        eta = learning_rate(self.cfg, None)
        for route in family.routes.update:
            if route(state, _row_layout(1), t, g, g, self.cfg, eta, unrotate, self.xp) is not None:
                return route, _describe(route)
        return None, ""

    def _resolve_kernels(self, group: _FlatGroup, family: FamilySpec) -> GroupKernels | None:
        """For a group on a mutable backend whose parameters have the state dtype: the family's first group
        kernels (:attr:`~adadiag_ref.optim.families.registry.Routes.group`) that apply, else ``None`` (the
        gathering path).  Without rotation blocks they step the group; with, they write its tail."""
        if self._immutable or group.param_dtype != group.dtype or family.step_size is not constant_step_size:
            return None
        sizes = [m.size for m in group.members]
        found = (factory(self.cfg, group.dtype, sizes, group.device, self.xp) for factory in family.routes.group)
        return next((kernels for kernels in found if kernels is not None), None)

    def _probe(self, group: _FlatGroup) -> tuple[State, Array, Any]:
        """A one-entry stand-in of ``group`` for choosing its routes: its state as a ``1 x 1`` row, ``G`` and
        ``t``, zeros of its dtype and device."""
        xp = self.xp

        def zero() -> Array:  # each its own array: a route may reuse an input's memory for its output
            return xp.zeros((1, 1), dtype=group.dtype, device=group.device)

        state = self._row_state({f: None if v is None else zero() for f, v in group.moments.items()}, 1)
        return state, zero(), host_step(0, group.dtype, xp)

    def _row_state(self, moments: Mapping[str, Array | None], size: int) -> State:
        """The family's state over flat moments handed to its routes as one ``1 x size`` matrix (views; no bases):
        the routes take matrices."""
        xp = self.xp
        rows = {f: None if v is None else xp.reshape(v, (1, size)) for f, v in moments.items()}
        state: State = self._family.state_type(count=None, P=None, Q=None, param_shape=None, **rows)
        return state

    # ------------------------------------------------------------------------------------------------ inspection

    @property
    def keys(self) -> list[Key]:
        """The parameters' keys, in the engine's order (a mapping's keys, or the names or indices given)."""
        return list(self._keys)

    def count(self, key: Key) -> int:
        """The steps taken by parameter ``key`` (the host counter of its group)."""
        kind, number, _ = self._home[self._index(key)]
        return (self._flat[number] if kind == "flat" else self._per_param[number]).count

    def _index(self, key: Key) -> int:
        if key in self._keys:
            return self._keys.index(key)
        if isinstance(key, int) and 0 <= key < len(self._keys):
            return key
        raise KeyError(f"no parameter {key!r} in this engine (keys: {self._keys})")

    def state(self, key: Key) -> State:
        """Parameter ``key``'s core state (the family's NamedTuple), as :func:`~adadiag_ref.step` would hold it:
        moments and bases are views of the engine's arrays (a snapshot: later steps replace those arrays, or, for a
        group stepped in place by its family's group kernels, copy them before writing), ``count`` a 0-d int32
        array shared by the group."""
        i = self._index(key)
        kind, number, position = self._home[i]
        if kind == "per-parameter":
            return self._member_state(self._per_param[number], i)
        group = self._flat[number]
        # its next in-place step copies the moments first, unless they are live (written in place on purpose)
        group.shared = group.kernels is not None and not self._live
        return self._flat_member_state(group, group.members[position])

    def _flat_member_state(self, group: _FlatGroup, member: _Member) -> State:
        """A flat group's member's state as :meth:`state` gives it, without marking its moments handed out (the
        engine's own reads: a refresh reads only the bases)."""
        xp = self.xp
        P = Q = None
        if member.block is not None:
            block = group.blocks[member.block]
            P, Q = self._member_bases(member, block.P, block.Q)
        span = slice(member.offset, member.offset + member.size)
        moments = {f: None if v is None else work_view(v[span], member.layout, xp) for f, v in group.moments.items()}
        if group.counter is None or group.counter[0] != group.count:
            group.counter = (group.count, xp.asarray(group.count, dtype=xp.int32, device=group.device))
        state: State = self._family.state_type(count=group.counter[1], P=P, Q=Q, **moments,
                                               param_shape=member.param_shape)  # fmt: skip
        return state

    @staticmethod
    def _member_state(pgroup: _ParamGroup, i: int) -> State:
        """Member ``i``'s core state in its stack: the stack's fields at its position (views), its own
        ``param_shape``, the stack's counter."""
        number, position = pgroup.place[i]
        stack = pgroup.stacks[number]
        if not stack.stacked:
            return stack.state
        state = stack.state
        fields = {f: getattr(state, f)[position, ...] for f in state._fields
                  if f not in ("count", "param_shape") and getattr(state, f) is not None}  # fmt: skip
        return state._replace(**fields, param_shape=stack.param_shapes[position])

    def _member_bases(self, member: _Member, P: Any, Q: Any) -> tuple[Any, Any]:
        """A member's ``P`` (and ``Q``) as views of its block's stacks: ``(m, m)``, or ``(*B, m, m)`` for a stack."""
        lay, xp = member.layout, self.xp
        pick = slice(member.slot, member.slot + member.matrices)

        def view(stack: Any, side: int) -> Any:
            if stack is None:
                return None
            if not lay.batch:
                return stack[member.slot, ...]
            return xp.reshape(stack[pick, ...], (*lay.batch, side, side))

        return view(P, lay.rows), view(Q, lay.cols) if lay.rotate_right else None

    def states(self) -> Any:
        """Every parameter's :meth:`state`: a dict by key when the engine was built from a mapping or with names,
        else a list in the engine's order."""
        values = [self.state(i) for i in range(len(self._keys))]
        if all(isinstance(k, int) for k in self._keys):
            return values
        return dict(zip(self._keys, values, strict=True))

    def routes(self) -> dict[Key, Route]:
        """Which code runs each part of a step, per parameter key (:class:`Route`; decided when the engine was
        built, never per step)."""
        numpy = is_numpy_namespace(self.xp)
        layouts = {i: layout_for(s, self.cfg) for i, s in enumerate(self._shapes)}
        # each single rotated matrix's stack key, read once (a per-parameter group's state is assembled to read it)
        stack_keys = {i: self._refresh_key(i, lay) for i, lay in layouts.items() if lay.rotate_left and not lay.batch}
        members = Counter(stack_keys.values())
        peers = {i: members[key] for i, key in stack_keys.items()}
        return {self._keys[i]: Route(*self._route_parts(i, lay, numpy, peers.get(i, 0))) for i, lay in layouts.items()}

    def _refresh_key(self, i: int, lay: Layout) -> tuple[Any, ...]:
        """What the single matrices one stacked decomposition refreshes share: work shape, state dtype, sides."""
        kind, number, _ = self._home[i]
        flat = kind == "flat"
        dtype = self._flat[number].dtype if flat else work_dtype(self._member_state(self._per_param[number], i))
        return (lay.rows, lay.cols), str(dtype), lay.rotate_right

    def _route_parts(self, i: int, lay: Layout, numpy: bool, peers: int) -> tuple[str, str, str, str, str]:
        """The parts of parameter ``i``'s :class:`Route`; ``peers``: the single matrices one stacked decomposition
        refreshes with it (its own included)."""
        kind, number, position = self._home[i]
        sides = "P and Q" if lay.rotate_right else "P"
        if not lay.rotate_left:
            refresh = rotate = unrotate = "none: no side rotates (P = I)"
        else:
            method = self.cfg.basis_method
            if lay.batch:
                refresh = (f"refresh_basis: one canonical_svd_batch over the parameter's {math.prod(lay.batch)} "
                           f"matrices {lay.rows} x {lay.cols} (basis_method={method})")  # fmt: skip
            elif numpy or peers < 2:
                why = "NumPy: LAPACK per matrix" if numpy else "the only matrix of its work shape"
                refresh = f"refresh_basis per parameter ({why}; basis_method={method}), {sides}"
            else:
                refresh = (
                    f"refresh_bases: one stacked decomposition of the {peers} {lay.rows} x {lay.cols} matrices of "
                    f"this work shape (basis_method={method}), {sides}; singular values to the host"
                )
            if kind == "flat":
                member = self._flat[number].members[position]
                block = self._flat[number].blocks[member.block] if member.block is not None else None
                k = block.matrices if block is not None else 1
                how = ("numpy.matmul per matrix into BLAS" if numpy else "torch.mm per matrix" if self._host
                       else "xp.matmul on the stack")  # fmt: skip
                rotate = f"batched GEMM: G~ = P^T G{' Q' if lay.rotate_right else ''} over {k} {lay.rows} x {lay.cols} matrices ({how})"  # noqa: E501
                unrotate = f"batched GEMM: P U~{' Q^T' if lay.rotate_right else ''} over the same {k} matrices ({how})"
            else:
                where = self._stack_words(i)
                rotate = f"rotation.rotate ({sides}) inside engine.routed_update, {where}"
                unrotate = f"rotation.unrotate ({sides}) inside engine.routed_update, {where}"
        if kind == "flat":
            group = self._flat[number]
            entrywise = (f"{group.direction_name} once over the flat group ({group.size} entries), then "
                         "adadiag_ref.optim.tail.decayed_step over the group")  # fmt: skip
            if group.update_route is not None:
                entrywise = (f"{group.update_name} once over the flat group ({group.size} entries): moments, "
                             "direction and tail in one call (an array lr: " + entrywise + ")")  # fmt: skip
            if group.kernels is not None and group.blocks:
                moments = f"in place: {group.kernels.moments_name} ({group.size} entries)"
                entrywise = (f"{moments}, then the tail in place: {group.kernels.tail_name} (in_place=False, an "
                             f"array lr, or arrays the kernels do not take: {group.direction_name} once over the "
                             f"flat group, W gathered, then adadiag_ref.optim.tail.decayed_step)")  # fmt: skip
            elif group.kernels is not None:
                entrywise = (f"in place: {group.kernels.name} (in_place=False, an array lr, or arrays the kernels "
                             f"do not take: gathered, then {entrywise})")  # fmt: skip
            label = f"{group.label}, {group.size} entries"
        else:
            entrywise = (f"adadiag_ref.optim.engine.routed_update, {self._stack_words(i)} (the family's update "
                         "and direction routes tried per call, else its reference; the tail "
                         "tail.parameter_delta)")  # fmt: skip
            label = self._per_param[number].label
        return label, refresh, rotate, unrotate, entrywise

    def _stack_words(self, i: int) -> str:
        """How member ``i`` of a per-parameter group is stepped, in words: alone, or in its shape's stack."""
        pgroup = self._per_param[self._home[i][1]]
        stack = pgroup.stacks[pgroup.place[i][0]]
        if not stack.stacked:
            return "per parameter"
        return (f"once over the stack of the {len(stack.indices)} parameters of shape {self._shapes[i]} "
                f"(batch_dims={stack.cfg.batch_dims})")  # fmt: skip

    # ------------------------------------------------------------------------------------------------ stepping

    def step(
        self,
        grads: Any,
        params: Any,
        *,
        lr: Any = None,
        weight_decay: Any = None,
        betas: Any = None,
        check: bool = True,
        in_place: bool | None = None,
    ) -> Any:
        """One step of every parameter: ``W_{t+1} = W_t - eta_t (P U~ Q^T + lambda W_t)`` (a refresh first where
        due), the counters advanced by one.

        ``grads`` and ``params``: sequences in the engine's order or mappings with its keys; each parameter of the
        shape and dtype the engine was built for, each gradient of its parameter's shape and dtype (``ValueError``
        naming the parameter otherwise, before any work).  ``lr``, ``weight_decay`` and ``betas`` override
        ``cfg.lr``, ``cfg.weight_decay`` and ``cfg.betas`` for this step (numbers or 0-d arrays, validated as by
        :func:`~adadiag_ref.update`: an invalid one raises ``ValueError`` with nothing changed), the same numbers
        as an engine built with them, on the same routes (a scheduler's per-step betas, as OneCycleLR's
        ``cycle_momentum``, or weight decay are the group kernels' scalars).  ``check`` (module
        docstring): one reduced finiteness verdict read back; a non-finite gradient raises ``ValueError`` naming
        its parameter, and then no state and no parameter has changed.

        ``in_place`` (default: every backend but JAX): ``W_{t+1}`` is written into the given parameter arrays
        (``x[...] = value``; torch under ``no_grad``).  Returns the new parameters in the form of ``params`` (a
        list, or a dict): the very arrays given when in place, new arrays otherwise.
        """
        if in_place is None:
            in_place = not self._immutable
        elif in_place and self._immutable:
            raise TypeError("JAX arrays are immutable: step them with in_place=False (the new parameters returned)")
        check_learning_rate(lr)
        cfg = step_config(self._cfg, weight_decay=weight_decay, betas=betas)
        grads_l, params_l = self._inputs(grads, params)
        new = self._advance(grads_l, params_l, lr, check, in_place, cfg)
        out = list(params_l) if in_place else new
        if in_place:
            with self._writable():
                for target, value in zip(params_l, new, strict=True):
                    if value is not target:  # a group's kernels wrote it already
                        target[...] = value
        if isinstance(params, Mapping):
            return dict(zip(self._keys, out, strict=True))
        return out

    def finite(self, grads: Any) -> Any:
        """Whether every gradient of ``grads`` (as :meth:`step` takes them) is finite, as one verdict: a group's
        kernels count its gradients' NaN and Inf by address (one read), any other gradient is summed (a sum is NaN
        or Inf whenever an entry is; it may also overflow on finite entries, so ``False`` is a suspicion for the
        caller to settle exactly).  A host bool in host memory, else a 0-d device boolean (nothing read back).
        Nothing is written: a caller stepping several engines checks them all first, then steps each with
        ``check=False``.  A gradient of another shape or dtype than its parameter's raises ``ValueError`` naming
        it, before any gradient is read."""
        grads_l = _as_ordered(grads, self._keys, "grads")
        if not self._built_like(grads_l):  # the kernels read by address: sizes first
            for key, g, shape, dtype in zip(self._keys, grads_l, self._shapes, self._param_dtypes, strict=True):
                if getattr(g, "dtype", None) != dtype or g.shape != shape:
                    raise ValueError(
                        f"gradient {key!r} has shape {tuple(g.shape)} and dtype {getattr(g, 'dtype', None)}; the "
                        f"engine was built for shape {shape} and dtype {dtype} (nothing was read)"
                    )
        summed: list[Array] = []
        counts: list[Any] = []
        for group in self._flat:
            members = self._members(group, grads_l)
            prepared = None if group.kernels is None else group.kernels.prepare(None, members, 0.0, self._cfg)
            if prepared is None:
                summed += members
            else:
                counts.append(group.kernels.nonfinite(prepared))  # type: ignore[union-attr]
        summed += [grads_l[i] for pgroup in self._per_param for i in pgroup.indices]
        verdict = self._verdict(summed, counts)
        return bool(verdict) if self._host else verdict  # a CPU torch sum is a 0-d tensor: read it here

    def _built_like(self, arrays: list[Array]) -> bool:
        """Whether ``arrays`` have exactly the shapes and dtypes the engine was built for, read by ``map`` (a loop
        in C: at every step, for every parameter, a Python frame cost more than a tiny one's arithmetic).  ``False``
        leaves the verdict, and the message naming the array, to the caller's check of each."""
        try:
            return list(map(_SHAPE, arrays)) == self._shapes and list(map(_DTYPE, arrays)) == self._param_dtypes
        except AttributeError:
            return False

    def _writable(self) -> Any:
        """``torch.no_grad()`` for torch (a leaf parameter that requires grad is written in place), else nothing."""
        if is_torch_namespace(self.xp):
            import torch

            return torch.no_grad()
        return contextlib.nullcontext()

    def _inputs(self, grads: Any, params: Any) -> tuple[list[Array], list[Array]]:
        """The gradients and parameters in the engine's order, checked against it (shapes, dtypes; no values)."""
        grads_l = _as_ordered(grads, self._keys, "grads")
        params_l = _as_ordered(params, self._keys, "params")
        if self._built_like(params_l) and self._built_like(grads_l):
            return grads_l, params_l
        xp = self.xp
        for i, (g, p) in enumerate(zip(grads_l, params_l, strict=True)):
            shape = tuple(p.shape)  # ints on every backend the engine takes (torch.Size, a tuple)
            if shape != self._shapes[i] or p.dtype != self._param_dtypes[i]:
                raise ValueError(
                    f"parameter {self._keys[i]!r} has shape {shape} and dtype {p.dtype}; the engine was built for "
                    f"shape {self._shapes[i]} and dtype {self._param_dtypes[i]}"
                )
            if getattr(g, "dtype", None) != p.dtype or tuple(g.shape) != shape:  # the common case costs nothing
                check_gradient_matches(g, p, xp, name=str(self._keys[i]))
        return grads_l, params_l

    def _advance(
        self, grads: list[Array], params: list[Array], lr: Any, check: bool, in_place: bool, cfg: BaseConfig
    ) -> list[Array]:
        """One step under ``cfg`` (the engine's, or a step's :func:`~adadiag_ref.config.step_config` of it),
        committed: the new parameters (views of the groups' flat results, per member, or the very arrays a group's
        kernels wrote, with this step's betas and weight decay as their scalars)."""
        eta = learning_rate(cfg, lr)
        direct = [self._prepare(group, grads, params, eta, cfg) if in_place else None for group in self._flat]
        flats = [self._gather(group, grads) if d is None or group.blocks else None
                 for group, d in zip(self._flat, direct, strict=True)]  # fmt: skip
        stacked = [[self._stacked(stack, grads) for stack in pgroup.stacks] for pgroup in self._per_param]
        groups: list[_FlatGroup | _ParamGroup] = [*self._flat, *self._per_param]
        due = [refresh_due(group.count, self.cfg) for group in groups]
        checked = [f for f in flats if f is not None] + [g for stacks in stacked for g in stacks]
        counts = [self._kernels_of(g).nonfinite(d) for g, d in zip(self._flat, direct, strict=True)
                  if d is not None and not g.blocks and check]  # fmt: skip
        verdict: Any = self._verdict(checked, counts) if check else None
        # read first: before any decomposition (LAPACK never sees NaN or Inf); in host memory, no device; known on
        # the host already.  Else left on the device, gating every write of the kernels below
        if verdict is not None and (any(due) or self._host or isinstance(verdict, bool)):
            self._raise_unless(verdict, grads)
            verdict = None
        bases, refreshed, fresh_states = self._refresh(grads, due)
        with np.errstate(all="ignore") if verdict is not None else contextlib.nullcontext():  # NaN may flow
            pending = self._compute(flats, stacked, params, lr, bases, refreshed, fresh_states, direct, cfg, verdict)
        self._run_kernels(direct, verdict, pending.tails)
        if verdict is not None and not bool(verdict):  # the one read-back
            self._raise_unless(False, grads)  # NaN or Inf: raised, and the gated kernels wrote nothing
            # finite entries whose sum overflowed: nothing was written, nothing refreshed; the step again, unchecked
            return self._advance(grads, params, lr, False, in_place, cfg)
        return self._commit(pending, params)

    def _prepare(self, group: _FlatGroup, grads: list[Array], params: list[Array], eta: Any, cfg: BaseConfig) -> Any:
        """The step prepared for ``group``'s kernels (in place; no gather), or ``None``: no kernels, or they do
        not take this step's arrays, learning rate or config (then it is gathered)."""
        kernels = group.kernels
        if kernels is None:
            return None
        return kernels.prepare(self._members(group, params), None if group.blocks else self._members(group, grads),
                               eta, cfg)  # fmt: skip

    @staticmethod
    def _kernels_of(group: _FlatGroup) -> GroupKernels:
        assert group.kernels is not None  # only asked of a group that steps directly
        return group.kernels

    @staticmethod
    def _members(group: _FlatGroup, arrays: list[Array]) -> list[Array]:
        return [arrays[m.index] for m in group.members]

    def _run_kernels(self, direct: list[Any], proceed: Any, tails: dict[int, Array]) -> None:
        """The direct groups' kernels, in place: a rotated group's tail from its computed direction, another's
        whole step; ``proceed`` (a 0-d device boolean, or ``None``) gates their writes on the device.  A group
        whose moments were handed out (:meth:`state`) writes into copies."""
        for number, (group, prepared) in enumerate(zip(self._flat, direct, strict=True)):
            if prepared is not None and group.blocks:
                self._kernels_of(group).tail(prepared, tails[number], proceed)
            elif prepared is not None:
                t = host_step(group.count, group.dtype, self.xp)
                self._kernels_of(group).step(prepared, self._own_moments(group), t, proceed)

    def _own_moments(self, group: _FlatGroup) -> dict[str, Array | None]:
        """The group's flat moments, for its kernels to write in place: copied first when a snapshot of them was
        handed out (:meth:`state`) since its last step."""
        if group.shared:
            group.moments = {f: None if v is None else self.xp.asarray(v, copy=True) for f, v in group.moments.items()}
            group.shared = False
        return group.moments

    def _stacked(self, stack: _Stack, arrays: list[Array]) -> Array:
        """The stack's members' ``arrays`` stacked along a new first axis (one call), or the one member's."""
        if not stack.stacked:
            return arrays[stack.indices[0]]
        return self.xp.stack([arrays[i] for i in stack.indices])

    def _gather(self, group: _FlatGroup, grads: list[Array]) -> Array:
        """The group's gradients as one flat array of the state dtype (memory order, the members' order)."""
        return self.xp.astype(self._gathered(group, "G", grads), group.dtype, copy=False)

    def _gathered(self, group: _FlatGroup, which: str, arrays: list[Array]) -> Array:
        """The members' ``arrays`` one after another (memory order, the members' order): written by one call into
        the group's scratch where the backend's ``concatenate`` takes ``out=`` (NumPy, CuPy, torch), else a new
        array of ``xp.concat`` (``array_api_strict``, JAX)."""
        xp = self.xp
        if self._native is None:
            return xp.concat([xp.reshape(arrays[m.index], (-1,)) for m in group.members])
        pieces = [arrays[m.index].reshape(-1) for m in group.members]  # the native method: no wrapper per member
        out = group.scratch.get(which)
        if out is None:  # allocated on first use, then kept (a group its kernels step never needs one)
            out = group.scratch[which] = xp.empty((group.size,), dtype=group.param_dtype, device=group.device)
        with self._writable():  # torch: cat(out=) refuses inputs that require grad outside no_grad
            self._native(pieces, out=out)
        return out

    def _verdict(self, gathered: list[Array], counts: list[Any]) -> Any:
        """One verdict for every gradient: the sum of each gathered flat gradient and of each per-parameter
        stack's stacked gradient, stacked, all finite; and every direct group's count of NaN and Inf zero.  A
        0-d device boolean (nothing read back), or a host bool when every part is known on the host.  A sum is
        NaN or Inf whenever an entry is (and may overflow on finite entries): :meth:`_raise_unless` settles a
        non-finite verdict exactly."""
        xp = self.xp
        parts: list[Any] = []
        with np.errstate(all="ignore"):  # a sum that overflows is a suspicion, settled exactly (NumPy would warn)
            sums = [xp.astype(xp.sum(f), xp.float32) for f in gathered]
            if sums:
                parts.append(xp.isfinite(sums[0]) if len(sums) == 1 else xp.all(xp.isfinite(xp.stack(sums))))
        parts += [c == 0 for c in counts]
        host = [bool(p) for p in parts if isinstance(p, bool | np.bool_)]
        device = [p for p in parts if not isinstance(p, bool | np.bool_)]
        if not all(host) or not device:
            return all(host)
        return device[0] if len(device) == 1 else xp.all(xp.stack(device))

    def _raise_unless(self, verdict: Any, grads: list[Array]) -> None:
        """Read the verdict (the one host conversion of the check); a non-finite one raises ``ValueError`` naming
        the first parameter whose gradient holds NaN or Inf (examined exactly, only on this error path)."""
        xp = self.xp
        if bool(verdict):
            return
        for i in range(len(self._keys)):
            bad = count_nonfinite(grads[i], xp)
            if bad:
                raise ValueError(
                    f"non-finite gradient: {bad} NaN or Inf entr{'y' if bad == 1 else 'ies'} in the gradient of "
                    f"{_where(self._names[i], None, self._shapes[i], self.count(i))}; no parameter "  # type: ignore[arg-type]
                    "and no optimizer state was changed"
                )

    def _refresh(
        self, grads: list[Array], due: list[bool]
    ) -> tuple[dict[tuple[int, int], tuple[Array, Array | None]], dict[tuple[int, int], Any], dict[int, State]]:
        """The refreshes due, in one :func:`~adadiag_ref.refresh_bases` call: the new stacks per block
        ``(group, block)``, per block whether each matrix's basis was computed from this gradient (``True`` for
        all, or a boolean ``(k, 1, 1)`` array), and the new states of the per-parameter members whose basis was
        computed from this gradient (a refresh that keeps the old basis, e.g. of a non-finite gradient, leaves
        its member out)."""
        xp = self.xp
        n_flat = len(self._flat)
        work: list[tuple[int, State]] = []
        for number, group in enumerate(self._flat):
            if due[number]:
                work += [(m.index, self._flat_member_state(group, m)) for m in group.members if m.block is not None]
        for number, pgroup in enumerate(self._per_param):
            if due[n_flat + number]:
                rotating = [i for i in pgroup.indices if layout_for(self._shapes[i], self.cfg).rotate_left]
                work += [(i, self._member_state(pgroup, i)) for i in rotating]
        if not work:
            return {}, {}, {}
        indices = [i for i, _ in work]
        names, counts = [self._names[i] for i in indices], [self.count(i) for i in indices]
        new = refresh_bases(
            [s for _, s in work], [grads[i] for i in indices], self.cfg, names=names, count=counts, xp=xp
        )
        done = {i: (old, fresh) for (i, old), fresh in zip(work, new, strict=True)}
        bases: dict[tuple[int, int], tuple[Array, Array | None]] = {}
        refreshed: dict[tuple[int, int], Any] = {}
        for number, group in enumerate(self._flat):
            for b, block in enumerate(group.blocks):
                members = [m for m in group.members if m.block == b and m.index in done]
                if not members:
                    continue
                flags = [done[m.index][1].P is not done[m.index][0].P for m in members for _ in range(m.matrices)]
                if not any(flags):
                    continue
                m_side, n_side = members[0].layout.rows, members[0].layout.cols
                fresh = [done[m.index][1] for m in members]
                P = xp.concat([xp.reshape(s.P, (-1, m_side, m_side)) for s in fresh])
                Q = xp.concat([xp.reshape(s.Q, (-1, n_side, n_side)) for s in fresh]) if block.right else None
                bases[(number, b)] = (P, Q)
                refreshed[(number, b)] = True if all(flags) else xp.reshape(
                    xp.asarray(flags, dtype=xp.bool, device=group.device), (-1, 1, 1))  # fmt: skip
        fresh_states = {i: fresh for i, (old, fresh) in done.items()
                        if self._home[i][0] == "per-parameter" and fresh.P is not old.P}  # fmt: skip
        return bases, refreshed, fresh_states

    def _compute(
        self,
        flats: list[Array | None],
        stacked: list[list[Array]],
        params: list[Array],
        lr: Any,
        bases: dict[tuple[int, int], tuple[Array, Array | None]],
        refreshed: dict[tuple[int, int], Any],
        fresh_states: dict[int, State],
        direct: list[Any],
        cfg: BaseConfig,
        proceed: Any,
    ) -> _Pending:
        """Every group's step under ``cfg`` into new arrays (nothing of the engine or the parameters written), but
        a direct rotated group's moments, which its kernels write in place (``U~`` over its own ``G~``), gated by
        ``proceed`` (the device verdict, or ``None``); its direction is kept for its tail kernel
        (:meth:`_run_kernels`)."""
        xp, family = self.xp, self._family
        eta = learning_rate(cfg, lr)
        moments_out: list[dict[str, Array | None] | None] = [None] * len(self._flat)  # None: written in place
        flat_params: list[Array | None] = [None] * len(self._flat)  # None: the parameters written by the kernels
        tails: dict[int, Array] = {}
        for number, (group, g) in enumerate(zip(self._flat, flats, strict=True)):
            if g is None:  # the group's kernels step it in place, after the verdict (_run_kernels)
                continue
            stacks = [bases.get((number, b), (blk.P, blk.Q)) for b, blk in enumerate(group.blocks)]
            t = host_step(group.count, group.dtype, xp)
            if direct[number] is not None:  # rotated, its tail by the kernels: W neither gathered nor written back
                into = self._scratch(group, "G~") if self._host else None  # on a device a product is a new array
                g_rot = self._rotated(group, number, g, stacks, refreshed, into)
                if self._kernels_of(group).moments(direct[number], self._own_moments(group), g_rot, t, proceed):
                    # the moments in place, gated by the verdict (U~ written over G~)
                    tails[number] = self._unrotated(group, g_rot, stacks, self._scratch(group, "D") if self._host
                                                    else None)  # fmt: skip
                else:
                    u_rot, moments_out[number] = self._direction(group, g_rot, t, cfg)
                    tails[number] = self._unrotated(group, u_rot, stacks)
                continue
            g_rot = self._rotated(group, number, g, stacks, refreshed)
            w_param = self._gathered(group, "W", params)
            w = xp.astype(w_param, group.dtype, copy=False)
            fused = self._fused_update(group, g, w, t, eta, cfg)
            if fused is not None:
                delta, moments_out[number] = fused
                flat_params[number] = w_param + xp.astype(delta, group.param_dtype, copy=False)
                continue
            u_rot, moments_out[number] = self._direction(group, g_rot, t, cfg)
            direction = self._unrotated(group, u_rot, stacks)
            eta_t = family.step_size(cfg, t, w, eta, xp)
            # with rotation blocks the direction is the fresh concatenation of _unrotated: the tail may overwrite
            # it (the same bits, tail.parameter_delta); without, it is the family's U~, which may share a moment
            owned = bool(group.blocks) and not self._immutable
            delta = xp.astype(decayed_step(direction, w, eta_t, cfg, owned=owned), group.param_dtype, copy=False)
            flat_params[number] = w_param + delta
        new_states: dict[tuple[int, int], State] = {}
        new_params: dict[int, Array] = {}
        for number, (pgroup, grad_stacks) in enumerate(zip(self._per_param, stacked, strict=True)):
            for s, (stack, g) in enumerate(zip(pgroup.stacks, grad_stacks, strict=True)):
                state, was_refreshed = self._fresh_stack(pgroup, stack, fresh_states)
                w = self._stacked(stack, params)
                stack_cfg = stack.cfg if cfg is self._cfg else step_config(
                    stack.cfg, weight_decay=cfg.weight_decay, betas=cfg.betas)  # fmt: skip
                delta, new_states[(number, s)] = routed_update(state, g, stack_cfg, w, lr, was_refreshed,
                                                               pgroup.count, xp)  # fmt: skip
                w_new = w + delta
                for position, i in enumerate(stack.indices):
                    new_params[i] = w_new[position, ...] if stack.stacked else w_new
        return _Pending(moments_out, flat_params, new_states, new_params, bases, tails)

    def _fresh_stack(self, pgroup: _ParamGroup, stack: _Stack, fresh_states: dict[int, State]) -> tuple[State, Any]:
        """The stack's state with this step's refreshed bases, and ``refreshed`` for :func:`update`: ``True`` when
        every member's basis was computed from this gradient, ``False`` when none was, else a boolean array with
        one entry per member (broadcast over its matrices)."""
        xp = self.xp
        flags = [i in fresh_states for i in stack.indices]
        if not any(flags):
            return stack.state, False
        fresh = [fresh_states[i] if i in fresh_states else self._member_state(pgroup, i) for i in stack.indices]
        if not stack.stacked:
            return fresh[0], True
        bases = {"P": xp.stack([f.P for f in fresh])}
        if stack.state.Q is not None:
            bases["Q"] = xp.stack([f.Q for f in fresh])
        state = stack.state._replace(**bases)
        if all(flags):
            return state, True
        shape = (len(flags),) + (1,) * (self.cfg.batch_dims + 2)  # over each member's (*B, m, n) work frame
        return state, xp.reshape(xp.asarray(flags, dtype=xp.bool, device=creation_device(state.P)), shape)

    def _fused_update(
        self, group: _FlatGroup, g: Array, w: Array, t: Any, eta: Any, cfg: BaseConfig
    ) -> tuple[Array, dict[str, Array | None]] | None:
        """``delta = -eta_t (U~ + lambda W_t)`` and the new moments of a group without rotation blocks by its
        fused update route, flat, or ``None`` (no such route, or it declines this step, e.g. an array ``lr``)."""
        if group.update_route is None:
            return None
        xp, shape = self.xp, (1, group.size)
        state = self._row_state(group.moments, group.size)
        found = group.update_route(state, _row_layout(group.size), t, xp.reshape(g, shape), xp.reshape(w, shape), cfg,
                                   eta, unrotate, xp)  # fmt: skip
        if found is None:
            return None
        delta, moments = found
        return xp.reshape(delta, (-1,)), _flattened(moments, xp)

    def _direction(
        self, group: _FlatGroup, g_rot: Array, t: Any, cfg: BaseConfig
    ) -> tuple[Array, dict[str, Array | None]]:
        """``U~, M_t, V_t`` of the whole flat group by its route (the routes take matrices: the group is handed
        over as one ``1 x N`` matrix, a view), flat again."""
        xp, family = self.xp, self._family
        state = self._row_state(group.moments, group.size)
        g_row = xp.reshape(g_rot, (1, group.size))
        found = group.direction(state, g_row, t, cfg, xp)
        u_rot, moments = found if found is not None else family.direction(state, g_row, t, cfg, xp)
        return xp.reshape(u_rot, (-1,)), _flattened(moments, xp)

    def _per_block(
        self,
        group: _FlatGroup,
        flat: Array,
        product: Callable[..., Array],
        into: Array | None = None,
        plain: tuple[list[tuple[Any, Any]], bool] | None = None,
    ) -> Array:
        """``flat`` with each rotation block's entries replaced by ``product(b, block, stack, out, part)`` of its
        stack ``(k, a, b)`` (``part``: which of the block's matrices ``stack`` holds; one batched call per block),
        the unrotated entries as they are; ``flat`` itself without blocks.  In host memory each matrix's last
        product is written into its slice of one flat array (``out``: ``into`` where given, the group's scratch,
        else a new one), not concatenated afterwards; on NumPy the products are spread over threads with BLAS
        single-threaded (:func:`~adadiag_ref.optim.blas_threads.run_balanced`), on CPU torch one ``torch.mm`` per
        matrix (as :func:`~adadiag_ref.optim.rotation.rotate` calls it: ``ar.step``'s bits), an output off a
        fresh tensor's alignment computed apart and copied (:func:`_aligned_copy`); there ``plain`` (the
        blocks' bases and the direction, for a product without a refresh step's structure) takes the products
        through the blocks' factors and matrix views, made once and kept while the arrays are the same
        (:meth:`_matrices`)."""
        if not group.blocks:
            return flat
        xp = self.xp
        if self._host and type(flat) is not np.ndarray:
            mm = sys.modules["torch"].mm  # CPU torch tensors here: torch is imported
            result = xp.empty((group.size,), dtype=flat.dtype, device=group.device) if into is None else into
            kept = [id(x) for x in group.scratch.values()]  # the group's own arrays persist: their views are kept
            for b, block in enumerate(group.blocks):
                sources, sources_aligned = self._matrices(block, flat, id(flat) in kept)
                small = block.stop - block.start <= _STAGED_SIZE
                if small and not all(sources_aligned):  # the block copied once to an aligned array, not per matrix
                    _, sources, sources_aligned = self._staged(block, "sources", flat, flat)
                targets, targets_aligned = self._matrices(block, result, id(result) in kept)
                staged = None
                if small and not all(targets_aligned):  # the products into one such array, then into ``result``
                    staged, targets, targets_aligned = self._staged(block, "targets", result)
                if plain is not None:
                    Ls, Rs = self._host_factors(block, *plain[0][b], plain[1])
                for i, (source, out) in enumerate(zip(sources, targets, strict=True)):
                    target = out if targets_aligned[i] else None
                    operand = source if sources_aligned[i] else _aligned_copy(source)
                    if plain is None:
                        made = product(b, block, operand, target, i)
                    else:
                        made = _sandwich(operand, Ls[i], Rs[i], not block.transposed, target, mm)
                    if made is not out:
                        out[...] = made
                if staged is not None:
                    result[block.start : block.stop] = staged
            result[group.unrotated_start :] = flat[group.unrotated_start :]
            return result
        if type(flat) is np.ndarray:
            result = np.empty(group.size, dtype=flat.dtype) if into is None else into
            costs = [2.0 * block.a * block.b * (min(block.a, block.b) + (max(block.a, block.b) if block.right else 0))
                     for block in group.blocks]  # P^T G (and G Q) of one matrix  # fmt: skip
            spread = spreads(sum(c * block.matrices for c, block in zip(costs, group.blocks, strict=True)))
            tasks = []
            for b, block in enumerate(group.blocks):
                shape = (block.matrices, block.a, block.b)
                span = slice(block.start, block.stop)
                source, target = flat[span].reshape(shape), result[span].reshape(shape)
                # spread: one job per matrix (the products are independent); else one call per block, in order
                parts = [slice(i, i + 1) for i in range(block.matrices)] if spread else [slice(None)]
                for part in parts:
                    job = functools.partial(_product_into, product, b, block, source, target, part)
                    tasks.append((costs[b] * (1 if spread else block.matrices), job))
            run_balanced(tasks)
            result[group.unrotated_start :] = flat[group.unrotated_start :]
            return result
        pieces = []
        for b, block in enumerate(group.blocks):
            stack = xp.reshape(flat[block.start : block.stop], (block.matrices, block.a, block.b))
            pieces.append(xp.reshape(product(b, block, stack, None, slice(None)), (-1,)))
        if group.unrotated_start < group.size:
            pieces.append(flat[group.unrotated_start :])
        return xp.concat(pieces)

    def _rotated(
        self,
        group: _FlatGroup,
        number: int,
        g: Array,
        stacks: list[tuple[Any, Any]],
        refreshed: dict[Any, Any],
        into: Array | None = None,
    ) -> Array:
        """``G~`` of the whole group, flat: per block the batched rotation of its stack (on a refresh step set to
        its exact structure, matrix by matrix), then the unrotated entries as they are."""
        xp = self.xp

        def rotate(b: int, block: _Block, stack: Array, out: Array | None, part: slice | int) -> Array:
            flags = refreshed.get((number, b), False)
            if flags is not True and flags is not False:
                flags = flags[part]  # one flag per matrix
            r = _rotate_stack(stack, block, *_bases_part(stacks[b], part), False, out if flags is False else None)
            if flags is False:
                return r
            work = _transpose(r) if block.transposed else r
            work = refresh_step_structure(work, block.right, flags, xp)
            return _transpose(work) if block.transposed else work

        structured = any((number, b) in refreshed for b in range(len(group.blocks)))  # a refresh step's G~
        return self._per_block(group, g, rotate, into, None if structured else (stacks, False))

    def _unrotated(
        self, group: _FlatGroup, u_rot: Array, stacks: list[tuple[Any, Any]], into: Array | None = None
    ) -> Array:
        """``D = P U~ Q^T`` of the whole group, flat (per block batched, the unrotated entries as they are)."""
        return self._per_block(group, u_rot, lambda b, block, stack, out, part: _rotate_stack(
            stack, block, *_bases_part(stacks[b], part), True, out), into, (stacks, True))  # fmt: skip

    def _matrices(self, block: _Block, flat: Array, keep: bool) -> tuple[list[Array], list[bool]]:
        """The block's matrices in ``flat`` (CPU torch) as views, and whether each lies at a fresh tensor's
        alignment; with ``keep`` (one of the group's scratch arrays, which persist) made once and kept."""
        kept = block.views.get(id(flat))
        if kept is None or kept[0] is not flat:
            kept = (flat, *self._stack_views(block, flat[block.start : block.stop]))
            if keep:
                block.views[id(flat)] = kept
        return kept[1], kept[2]

    def _stack_views(self, block: _Block, span: Array) -> tuple[list[Array], list[bool]]:
        """The block's matrices in ``span`` (its entries) as views, and whether each lies at a fresh tensor's
        alignment."""
        views = list(self.xp.reshape(span, (block.matrices, block.a, block.b)).unbind(0))
        return views, [v.data_ptr() % _ALIGNMENT == 0 for v in views]

    def _staged(
        self, block: _Block, role: str, like: Array, source: Array | None = None
    ) -> tuple[Array, list[Array], list[bool]]:
        """The block's kept array ``role`` (its entries only) at a fresh tensor's alignment, one per dtype (that of
        ``like``; CPU torch), with its matrices' views and their alignment (:meth:`_stack_views`); holding
        ``source``'s block entries where given.  A block off that alignment (tiny parameters) has its GEMM operands
        and outputs there: one copy per block instead of one per matrix."""
        key = (role, like.dtype)
        kept = block.staging.get(key)
        if kept is None:
            stage = self.xp.empty((block.stop - block.start,), dtype=like.dtype, device=like.device)
            kept = block.staging[key] = (stage, *self._stack_views(block, stage))
        if source is not None:
            kept[0].copy_(source[block.start : block.stop])
        return kept

    def _host_factors(self, block: _Block, P: Array, Q: Array | None, back: bool) -> tuple[list[Any], list[Any]]:
        """:func:`_factors` of the block's bases ``P``, ``Q`` (stacks) as lists of matrices (``None`` entries for
        a side without a factor), kept while the bases are the same arrays (a live engine's, written in place)."""
        kept = block.factors.get(back)
        if kept is None or kept[0] is not P or kept[1] is not Q:
            L, R = _factors(block, P, Q, back)
            none = [None] * block.matrices
            kept = block.factors[back] = (P, Q, none if L is None else list(L.unbind(0)),
                                          none if R is None else list(R.unbind(0)))  # fmt: skip
        return kept[2], kept[3]

    def _scratch(self, group: _FlatGroup, which: str) -> Array:
        """The group's flat scratch array ``which`` of its state dtype, made on first use and kept."""
        out = group.scratch.get(which)
        if out is None:
            out = group.scratch[which] = self.xp.empty((group.size,), dtype=group.dtype, device=group.device)
        return out

    def _commit(self, pending: _Pending, params: list[Array]) -> list[Array]:
        """Make a computed step the engine's (moments and bases replaced, counters advanced); returns the new
        parameters, in the engine's order (views of the flat results; a direct group's own arrays, written)."""
        xp = self.xp
        out: list[Any] = [None] * len(self._keys)
        for number, (group, moments, w_new) in enumerate(zip(self._flat, pending.moments, pending.flat_params,
                                                             strict=True)):  # fmt: skip
            if moments is not None:  # else stepped in place by its kernels
                new = {f: moments.get(f, group.moments[f]) for f in group.moments}
                group.moments = self._kept(group.moments, new)
            for b, block in enumerate(group.blocks):
                if (number, b) in pending.bases:
                    block.P, block.Q = self._kept((block.P, block.Q), pending.bases[(number, b)])
            group.count += 1
            for m in group.members:  # the parameters written by the kernels, or views of the flat result
                out[m.index] = params[m.index] if w_new is None else xp.reshape(w_new[m.offset : m.offset + m.size],
                                                                                self._shapes[m.index])  # fmt: skip
        for number, pgroup in enumerate(self._per_param):
            for s, stack in enumerate(pgroup.stacks):
                new_state = pending.states[(number, s)]
                arrays = [f for f in new_state._fields if f not in ("count", "param_shape")]
                kept = self._kept(tuple(getattr(stack.state, f) for f in arrays),
                                  tuple(getattr(new_state, f) for f in arrays))  # fmt: skip
                stack.state = new_state._replace(**dict(zip(arrays, kept, strict=True)))
            pgroup.count += 1
            for i in pgroup.indices:
                out[i] = pending.params[i]
        return out

    def _kept(self, old: Any, new: Any) -> Any:
        """A step's new arrays (a tuple or a dict of arrays or ``None``) as the engine keeps them: ``new`` itself,
        or, for a live engine (:meth:`from_states`), ``old`` with ``new``'s values written into it (each array
        keeps its memory, so the states handed out stay current)."""
        if not self._live:
            return new
        pairs = zip(old.values(), new.values(), strict=True) if isinstance(old, dict) else zip(old, new, strict=True)
        with self._writable():
            for target, value in pairs:
                if target is not None and value is not target:
                    target[...] = value
        return old


def routed_direction(state: State, g_rot: Array, t: Any, cfg: BaseConfig, xp: Namespace) -> tuple[Array, Moments]:
    """``U~`` and the new moments by the family's first direction route that applies to these arrays (numba on
    NumPy, the CuPy kernels on CuPy; ``None`` from a route that does not apply), else its reference ``direction``.
    A stack of matrices (``batch_dims``) takes the reference: the routes take single matrices."""
    family = family_of(cfg)
    for route in family.routes.direction if g_rot.ndim <= 2 else ():
        found = route(state, g_rot, t, cfg, xp)
        if found is not None:
            return found
    return family.direction(state, g_rot, t, cfg, xp)


def routed_update(
    state: State,
    grad: Array,
    cfg: BaseConfig,
    param: Array,
    lr: Any,
    refreshed: Any,
    count: int | None,
    xp: Namespace,
) -> tuple[Array, State]:
    """:func:`~adadiag_ref.update` of one parameter (or one ``batch_dims`` stack) with the family's routes tried
    first: its first fused update route that applies to a single matrix (moments, direction and tail in one
    call), else :func:`routed_direction` and the reference's rotation and tail.  The same formulas, so the same
    bits, except a direction kernel, which agrees to rounding (``Routes``).  ``count``: the host counter, as in
    :func:`~adadiag_ref.update` (``None``: the state's)."""
    step_in = prepare_step(state, grad, cfg, param, refreshed, xp, count)
    layout, family = step_in.layout, family_of(cfg)
    eta = learning_rate(cfg, lr)
    for route in () if layout.batch else family.routes.update:
        fused = route(state, layout, step_in.t, step_in.g_rot, step_in.w, cfg, eta, unrotate, xp)
        if fused is not None:
            delta, moments = fused
            new: State = state._replace(count=state.count + 1, **moments)
            return xp.astype(from_work(delta, layout, xp), param.dtype, copy=False), new
    return update_prepared(state, step_in, cfg, param, lr, xp, routed_direction)


def explain_route(cfg: BaseConfig, shape: Sequence[int], dtype: Any = None, *, xp: Namespace | None = None) -> Route:
    """The :class:`Route` a parameter of ``shape`` and ``dtype`` (default float32) on namespace ``xp`` (default
    NumPy) takes through an :class:`Engine` of ``cfg`` where it is alone in its group: a one-parameter engine
    over zeros, built and asked."""
    if xp is None:
        import array_api_compat.numpy as compat_numpy

        xp = compat_numpy
    param = xp.zeros(tuple(shape), dtype=xp.float32 if dtype is None else dtype)
    return Engine([param], cfg, xp=xp).routes()[0]
