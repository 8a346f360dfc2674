"""Shareable memory on the receiving side: which shared-memory file backs a CPU tensor, so a
sink can describe its destination as a ``placement.PagePlacement`` that a same-host sender writes
into directly. Read-only lookups plus a small cache; imports torch (receiver side only).

A tensor qualifies when its storage lies in a ``MAP_SHARED`` mapping of a file this process
holds open: a memfd (``engine``'s host caches), or torch's ``share_memory_()`` storages. The
lookup reads ``/proc/self/maps`` for the mapping and scans ``/proc/self/fd`` for the fd of the
same inode; results are cached per mapping start and re-checked with one ``fstat`` (an fd
number reused for another file has another inode)::

    mapping  [start ................................ end)     file offset 0, inode I, fd F
                     tensor [data_ptr ... +nbytes)
    Region(F, I, min(end - start, file size)); tensor offset = data_ptr - start

Thread-safe (the cache has its own lock).
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

import torch

from kvstore.transfer.placement import Region

_lock = threading.Lock()
_cache: dict[int, tuple[Region, memoryview]] = {}  # mapping start -> region, byte view of it


@dataclass(frozen=True)
class TensorRegion:
    """Where a tensor lives: its region, a byte view of the whole region, and its byte offset."""

    region: Region
    view: memoryview
    offset: int


def region_of(tensor: torch.Tensor) -> TensorRegion | None:
    """The shared-memory region holding ``tensor``'s bytes, or None (GPU, not contiguous, private)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    address = tensor.data_ptr()
    found = _lookup(address, tensor.numel() * tensor.element_size())
    if found is None:
        return None
    start, region, view = found
    return TensorRegion(region, view, address - start)


def _lookup(address: int, nbytes: int) -> tuple[int, Region, memoryview] | None:
    with _lock:
        for start, (region, view) in list(_cache.items()):
            if start <= address and address + nbytes <= start + region.nbytes:
                if _still_valid(region):
                    return start, region, view
                del _cache[start]
        mapping = _find_mapping(address, nbytes)
        if mapping is None:
            return None
        start, end, device, inode = mapping
        fd = _fd_of_file(device, inode)
        if fd is None:
            return None
        region = Region(fd, inode, min(end - start, os.fstat(fd).st_size))  # mappings round up to pages
        view = memoryview((ctypes.c_ubyte * region.nbytes).from_address(start)).cast("B")
        _cache[start] = (region, view)
        return start, region, view


def _still_valid(region: Region) -> bool:
    try:
        stat = os.fstat(region.fd)
    except OSError:
        return False
    return stat.st_ino == region.inode and stat.st_size >= region.nbytes


def _find_mapping(address: int, nbytes: int) -> tuple[int, int, int, int] | None:
    """(start, end, device, inode) of the shared file mapping at file offset 0 holding the range."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if not low <= address < high:
                continue
            shared = fields[1].endswith("s") and fields[1].startswith("rw")
            inode = int(fields[4])
            if not shared or inode == 0 or int(fields[2], 16) != 0 or address + nbytes > high:
                return None
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            return low, high, os.makedev(major, minor), inode
    return None


def _fd_of_file(device: int, inode: int) -> int | None:
    for name in os.listdir("/proc/self/fd"):
        try:
            stat = os.stat(f"/proc/self/fd/{name}")
            if stat.st_ino == inode and stat.st_dev == device:
                return int(name)
        except OSError:
            continue
    return None
