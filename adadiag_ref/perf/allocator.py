"""Fresh memory and the functional path: keep freed memory in the process (an opt-in, glibc only).

A functional step allocates its outputs: ``ar.update`` of the Adam family
returns new ``M_t``, ``V_t`` and ``delta``, 12 bytes per float32 parameter
(about 700 MB per step on LLaMA-60M).  glibc serves blocks above its mmap
threshold (at most 32 MiB) with fresh ``mmap`` s and hands them back to the
kernel on ``free``, and it trims the top of its heap; each step then writes to
pages the process does not hold, and the first touch of each is a page fault
plus a zeroing pass.  Inside a VM whose kernel reports free pages to the
hypervisor (virtio-balloon free page reporting, as on Firecracker), the page
returns to the host and the next touch costs a hypervisor fault too: measured on
the 2-core Firecracker VM of docs/performance.md, first-touch writes ran at
0.6-3.5 GB/s against 6.6 GB/s for writes to resident memory.

The library's own outputs no longer depend on this: they come from a pool of
resident blocks (:mod:`adadiag_ref.buffers`).  What a caller's loop allocates
itself (``W + delta``, its gradients, its temporaries) still comes from the C
library, and for those :func:`retain_freed_memory` asks glibc to serve every block from its heap and
not to trim it (``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD,
2^31 - 1)``), so a training loop reuses the pages of the step before.  The
same settings can be made without code for any process:
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 python train.py``.
The cost: memory the program frees stays reserved by the process (its
resident size does not drop), and a heap can fragment.  Nothing in the
library calls it; ``adadiag-ref bench --retain-freed-memory`` does, for the
rows it then prints.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

__all__ = ["free_page_reporting", "freed_memory_retained", "retain_freed_memory"]

#: glibc's ``mallopt`` parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: The largest ``int`` mallopt takes: the heap top is trimmed only above 2 GiB of free memory.
TRIM_THRESHOLD = 2**31 - 1

_PAGE_REPORTING = Path("/sys/module/page_reporting/parameters/reported_kib")
_retained = False  # a fact about this process: set once retain_freed_memory succeeded


def retain_freed_memory() -> bool:
    """Make glibc keep freed memory in the process: ``mallopt(M_MMAP_MAX, 0)`` and
    ``mallopt(M_TRIM_THRESHOLD, 2^31 - 1)``.  Process-wide and not undone.

    Returns whether both settings took effect (``False`` where the C library is not glibc, e.g. macOS, Windows,
    musl: nothing is changed there).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        # glibc's identification: musl and BSD libcs have no gnu_get_libc_version
        libc.gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    global _retained
    _retained = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _retained


def freed_memory_retained() -> bool:
    """Whether :func:`retain_freed_memory` succeeded in this process."""
    return _retained


def free_page_reporting() -> int | None:
    """KiB of free memory the kernel has reported to its hypervisor since boot (Linux free page reporting), or
    ``None`` where the kernel does not report free pages.  A growing value during a run means freed memory is
    leaving the VM, and re-touching it costs a hypervisor fault."""
    try:
        return int(_PAGE_REPORTING.read_text().strip())
    except (OSError, ValueError):
        return None
