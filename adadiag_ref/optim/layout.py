"""Parameter-shape rules: how any parameter becomes an ``m x n`` work matrix.

* a 0-D parameter is a ``1 x 1`` matrix and a 1-D parameter of length n is a
  ``1 x n`` matrix whose basis is ``P = [1]``: every optimizer reduces to its
  baseline there, with no special case (``Q`` is never formed for them);
* a tensor with 3 or more dimensions (a conv kernel) is reshaped to
  ``(shape[0], prod(shape[1:]))``;
* when the matrix has more rows than columns the work frame is its transpose,
  so the one-sided rotation acts on the smaller side and ``P`` is
  ``min(m, n) x min(m, n)``;
* a side longer than ``max_basis_dim`` is not rotated (its basis is I);
* with ``batch_dims = k`` (:attr:`~adadiag_ref.config.BaseConfig.batch_dims`) a parameter of shape
  ``(*B, *S)``, ``len(B) == k``, is a stack of ``prod(B)`` parameters of shape ``S``: the rules above apply to
  ``S``, and every work-frame array carries the leading ``B`` (``(*B, m, n)``), so that rotations are matrix
  products over the stack and every statistic is taken per matrix (over the last two axes).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .._xp import Array, Namespace
from ..config import BaseConfig

__all__ = [
    "Layout",
    "flatten_in_memory_order",
    "from_work",
    "layout_for",
    "memory_shape",
    "split_batch",
    "to_work",
    "transposed_frame",
    "work_view",
]


class Layout(NamedTuple):
    """Static description of a parameter's work frame (hashable)."""

    shape: tuple[int, ...]
    rows: int  # m, the smaller side
    cols: int  # n
    transposed: bool
    rotate_left: bool  # P exists (m x m)
    rotate_right: bool  # Q exists (n x n)
    batch: tuple[int, ...] = ()  # B, the leading dimensions of independent matrices (cfg.batch_dims of them)


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, cols)`` of the parameter as a matrix, before the work frame's transposition."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def transposed_frame(shape: tuple[int, ...], batch_dims: int = 0) -> bool:
    """Whether a parameter of ``shape`` works in its transpose (a matrix with more rows than columns; for a
    stack, ``batch_dims > 0``, each matrix of it); the same for every config of that ``batch_dims``."""
    a, b = _matrix_shape(split_batch(tuple(int(d) for d in shape), batch_dims)[1])
    return a > b


def split_batch(
    shape: tuple[int, ...], batch_dims: int, *, name: str | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(B, S)``: the leading ``batch_dims`` dimensions of ``shape`` and the shape of each parameter of the stack
    (``ValueError`` when ``shape`` has fewer dimensions; ``name`` labels the parameter in its message)."""
    if len(shape) < batch_dims:
        who = f"parameter {name!r}" if name else "a parameter"
        raise ValueError(
            f"batch_dims={batch_dims} needs {who} with at least {batch_dims} dimensions (the leading ones "
            f"index independent matrices), got shape {shape}"
        )
    return shape[:batch_dims], shape[batch_dims:]


def layout_for(shape: tuple[int, ...], cfg: BaseConfig) -> Layout:
    """Apply the shape rules to a parameter of ``shape`` under ``cfg`` (to each matrix of the stack when
    ``cfg.batch_dims > 0``; ``ValueError`` for a parameter with fewer than ``cfg.batch_dims`` dimensions)."""
    shape = tuple(int(d) for d in shape)
    if any(d == 0 for d in shape):
        raise ValueError(f"empty parameters are not supported, got shape {shape}")
    batch, inner = split_batch(shape, cfg.batch_dims)
    a, b = _matrix_shape(inner)
    transposed = a > b  # transposed_frame's rule, on the (a, b) already at hand
    m, n = (b, a) if transposed else (a, b)
    matrix = len(inner) >= 2
    rotate_left = cfg.sides >= 1 and m <= cfg.max_basis_dim
    rotate_right = cfg.sides == 2 and matrix and rotate_left and n <= cfg.max_basis_dim
    return Layout(shape, m, n, transposed, rotate_left, rotate_right, batch)


def memory_shape(layout: Layout) -> tuple[int, int]:
    """``(a, b)``: one matrix of the parameter in its own memory order (the work frame's transpose when tall)."""
    return (layout.cols, layout.rows) if layout.transposed else (layout.rows, layout.cols)


def to_work(x: Array, layout: Layout, xp: Namespace) -> Array:
    """The ``m x n`` work-frame view of a parameter-shaped array (``(*B, m, n)`` for a stack)."""
    mat = xp.reshape(x, (*layout.batch, *memory_shape(layout)))
    return xp.matrix_transpose(mat) if layout.transposed else mat


def from_work(x: Array, layout: Layout, xp: Namespace) -> Array:
    """Inverse of :func:`to_work`: back to the parameter's own shape."""
    mat = xp.matrix_transpose(x) if layout.transposed else x
    return xp.reshape(mat, layout.shape)


def work_view(flat: Array, layout: Layout, xp: Namespace) -> Array:
    """The work-frame view ``(*B, m, n)`` of a parameter's slice of a flat array kept in the parameter's memory
    order (a tall parameter's work-frame arrays are transposed views, as :func:`~adadiag_ref.init` makes them)."""
    return to_work(flat, layout, xp)  # to_work's reshape takes the parameter's shape in its own memory order


def flatten_in_memory_order(x: Array, layout: Layout, xp: Namespace) -> Array:
    """:func:`work_view` undone: a work-frame array's entries in the parameter's memory order, flat (a view where
    ``x`` is one)."""
    return xp.reshape(xp.matrix_transpose(x) if layout.transposed else x, (-1,))
