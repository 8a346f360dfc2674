"""The in-process baselines of ``bench.transfer`` (see its docstring): plain memory copies and
the one-copy shm transfer's own work without the transfer. Those measured between child
processes (the socket and UCX ceilings, Mooncake) are ``bench.transfer_peers``.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np


def memcpy_gbps(size: int, total_bytes: int, repeats: int) -> list[float]:
    """``numpy.copyto`` of ``total_bytes`` in ``size`` pieces between the same two ``size``
    buffers (the issue's baseline; both stay in cache, so at 16 MiB it is an upper bound)."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.ones(size, dtype=np.uint8)
    count = total_bytes // size
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            np.copyto(dst, src)
        samples.append(count * size / (time.perf_counter() - start) / 1e9)
    return samples


def streaming_memcpy_gbps(size: int, total_bytes: int, repeats: int) -> list[float]:
    """``numpy.copyto`` of the bytes one transfer sample moves: ``total_bytes`` of distinct
    source into distinct destination, in ``size`` pieces, in one process."""
    src = np.ones(total_bytes, dtype=np.uint8)
    dst = np.ones(total_bytes, dtype=np.uint8)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for offset in range(0, total_bytes, size):
            np.copyto(dst[offset : offset + size], src[offset : offset + size])
        samples.append(total_bytes / (time.perf_counter() - start) / 1e9)
    return samples


def one_copy_gbps(size: int, total_bytes: int, repeats: int, verify: bool, algo=None) -> list[float]:
    """The work of one direct shm transfer of ``total_bytes`` in ``size`` frames, without the
    transfer: each frame ``copy_with_checksum``-ed from a distinct source into distinct
    shareable memory (the sender) and, with ``verify``, checksummed there (the receiver), all
    in this thread; ``algo``: the checksum (default: the transfer engine's)."""
    from kvstore.transfer.direct import checksum_of, copy_with_checksum
    from kvstore.transfer.frames import default_checksum_algo

    algo = algo or default_checksum_algo()
    src = np.ones(total_bytes, dtype=np.uint8)
    fd = os.memfd_create("tidekv-bench-one-copy", os.MFD_CLOEXEC)  # as engine.memory.shareable_zeros
    try:
        os.ftruncate(fd, total_bytes)
        mapping = mmap.mmap(fd, total_bytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    dst = np.frombuffer(mapping, dtype=np.uint8)
    dst[:] = 0  # the transfer's warmup request has touched every page of the pool too
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for offset in range(0, total_bytes, size):
            frame = dst[offset : offset + size]
            crc = copy_with_checksum(algo, [memoryview(src[offset : offset + size])], [frame])
            if verify and checksum_of(algo, [memoryview(frame)]) != crc:
                raise AssertionError("the one-copy baseline's checksums differ")
        samples.append(total_bytes / (time.perf_counter() - start) / 1e9)
    del dst, frame  # views pin the mapping
    mapping.close()
    return samples


def memcpy_baselines(sizes: dict[str, int], total_bytes: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Samples of every in-process baseline, by baseline and size; the one-copy work with
    CRC32C (the checksum before ISA-L's CRC-32) at 16 MiB only."""
    from kvstore.transfer.frames import ChecksumAlgo

    big = {name: size for name, size in sizes.items() if name == "16MiB"}
    return {
        "one_copy_sender_crc32c": {
            name: one_copy_gbps(size, total_bytes, repeats, verify=False, algo=ChecksumAlgo.CRC32C)
            for name, size in big.items()
        },
        "one_copy_serial_crc32c": {
            name: one_copy_gbps(size, total_bytes, repeats, verify=True, algo=ChecksumAlgo.CRC32C)
            for name, size in big.items()
        },
        "memcpy_numpy_copyto": {name: memcpy_gbps(size, total_bytes, repeats) for name, size in sizes.items()},
        "memcpy_streaming": {name: streaming_memcpy_gbps(size, total_bytes, repeats) for name, size in sizes.items()},
        "one_copy_sender": {
            name: one_copy_gbps(size, total_bytes, repeats, verify=False) for name, size in sizes.items()
        },
        "one_copy_serial": {
            name: one_copy_gbps(size, total_bytes, repeats, verify=True) for name, size in sizes.items()
        },
    }
