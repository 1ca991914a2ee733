"""Count what a computation asks of a device backend, on the CPU: host conversions and namespace calls.

On a GPU two things make a small optimizer step slow: every *host conversion* (a device value read by Python:
``bool(x)``, ``int(x)``, ``float(x)``, a copy to NumPy) waits for the device to finish its queue, and every
*namespace call* (``xp.sqrt(x)``, ``x * y``, ``x[:, j]``) launches a kernel of a few microseconds at least.  Both
can be counted without a GPU: ``array_api_strict`` arrays stand in for device arrays, and :func:`count_traffic`
counts the calls made on them.

* **host conversions**: ``Array.__bool__``, ``__int__``, ``__float__``, ``__index__``, ``__complex__``,
  ``__array__``, ``__buffer__`` and ``__dlpack__`` (how :func:`~adadiag_ref._xp.to_numpy` copies), and the
  **bytes** they move device->host (the whole array converted: ``size * itemsize``);
* **namespace calls**: every call of a public function of ``array_api_strict`` or ``array_api_strict.linalg``
  made from outside them, plus every operator and indexing call on an array (``+``, ``@``, ``x[...]``, ...).

The CPU proxies of the GPU path (``tests/test_device_traffic.py``) are read from these counts.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HOST_CONVERSIONS", "Traffic", "count_traffic"]

HOST_CONVERSIONS = (
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "__array__",
    "__buffer__",
    "__dlpack__",
)
"""The ``array_api_strict.Array`` methods that hand a device value to the host."""

_OPERATORS = tuple(
    f"__{name}__"
    for name in (
        "abs add and eq floordiv ge getitem gt invert le lshift lt matmul mod mul ne neg or pos pow rshift sub "
        "truediv xor setitem radd rand rfloordiv rlshift rmatmul rmod rmul ror rpow rrshift rsub rtruediv rxor "
        "iadd iand ifloordiv ilshift imatmul imod imul ior ipow irshift isub itruediv ixor"
    ).split()
)


@dataclass
class Traffic:
    """The counts of one :func:`count_traffic` block, by name."""

    conversions: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)
    bytes_to_host: int = 0
    """Bytes the host conversions moved device->host: each converted array's ``size * itemsize``."""

    @property
    def host_conversions(self) -> int:
        """Device values read by the host (each one a synchronisation on a GPU)."""
        return sum(self.conversions.values())

    @property
    def namespace_calls(self) -> int:
        """Namespace functions, operators and indexing called on arrays (each one a kernel launch on a GPU)."""
        return sum(self.calls.values())


def _counting(
    method: Callable[..., Any],
    key: str,
    counter: Counter[str],
    depth: list[int],
    on_count: Callable[[Any], None] | None = None,
) -> Callable[..., Any]:
    """``method`` counting its outermost calls under ``key`` (a call made while another counted call runs is the
    backend's own business, not the caller's); ``on_count(self)`` is told of each counted call."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if depth[0] == 0:
            counter[key] += 1
            if on_count is not None:
                on_count(args[0])
        depth[0] += 1
        try:
            return method(*args, **kwargs)
        finally:
            depth[0] -= 1

    return wrapper


@contextlib.contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count the host conversions and namespace calls made on ``array_api_strict`` arrays inside the block.

    ::

        with count_traffic() as traffic:
            ar.step(state, grad, cfg, param, count=k, check=False)
        traffic.host_conversions, traffic.namespace_calls, traffic.bytes_to_host

    Not thread-safe (it patches the module and the array class for the block's duration).
    """
    import array_api_strict
    from array_api_strict import _array_object

    traffic = Traffic()
    depth = [0]

    def moved(array: Any) -> None:
        traffic.bytes_to_host += int(array.size) * array.dtype._np_dtype.itemsize

    patches: list[tuple[Any, str, Any]] = []
    for module, prefix in ((array_api_strict, ""), (array_api_strict.linalg, "linalg.")):
        for name in dir(module):
            value = getattr(module, name)
            if name.startswith("_") or not inspect.isfunction(value):
                continue
            patches.append((module, name, _counting(value, prefix + name, traffic.calls, depth)))
    array_type = _array_object.Array
    for names, counter, on_count in ((_OPERATORS, traffic.calls, None), (HOST_CONVERSIONS, traffic.conversions, moved)):
        for name in names:
            if name in array_type.__dict__:
                patches.append((array_type, name, _counting(getattr(array_type, name), name, counter, depth, on_count)))
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, wrapped in patches:
            setattr(owner, name, wrapped)
        yield traffic
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
