"""Host memory for the cache: zeroed CPU tensors in shareable memory (a memfd mapped
``MAP_SHARED``), so a same-host peer can be given the file and write received KV straight into
the pages (the transfer engine's shm backend finds the file through ``/proc/self/maps``).

A memfd behaves like anonymous memory (zero-filled, freed when the last mapping and fd go) but
is not limited by the size of ``/dev/shm``. The fd stays open exactly as long as the mapping:
a finalizer on the mmap object closes it. No state beyond that; thread-safe.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref

import torch


def shareable_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A zeroed tensor; on CPU backed by a memfd mapping, elsewhere a plain ``torch.zeros``."""
    if torch.device(device).type != "cpu" or not hasattr(os, "memfd_create"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    fd = os.memfd_create("tidekv-cache", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mapping, os.close, fd)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)
