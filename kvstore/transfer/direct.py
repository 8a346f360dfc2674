"""Sender side of direct placement (shm backend): maps the receiver's regions and writes a body
into its segments, checksumming each block while it is hot in cache (one pass over the bytes).

``PeerRegions`` opens ``/proc/<receiver pid>/fd/<fd>`` for each ``placement.Region`` it is given
(same host, same user: the shm listener only admits peers of its own uid), checks the inode,
and maps the file shared; maps are reused for the connection's life and unmapped on ``close``.
``copy_with_checksum`` walks the body in ``COPY_BLOCK_BYTES`` blocks (also how a body already in memory, a
shm ring slot or a ucx staging buffer, lands in its destination: ``wire.land``)::

    body   [ block 0 | block 1 | ... ]            crc = checksum(block, crc); copy block -> segment
    dest   segment 0 (region a, offset x) | segment 1 (region a, offset y) | ...

``pieces`` cuts a large row chunk into consecutive row ranges of about ``DIRECT_PIECE_BYTES``
(each announced with its own header and checksum, so the receiver checks one while the next is
copied) and ``byte_range`` takes a piece's bytes out of the body's parts or segments.

I/O loop thread only; no locks.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import numpy as np

from kvstore.transfer.frames import ChecksumAlgo, FrameError, FrameHeader, Kind, checksum
from kvstore.transfer.placement import Region, Segment

COPY_BLOCK_BYTES = 512 << 10  # half of L2: the copy reads what the checksum just read (measured best of 128 KiB-2 MiB)
DIRECT_PIECE_BYTES = 2 << 20  # a larger row chunk may be copied and announced in pieces of about this


class PeerRegions:
    """The receiver's shared-memory files, mapped into this (sending) process."""

    def __init__(self, peer_pid: int):
        self.peer_pid = peer_pid
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, np.ndarray]] = {}

    def array(self, region: Region) -> np.ndarray:
        """A writable uint8 view of ``region``; ``FrameError`` if it cannot be mapped."""
        key = (region.fd, region.inode)
        found = self._maps.get(key)
        if found is None:
            found = self._map(region)
            self._maps[key] = found
        return found[1]

    def _map(self, region: Region) -> tuple[mmap.mmap, np.ndarray]:
        path = f"/proc/{self.peer_pid}/fd/{region.fd}"
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise FrameError(f"cannot open the receiver's region {path}: {exc}") from exc
        try:
            stat = os.fstat(fd)
            if stat.st_ino != region.inode or stat.st_size < region.nbytes:
                raise FrameError(
                    f"receiver region {path} is inode {stat.st_ino} of {stat.st_size} bytes; "
                    f"placement says inode {region.inode} of {region.nbytes}"
                )
            mapping = mmap.mmap(fd, region.nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return mapping, np.frombuffer(mapping, dtype=np.uint8)

    def targets(self, regions: tuple[Region, ...], segments: list[Segment]) -> list[np.ndarray]:
        """Writable views of ``segments`` (already checked to lie inside their regions)."""
        return [self.array(regions[r])[offset : offset + nbytes] for r, offset, nbytes in segments]

    def close(self) -> None:
        """Forget the maps; each is unmapped once the last view of it is gone (numpy views
        pin an mmap, so closing it here could fail)."""
        self._maps = {}


def copy_with_checksum(algo: ChecksumAlgo, parts: Sequence[memoryview], targets: list[np.ndarray]) -> int:
    """Copy the body (``parts`` in order) into ``targets`` (whose sizes add up to it) in order;
    returns the body's checksum, computed block by block just before each block is copied."""
    if len(parts) == 1 and len(targets) == 1 and parts[0].nbytes <= COPY_BLOCK_BYTES:
        # A small chunk: one block, copied by memoryview, which (unlike numpy) keeps the GIL; so
        # does the checksum. Giving the GIL away and back would cost more than both.
        crc = checksum(algo, parts[0], hold_gil=True)
        memoryview(targets[0])[:] = parts[0]
        return crc
    crc, index, offset = 0, 0, 0  # position in targets
    for part in parts:
        source = np.frombuffer(part, dtype=np.uint8)
        done = 0
        while done < len(source):
            target = targets[index]
            take = min(len(source) - done, len(target) - offset, COPY_BLOCK_BYTES)
            block = source[done : done + take]
            if take < COPY_BLOCK_BYTES:  # a small part: keep the GIL (see above)
                crc = checksum(algo, block, crc, hold_gil=True)
                memoryview(target[offset : offset + take])[:] = memoryview(block)
            else:
                crc = checksum(algo, block, crc)
                np.copyto(target[offset : offset + take], block)
            done += take
            offset += take
            if offset == len(target):
                index, offset = index + 1, 0
    assert index == len(targets) and offset == 0, "targets and body sizes differ"
    return crc


def checksum_of(algo: ChecksumAlgo, views: list[memoryview]) -> int:
    """Checksum of the concatenation of ``views`` (the receiver's check of a direct write)."""
    crc = 0
    for view in views:
        crc = checksum(algo, view, crc, hold_gil=view.nbytes <= COPY_BLOCK_BYTES)
    return crc


def pieces(header: FrameHeader) -> list[FrameHeader]:
    """A row chunk of more than ``DIRECT_PIECE_BYTES`` as headers of consecutive row ranges of
    about that size (``aux``: the piece's byte offset in the body); any other chunk as itself."""
    rows = header.token_end - header.token_start
    if header.kind != Kind.MLA_ROWS or header.body_bytes <= DIRECT_PIECE_BYTES or rows < 2:
        return [header]
    row_bytes = header.body_bytes // rows
    step = max(1, DIRECT_PIECE_BYTES // row_bytes)
    return [
        header._replace(
            token_start=header.token_start + start,
            token_end=header.token_start + min(rows, start + step),
            shape=(min(rows, start + step) - start, *header.shape[1:]),
            body_bytes=(min(rows, start + step) - start) * row_bytes,
            aux=start * row_bytes,
        )
        for start in range(0, rows, step)
    ]


def byte_range(parts: Sequence, start: int, nbytes: int) -> list:
    """Bytes [start, start + nbytes) of a body given as ``parts`` in order: memoryviews (views
    of them) or segments ``(region, offset, nbytes)`` (segments of them)."""
    out = []
    for part in parts:
        size = part[2] if isinstance(part, tuple) else part.nbytes
        if start >= size:
            start -= size
            continue
        take = min(size - start, nbytes)
        out.append((part[0], part[1] + start, take) if isinstance(part, tuple) else part[start : start + take])
        nbytes -= take
        start = 0
        if not nbytes:
            break
    return out
