r"""Test problems with matrix-shaped parameters, so that rotations matter.

A :class:`Problem` is a loss ``L(W)``, its gradient ``grad L(W)``, a starting
point ``W0`` (``m x n`` with ``m <= n``, the core's work frame) and, when known,
the optimal value ``L*``.  The data are drawn once from a seeded NumPy generator
and moved to the requested namespace, so every backend sees the same numbers.

* ``least_squares``: ``L(W) = 1/2 ||A W B - C||_F^2`` with ill-conditioned ``A``, ``B``.
* ``factorization``: ``L(W) = 1/2 ||W_1^T W_2 - Y||_F^2`` with ``W = [W_1 | W_2]``
  (``k x (m + n)``) and a rank-``k`` target ``Y``.
* ``rosenbrock``: the chained Rosenbrock function of the entries of ``W`` (row major).

Pass your own callables with :func:`custom_problem`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._xp import Array, Namespace

__all__ = [
    "PROBLEMS",
    "Problem",
    "custom_problem",
    "factorization_problem",
    "least_squares_problem",
    "make_problem",
    "rosenbrock_problem",
]


@dataclass(frozen=True, eq=False)
class Problem:
    """An objective ``L`` on ``m x n`` matrices.

    Attributes:
        name: short name (shown by the CLI).
        loss: ``W -> L(W)``, a 0-d array.
        grad: ``W -> grad L(W)``, an array shaped like ``W``.
        W0: starting point.
        optimal_value: ``L* = min L`` when known (plots show ``H - L*``), else ``None``.
        description: one line for humans.
    """

    name: str
    loss: Callable[[Array], Array]
    grad: Callable[[Array], Array]
    W0: Array
    optimal_value: float | None = None
    description: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        """``(m, n)``."""
        m, n = self.W0.shape
        return int(m), int(n)


def _namespace(xp: Namespace | None) -> Namespace:
    """``xp`` as given (problems and counterexamples build their data in it), NumPy's array-API one for ``None``."""
    if xp is not None:
        return xp
    import array_api_compat.numpy as np_xp

    return np_xp


def _orthogonal(rng: np.random.Generator, k: int) -> np.ndarray:
    """A Haar-distributed ``k x k`` orthogonal matrix (QR of a Gaussian, signs fixed by R's diagonal)."""
    Z = rng.standard_normal((k, k))
    Qm, Rm = np.linalg.qr(Z)
    return np.asarray(Qm * np.sign(np.diag(Rm))[None, :])


def _conditioned(rng: np.random.Generator, rows: int, cols: int, ratio: float) -> np.ndarray:
    """A ``rows x cols`` matrix whose singular values are log-spaced from 1 down to ``1 / ratio``."""
    k = min(rows, cols)
    sv = np.logspace(0.0, -np.log10(ratio), k)
    U = _orthogonal(rng, rows)[:, :k]
    V = _orthogonal(rng, cols)[:, :k]
    return np.asarray((U * sv[None, :]) @ V.T)


def least_squares_problem(
    m: int = 3,
    n: int = 4,
    *,
    p: int | None = None,
    q: int | None = None,
    cond: float = 1e3,
    noise: float = 0.0,
    seed: int = 0,
    identity_factors: bool = False,
    xp: Namespace | None = None,
) -> Problem:
    r"""``L(W) = 1/2 ||A W B - C||_F^2``, ``grad L = A^T (A W B - C) B^T``.

    ``A`` is ``p x m`` and ``B`` is ``n x q`` (defaults ``p = m + 1``, ``q = n + 1``)
    with singular values log-spaced so that the Hessian ``(B B^T) kron (A^T A)``
    has condition number ``cond``.  ``C = A W* B + noise * Z``; with ``noise = 0``
    the minimum is ``L* = 0``, otherwise ``L*`` is computed from the pseudo-inverses.
    ``identity_factors=True`` uses ``A = I``, ``B = I`` (``L = 1/2 ||W - C||^2``),
    whose gradient ``W - C`` can be set to any matrix: the counterexamples use it.
    """
    xp = _namespace(xp)
    rng = np.random.default_rng(seed)
    p = m + 1 if p is None else p
    q = n + 1 if q is None else q
    if identity_factors:
        A, B = np.eye(m), np.eye(n)
    else:
        ratio = float(cond) ** 0.25
        A, B = _conditioned(rng, p, m, ratio), _conditioned(rng, n, q, ratio)
    W_star = rng.standard_normal((m, n))
    C = A @ W_star @ B + noise * rng.standard_normal((A.shape[0], B.shape[1]))
    W_fit = np.linalg.pinv(A) @ C @ np.linalg.pinv(B)
    optimal = 0.5 * float(np.sum((A @ W_fit @ B - C) ** 2)) if noise else 0.0
    W0 = rng.standard_normal((m, n))
    A_x, B_x, C_x = xp.asarray(A), xp.asarray(B), xp.asarray(C)
    At, Bt = xp.matrix_transpose(A_x), xp.matrix_transpose(B_x)

    def loss(W: Array) -> Array:
        R = A_x @ W @ B_x - C_x
        return 0.5 * xp.sum(R * R)

    def grad(W: Array) -> Array:
        return At @ (A_x @ W @ B_x - C_x) @ Bt

    return Problem(
        name="least_squares",
        loss=loss,
        grad=grad,
        W0=xp.asarray(W0),
        optimal_value=optimal,
        description=f"1/2||A W B - C||^2, W {m}x{n}, Hessian cond {cond:g}"
        if not identity_factors
        else "1/2||W - C||^2",
    )


def factorization_problem(
    k: int = 2, m: int = 3, n: int = 4, *, scale: float = 0.5, seed: int = 0, xp: Namespace | None = None
) -> Problem:
    r"""``L(W) = 1/2 ||W_1^T W_2 - Y||_F^2`` for ``W = [W_1 | W_2]``, ``W_1`` ``k x m``, ``W_2`` ``k x n``.

    ``Y = U V^T`` has rank ``k``, so ``L* = 0``; the minimisers form a manifold
    (``W_1 -> T W_1``, ``W_2 -> T^{-T} W_2``), and the rotation acts on the ``k``-side.
    ``grad_{W_1} = W_2 R^T``, ``grad_{W_2} = W_1 R`` with ``R = W_1^T W_2 - Y``.
    ``W0`` is Gaussian with standard deviation ``scale`` (0 is a saddle).
    """
    xp = _namespace(xp)
    rng = np.random.default_rng(seed)
    Y = rng.standard_normal((m, k)) @ rng.standard_normal((k, n))
    W0 = scale * rng.standard_normal((k, m + n))
    Y_x = xp.asarray(Y)

    def residual(W: Array) -> Array:
        return xp.matrix_transpose(W[:, :m]) @ W[:, m:] - Y_x

    def loss(W: Array) -> Array:
        R = residual(W)
        return 0.5 * xp.sum(R * R)

    def grad(W: Array) -> Array:
        R = residual(W)
        return xp.concat([W[:, m:] @ xp.matrix_transpose(R), W[:, :m] @ R], axis=1)

    return Problem(
        name="factorization",
        loss=loss,
        grad=grad,
        W0=xp.asarray(W0),
        optimal_value=0.0,
        description=f"1/2||W1^T W2 - Y||^2, rank {k}, W {k}x{m + n}",
    )


def rosenbrock_problem(
    m: int = 2, n: int = 3, *, alpha: float = 100.0, W0: Any = None, xp: Namespace | None = None
) -> Problem:
    r"""Chained Rosenbrock on ``x = vec(W)`` (row major), ``N = m n``::

        L(W) = sum_{i<N} alpha (x_{i+1} - x_i^2)^2 + (1 - x_i)^2,    L* = 0 at W = 1

    ``grad_i = -4 alpha x_i d_i - 2 (1 - x_i) + 2 alpha d_{i-1}`` with
    ``d_i = x_{i+1} - x_i^2``.  ``W0`` defaults to the classic ``(-1.2, 1, -1.2, 1, ...)``.
    """
    xp = _namespace(xp)
    start = np.where(np.arange(m * n) % 2 == 0, -1.2, 1.0) if W0 is None else np.asarray(W0, dtype=np.float64)

    def loss(W: Array) -> Array:
        x = xp.reshape(W, (-1,))
        d = x[1:] - x[:-1] * x[:-1]
        return xp.sum(alpha * d * d + (1.0 - x[:-1]) ** 2)

    def grad(W: Array) -> Array:
        x = xp.reshape(W, (-1,))
        d = x[1:] - x[:-1] * x[:-1]
        zero = xp.zeros((1,), dtype=x.dtype)
        head = xp.concat([-4.0 * alpha * x[:-1] * d - 2.0 * (1.0 - x[:-1]), zero])
        tail = xp.concat([zero, 2.0 * alpha * d])
        return xp.reshape(head + tail, (m, n))

    return Problem(
        name="rosenbrock",
        loss=loss,
        grad=grad,
        W0=xp.asarray(start.reshape(m, n)),
        optimal_value=0.0,
        description=f"chained Rosenbrock, alpha {alpha:g}, W {m}x{n}",
    )


def custom_problem(
    loss: Callable[[Array], Array],
    grad: Callable[[Array], Array],
    W0: Array,
    *,
    name: str = "custom",
    optimal_value: float | None = None,
    description: str = "",
) -> Problem:
    """A :class:`Problem` from your own ``loss`` and ``grad`` callables (same namespace as ``W0``)."""
    if W0.ndim != 2:
        raise ValueError(f"W0 must be a matrix, got shape {tuple(W0.shape)}")
    return Problem(name=name, loss=loss, grad=grad, W0=W0, optimal_value=optimal_value, description=description)


PROBLEMS: dict[str, Callable[..., Problem]] = {
    "least_squares": least_squares_problem,
    "factorization": factorization_problem,
    "rosenbrock": rosenbrock_problem,
}


def make_problem(name: str, *, xp: Namespace | None = None, **options: Any) -> Problem:
    """The problem ``name`` (``least_squares``, ``factorization``, ``rosenbrock``) built with ``options``."""
    try:
        factory = PROBLEMS[name]
    except KeyError:
        raise ValueError(f"unknown problem {name!r}; choose one of {', '.join(PROBLEMS)}") from None
    return factory(xp=xp, **options)
