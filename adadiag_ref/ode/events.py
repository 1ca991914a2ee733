r"""Terminal events: stop :func:`~.integrate.integrate` (and :func:`~.checks.check`) when a condition holds.

An event is any callable ``condition(t, y, args) -> bool``, evaluated after every accepted step; the first
that returns ``True`` ends the run there, with ``Solution.status == "event"`` and ``Solution.event`` naming
it.  The time is the end of that step (not a root located inside it): with adaptive steps the overshoot is
one step, and the stopping criteria below are one-sided anyway (``||grad L|| <= tol`` stays true).

* :func:`gradient_tolerance`: ``||grad L(W(t))||_F <= tol``, the stopping rule of an optimizer run
  (docs/ode.md): it ends a Rosenbrock run at its minimiser instead of integrating its slow tail to a fixed ``T``.
* :func:`loss_threshold`: ``L(W(t)) <= value``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._xp import Array

__all__ = ["Event", "event_name", "gradient_tolerance", "loss_threshold"]


@dataclass(frozen=True)
class Event:
    """A named terminal condition ``condition(t, y, args) -> bool`` (a plain callable works as well)."""

    name: str
    condition: Callable[[float, Array, Any], bool]

    def __call__(self, t: float, y: Array, args: Any) -> bool:
        return bool(self.condition(t, y, args))


def event_name(event: Callable[..., Any]) -> str:
    """The name reported for ``event``: :attr:`Event.name`, or a callable's ``__name__``."""
    return event.name if isinstance(event, Event) else getattr(event, "__name__", repr(event))


def gradient_tolerance(term: Any, tol: float) -> Event:
    """Stop once ``||grad L(W)||_F <= tol`` (``term.grad_norm``: a :class:`~.terms.SystemTerm`, or an
    :class:`~.terms.ODETerm` with ``grad_norm_fn``); one gradient evaluation per accepted step."""
    if not (math.isfinite(tol) and tol > 0):
        raise ValueError(f"the gradient tolerance must be a finite number > 0, got {tol!r}")
    return Event(f"||grad L|| <= {tol:g}", lambda t, y, args: term.grad_norm(y) <= tol)


def loss_threshold(term: Any, value: float) -> Event:
    """Stop once ``L(W) <= value`` (``term.loss``); one loss evaluation per accepted step."""
    if not math.isfinite(value):
        raise ValueError(f"the loss threshold must be finite, got {value!r}")
    return Event(f"L <= {value:g}", lambda t, y, args: term.loss(y) <= value)
