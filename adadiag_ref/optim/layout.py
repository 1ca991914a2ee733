"""Parameter-shape rules: how any parameter becomes an ``m x n`` work matrix.

* a 0-D parameter is a ``1 x 1`` matrix and a 1-D parameter of length n is a
  ``1 x n`` matrix whose basis is ``P = [1]``: every optimizer reduces to its
  baseline there, with no special case (``Q`` is never formed for them);
* a tensor with 3 or more dimensions (a conv kernel) is reshaped to
  ``(shape[0], prod(shape[1:]))``;
* when the matrix has more rows than columns the work frame is its transpose,
  so the one-sided rotation acts on the smaller side and ``P`` is
  ``min(m, n) x min(m, n)``;
* a side longer than ``max_basis_dim`` is not rotated (its basis is I).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .._xp import Array, Namespace
from ..config import BaseConfig

__all__ = ["Layout", "from_work", "layout_for", "to_work", "transposed_frame"]


class Layout(NamedTuple):
    """Static description of a parameter's work frame (hashable)."""

    shape: tuple[int, ...]
    rows: int  # m, the smaller side
    cols: int  # n
    transposed: bool
    rotate_left: bool  # P exists (m x m)
    rotate_right: bool  # Q exists (n x n)


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, cols)`` of the parameter as a matrix, before the work frame's transposition."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def transposed_frame(shape: tuple[int, ...]) -> bool:
    """Whether a parameter of ``shape`` works in its transpose (a matrix with more rows than columns); the
    same for every config."""
    a, b = _matrix_shape(tuple(int(d) for d in shape))
    return a > b


def layout_for(shape: tuple[int, ...], cfg: BaseConfig) -> Layout:
    """Apply the shape rules to a parameter of ``shape`` under ``cfg``."""
    shape = tuple(int(d) for d in shape)
    if any(d == 0 for d in shape):
        raise ValueError(f"empty parameters are not supported, got shape {shape}")
    a, b = _matrix_shape(shape)
    transposed = a > b  # transposed_frame's rule, on the (a, b) already at hand
    m, n = (b, a) if transposed else (a, b)
    matrix = len(shape) >= 2
    rotate_left = cfg.sides >= 1 and m <= cfg.max_basis_dim
    rotate_right = cfg.sides == 2 and matrix and rotate_left and n <= cfg.max_basis_dim
    return Layout(shape, m, n, transposed, rotate_left, rotate_right)


def to_work(x: Array, layout: Layout, xp: Namespace) -> Array:
    """The ``m x n`` work-frame view of a parameter-shaped array."""
    a, b = (layout.cols, layout.rows) if layout.transposed else (layout.rows, layout.cols)
    mat = xp.reshape(x, (a, b))
    return xp.matrix_transpose(mat) if layout.transposed else mat


def from_work(x: Array, layout: Layout, xp: Namespace) -> Array:
    """Inverse of :func:`to_work`: back to the parameter's own shape."""
    mat = xp.matrix_transpose(x) if layout.transposed else x
    return xp.reshape(mat, layout.shape)
