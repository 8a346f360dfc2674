"""The process's C heap (glibc malloc): kept once grown, so tensor temporaries do not fault.

A prefill allocates and frees megabytes of tensor temporaries per layer of every chunk, on a
gRPC pool thread, that is in a non-main malloc arena. With glibc's defaults (a dynamic mmap
threshold, and a trim threshold of twice it) the freed top of that arena's heap goes back to
the kernel, and allocations at or above the threshold are mmapped and unmapped each time, so
the next chunk faults every page in again, zeroed. Measured here on the tiny model (a
256-token prefill over a 1,792-token cached prefix, bench/e2e's cached case): 4,000-10,000
minor page faults and about 20 ms more CPU than the same prefill on the main thread (about
125-145 ms against 110), a share of the cached TTFT no single-process engine pays.

``keep_heap()`` fixes both thresholds (setting either turns glibc's dynamic adjustment off,
so both are set): allocations under ``MMAP_THRESHOLD_BYTES`` come from the heap, and a heap is
trimmed only past ``TRIM_THRESHOLD_BYTES`` of free memory at its top. A worker's heap thus
stays at its peak (a few hundred MB at most here: a prefill chunk's temporaries), as it would
under jemalloc or tcmalloc, the allocators PyTorch recommends for CPU inference. Elsewhere than
glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_heap() -> bool:
    """Sets the thresholds above, process-wide (every thread's arena, from the next call to
    malloc/free on). True when glibc took both; False (nothing changed) elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name, or no mallopt in it
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        log.warning("mallopt refused the heap thresholds; tensor temporaries may fault their pages in per chunk")
    return ok
