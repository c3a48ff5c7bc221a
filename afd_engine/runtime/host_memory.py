"""How a rank process's C allocator treats the memory torch frees.

torch's CPU tensors come from the C library's malloc. glibc serves every request above its mmap
threshold (128 KiB at first, raised as large blocks are freed, up to 32 MiB) with a fresh mapping
and unmaps it on free, and it returns the top of its heap to the system once more than 128 KiB of
it is free. A step that allocates tens of megabytes of temporaries (a prefill: 32 prompts of 32
tokens make the MoE layers' padded expert blocks and the extend attention's keys 3-26 MB each)
then pays a page fault for every 4 KiB it writes, every step, often more than the arithmetic
itself. `retain_freed_memory` raises both thresholds once per process, so blocks up to 32 MiB come
from the heap and stay there for the next step to reuse; the process keeps the largest set of
temporaries a step has needed (bounded by what one step allocates, beside the KV pool allocated
up front). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# the largest mmap threshold glibc accepts on 64-bit systems: HEAP_MAX_SIZE / 2
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
TRIM_THRESHOLD = 1 << 30  # free heap kept before any is given back

_done: bool | None = None


def retain_freed_memory() -> bool:
    """Raises glibc's mmap and trim thresholds in this process (once); whether they are set."""
    global _done
    if _done is None:
        _done = _set_thresholds()
    return _done


def _set_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it; musl and others keep their defaults)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("could not raise the C allocator's mmap and trim thresholds; large temporaries page-fault")
    return ok
