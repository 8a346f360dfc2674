"""The shm backend's ring: a shared-memory file a sender creates per connection, through which
bodies without a direct placement travel (the receiver maps it; see ``shm``). Allocation in
FIFO order, freed by cumulative ACKs::

    0                tail (oldest unacked)        head (next free)                 size
    |  free (wraps)  |###### in flight ###########|     free                       |

I/O loop only; no locks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import mmap
import os
import secrets

import numpy as np

SHM_DIR = "/dev/shm"


class ShmRing:
    """The sender's ring: allocation in FIFO order, freed by ACKs. I/O loop only."""

    def __init__(self, size_bytes: int):
        self.name = f"tidekv-ring-{os.getpid()}-{secrets.token_hex(6)}"
        self.size_bytes = size_bytes
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
            self._map = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self._slots: collections.deque[tuple[int, int, int]] = collections.deque()  # (seq, offset, nbytes)
        self._head = 0
        self._freed = asyncio.Event()
        self._closed_reason: str | None = None

    def unlink(self) -> None:
        # Usually the receiver has already unlinked it after mapping, as intended.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))

    def _try_place(self, nbytes: int) -> int | None:
        if not self._slots:
            self._head = 0
            return 0 if nbytes <= self.size_bytes else None
        tail = self._slots[0][1]
        if self._head >= tail:  # free space is [head, size) and [0, tail)
            if self._head + nbytes <= self.size_bytes:
                return self._head
            return 0 if nbytes < tail else None
        return self._head if self._head + nbytes < tail else None

    def try_alloc(self, seq: int, nbytes: int) -> int | None:
        """Offset of a free slot of ``nbytes``, or None while the ring is too full."""
        offset = self._try_place(nbytes)
        if offset is not None:
            self._slots.append((seq, offset, nbytes))
            self._head = offset + nbytes
        return offset

    async def alloc(self, seq: int, nbytes: int) -> int:
        """Offset of a free slot of ``nbytes``; waits for ACKs while the ring is full."""
        while (offset := self._try_place(nbytes)) is None:
            if self._closed_reason is not None:
                raise ConnectionError(self._closed_reason)
            self._freed.clear()
            await self._freed.wait()
        self._slots.append((seq, offset, nbytes))
        self._head = offset + nbytes
        return offset

    def release(self, seq: int) -> None:
        """Free every slot up to frame ``seq`` (ACKs are cumulative)."""
        while self._slots and self._slots[0][0] <= seq:
            self._slots.popleft()
            self._freed.set()

    def fail(self, reason: str) -> None:
        self._closed_reason = reason
        self._freed.set()
