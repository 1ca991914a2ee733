r"""Momentum SGD in continuous time: the reference system of the appendix (no discrete form in this library).

::

    W' = -M - lambda W,   M' = a (G - M),   H = L(W) + <M, M> / (2a),   dH/dt = -<M, M> (- lambda <G, W>)
"""

from __future__ import annotations

from typing import NamedTuple

from ..._xp import Array, Namespace
from .common import Constants, FlowField, Moments

__all__ = ["MomentumODEState"]


class MomentumODEState(NamedTuple):
    """Momentum SGD: parameter ``W`` and momentum ``M`` (both ``m x n``)."""

    W: Array
    M: Array


def fields(c: Constants) -> tuple[str, ...]:
    """``W, M``."""
    return MomentumODEState._fields


def update_order(c: Constants) -> tuple[tuple[str, ...], ...]:
    """``M``, then ``W``."""
    return (("M",), ("W",))


def vector_field(c: Constants, state: MomentumODEState, G: Array, xp: Namespace) -> FlowField:
    """``U~ = M``, ``M' = a (G - M)``."""
    M = state.M
    return FlowField(lambda: M, {"M": lambda: c.a * (G - M)})


def hamiltonian(c: Constants, state: MomentumODEState, loss: Array, xp: Namespace) -> Array:
    """``H = L + <M, M> / (2a)``."""
    return loss + xp.sum(state.M * state.M) / (2 * c.a)


def hamiltonian_rate(c: Constants, state: MomentumODEState, G: Array, xp: Namespace) -> Array:
    """``dH/dt = -<M, M>`` without weight decay."""
    return -xp.sum(state.M * state.M)


def initial_moments(c: Constants, G0: Array, zero: bool, f: Array, xp: Namespace) -> Moments:
    """``M0 = G0`` (or zero)."""
    return {"M": xp.zeros_like(G0) if zero else G0}
