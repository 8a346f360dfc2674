"""Collectives over the ranks of one host through shared memory: the sums, broadcasts and
gathers a CPU group runs instead of gloo's (which go through loopback TCP, ~1 ms a call) when
every rank of the group sees the same shared-memory directory.

Owns ``HostReducer`` and ``open_host_reducer``, its collective set-up. Each rank of the group
owns two slots (double buffering) in one shared-memory file, and there is one FIFO per ordered
pair of ranks. A collective runs in rounds of at most ``CHUNK_BYTES``: this rank's part into its
slot (a sum's partial, a gather's piece, a broadcast's source), one byte down its FIFO to every
other rank, one byte read from every other rank's FIFO, then the slots read: a sum adds them in
rank order, so that every rank computes the same bits. Alternating the slots makes a second
barrier unnecessary: a rank starts round k only after every other rank has signalled round
k-1, and a rank signals round k-1 only after it has finished reading round k-2's slots (the
ones round k overwrites). One FIFO per pair keeps each sender's signals in order even when a
fast rank is a round ahead of a slow one.

A rank that dies closes its FIFOs: a read then sees end of file, a write EPIPE, and the
collective raises ``GroupFailed`` at once; a rank that hangs makes the wait time out after
the group's timeout. The directory is removed as soon as every rank has the file mapped and its FIFOs
open, so nothing outlives the processes, SIGKILL included. Peers' practice: SGLang and
DeepSpeed run CPU tensor parallelism on a shared-memory all-reduce for the same reason.
Not thread-safe: one thread drives a rank's collectives.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import select
import shutil
import tempfile

import torch
import torch.distributed as dist

from engine.parallel.comm import GroupFailed, collective

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 21  # per slot: a 2,048-token x 256 float32 activation in one round
SHM_DIRS = ("/dev/shm",)  # where the slots live when writable; else the temp directory


class HostReducer:
    """The shared-memory sum of one group whose ranks share a host. ``slots``: the mapped file
    (2 slots of ``chunk_bytes`` per rank); ``me``: this rank's index in the group; ``inbound`` /
    ``outbound``: the FIFOs from and to every other rank (file descriptors, non-blocking)."""

    def __init__(self, slots: mmap.mmap, size: int, me: int, inbound: list[int], outbound: list[int],
                 chunk_bytes: int, timeout_s: float):
        self.size, self.me, self.chunk_bytes, self.timeout_s = size, me, chunk_bytes, timeout_s
        self._map = slots
        buf = torch.frombuffer(slots, dtype=torch.uint8)
        self._slots = [[buf[(s * size + r) * chunk_bytes:(s * size + r + 1) * chunk_bytes] for r in range(size)]
                       for s in (0, 1)]
        self._inbound, self._outbound = inbound, outbound
        self._polls = []
        for fd in inbound:
            poll = select.poll()
            poll.register(fd, select.POLLIN)
            self._polls.append(poll)
        self._seq = 0

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (contiguous, on CPU) becomes the sum of every rank's ``x``, in place."""
        for part in self._parts(x):
            slots = self._exchange(part, write=True)
            torch.add(slots[0], slots[1], out=part)
            for s in slots[2:]:
                part.add_(s)
        return x

    def broadcast_(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """``x`` (contiguous, on CPU) becomes group rank ``src``'s ``x``, in place."""
        for part in self._parts(x):
            slots = self._exchange(part, write=self.me == src)
            if self.me != src:
                part.copy_(slots[src])
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (contiguous, on CPU, one shape), stacked in rank order: [size, *x.shape]."""
        out = torch.empty((self.size, x.numel()), dtype=x.dtype)
        start = 0
        for part in self._parts(x):
            slots = self._exchange(part, write=True)
            for r, s in enumerate(slots):
                out[r, start:start + part.numel()].copy_(s)
            start += part.numel()
        return out.view(self.size, *x.shape)

    def _parts(self, x: torch.Tensor):
        flat = x.view(-1)
        step = self.chunk_bytes // x.element_size()
        return (flat[start:start + step] for start in range(0, flat.numel(), step))

    def _exchange(self, part: torch.Tensor, write: bool) -> list[torch.Tensor]:
        """One round: ``part`` into this rank's slot (when ``write``), a signal to every rank and
        one from every rank; returns every rank's slot, viewed like ``part``."""
        nbytes = part.numel() * part.element_size()
        slots = [s[:nbytes].view(part.dtype) for s in self._slots[self._seq & 1]]
        self._seq += 1
        if write:
            slots[self.me].copy_(part)
        for fd in self._outbound:
            try:
                os.write(fd, b"\x01")
            except OSError as e:  # EPIPE: the reader is gone
                raise GroupFailed(f"a rank of the group is gone (its channel: {e})") from e
        for fd, poll in zip(self._inbound, self._polls, strict=True):
            self._wait(fd, poll)
        return slots

    def _wait(self, fd: int, poll: select.poll) -> None:
        while True:
            try:
                got = os.read(fd, 1)
            except BlockingIOError:
                got = None
            if got:
                return
            if got == b"":
                raise GroupFailed("a rank of the group is gone (its channel closed)")
            if not poll.poll(self.timeout_s * 1000):
                raise GroupFailed(f"a rank of the group sent nothing for {self.timeout_s:.0f} s")

    def close(self) -> None:
        """Closes the FIFOs (the other ranks' next collective fails) and drops the slots: the
        mapping goes with the last tensor that views it (each holds the mmap object), never
        under one (``mmap.close`` would unmap it while a view still reads it)."""
        for fd in (*self._inbound, *self._outbound):
            os.close(fd)
        self._inbound, self._outbound, self._polls = [], [], []
        self._slots = []
        self._map = None


def _fifo(directory: str, src: int, dst: int) -> str:
    return os.path.join(directory, f"{src}-to-{dst}")


def _make_directory(size: int, chunk_bytes: int) -> tuple[str, str]:
    """The leader's side: the slots file (space reserved now, not on first touch: a full tmpfs
    would otherwise kill a rank with SIGBUS mid-sum), the FIFOs and a nonce; OSError on failure."""
    base = next((d for d in SHM_DIRS if os.access(d, os.W_OK)), None)
    directory = tempfile.mkdtemp(prefix="tidekv-reduce-", dir=base)
    try:
        fd = os.open(os.path.join(directory, "slots"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, 2 * size * chunk_bytes)
        finally:
            os.close(fd)
        for src in range(size):
            for dst in range(size):
                if src != dst:
                    os.mkfifo(_fifo(directory, src, dst), 0o600)
        nonce = secrets.token_hex(16)
        with open(os.path.join(directory, "nonce"), "w") as f:
            f.write(nonce)
    except OSError:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, nonce


def _everyone(ok: bool, group: dist.ProcessGroup) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    collective(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def open_host_reducer(group: dist.ProcessGroup, ranks: list[int], rank: int, timeout_s: float,
                      chunk_bytes: int = CHUNK_BYTES) -> HostReducer | None:
    """Collective over ``group`` (global ``ranks``, in order; this process is ``rank``): the
    group's shared-memory collectives, or None (logged) when some rank cannot reach the leader's
    directory (another host, another user) or it cannot be made; the caller then uses its
    ``torch.distributed`` backend."""
    size, me, leader = len(ranks), ranks.index(rank), ranks[0]
    made: list = [None]
    if rank == leader:
        try:
            made = [_make_directory(size, chunk_bytes)]
        except OSError as e:
            log.info("no shared-memory collectives for ranks %s (%s)", ranks, e)
    collective(dist.broadcast_object_list, made, src=leader, group=group)
    if made[0] is None:
        return None
    opening = _Opening(made[0][0], size, me, chunk_bytes)
    try:  # every reader open before any writer opens (a writer's open fails with ENXIO otherwise)
        ok = _everyone(opening.readers(made[0][1]), group) and _everyone(opening.writers(), group)
    except BaseException:
        opening.close()
        raise
    finally:
        if rank == leader:  # everyone has it open (or gave up): nothing may outlive the group
            shutil.rmtree(made[0][0], ignore_errors=True)
    if not ok:
        opening.close()
        log.info("ranks %s use the backend's collectives: not every rank reached %s", ranks, made[0][0])
        return None
    return HostReducer(opening.slots, size, me, opening.inbound, opening.outbound, chunk_bytes, timeout_s)


class _Opening:
    """One rank's side of the set-up: the mapped slots and its FIFOs as they are opened."""

    def __init__(self, directory: str, size: int, me: int, chunk_bytes: int):
        self.directory, self.size, self.me, self.chunk_bytes = directory, size, me, chunk_bytes
        self.slots: mmap.mmap | None = None
        self.inbound: list[int] = []
        self.outbound: list[int] = []

    def readers(self, nonce: str) -> bool:
        """The slots mapped and the FIFOs into this rank open; False when this is not the
        leader's directory (its nonce differs: another host's same-named one) or is unreachable."""
        try:
            with open(os.path.join(self.directory, "nonce")) as f:
                if f.read() != nonce:
                    return False
            self.inbound = [os.open(_fifo(self.directory, src, self.me), os.O_RDONLY | os.O_NONBLOCK)
                            for src in range(self.size) if src != self.me]
            fd = os.open(os.path.join(self.directory, "slots"), os.O_RDWR)
            try:
                self.slots = mmap.mmap(fd, 2 * self.size * self.chunk_bytes)
            finally:
                os.close(fd)
            return True
        except OSError as e:
            log.info("cannot open the shared-memory collectives' %s (%s)", self.directory, e)
            return False

    def writers(self) -> bool:
        try:
            self.outbound = [os.open(_fifo(self.directory, self.me, dst), os.O_WRONLY | os.O_NONBLOCK)
                             for dst in range(self.size) if dst != self.me]
            return True
        except OSError as e:
            log.info("cannot open the shared-memory collectives' FIFOs (%s)", e)
            return False

    def close(self) -> None:
        for fd in (*self.inbound, *self.outbound):
            os.close(fd)
        if self.slots is not None:
            self.slots.close()
