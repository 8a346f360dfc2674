"""SSD tier crash safety with real SIGKILLs, and rescan of a damaged directory.

Writers run as separate processes (``tests/kvstore/ssd_writer.py``, stepped one block at a
time) and are SIGKILLed at chosen points, found from their output and from inotify events on
their directory, never from sleeps::

    create i    block i's temp file was just created   (kill lands mid-write)
    written i   block i's temp file was closed          (written and fsynced, not renamed)
    renamed i   block i's file got its final name       (before the directory fsync)
    begin i     the writer is about to put block i      (kill lands in encoding or writing)
    done i      put i returned                          (between writes)

A fresh store then rescans each directory: temp files must be gone, every block it offers
must read back verified and byte-equal to what the writer meant to write, and every block
whose rename happened must be there.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.blocks import ROOT_KEY, Tier, block_key
from kvstore.payload import make_random_payload
from kvstore.payload_format import encode
from kvstore.ssd import SsdTier
from kvstore.store import TieredStore
from tests.kvstore.ssd_writer import FP, block_for, key_for, store_config

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_BLOCKS = 8
KILL_POINTS = ["create 0", "written 1", "renamed 2", "done 3", "begin 5"]
DEADLINE_S = 60.0  # a hung writer fails the test instead of hanging it; never a synchronisation

IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x8, 0x80, 0x100
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name
FILE_EVENTS = {"create": IN_CREATE, "written": IN_CLOSE_WRITE, "renamed": IN_MOVED_TO}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses inotify")


class DirWatch:
    """inotify on one directory: block until a file event matching a name and mask arrives."""

    def __init__(self, directory: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        mask = IN_CREATE | IN_CLOSE_WRITE | IN_MOVED_TO
        if self._libc.inotify_add_watch(self.fd, os.fsencode(directory), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")

    def wait_for(self, mask: int, name_prefix: str, name_suffix: str) -> None:
        while True:
            ready, _, _ = select.select([self.fd], [], [], DEADLINE_S)
            assert ready, f"no inotify event {mask:#x} for {name_prefix}*{name_suffix} within {DEADLINE_S}s"
            data = os.read(self.fd, 1 << 16)
            offset = 0
            while offset < len(data):
                _, event_mask, _, name_len = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size : offset + _EVENT.size + name_len].rstrip(b"\0").decode()
                offset += _EVENT.size + name_len
                if event_mask & mask and name.startswith(name_prefix) and name.endswith(name_suffix):
                    return

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def writers(tmp_path: Path) -> Iterator[list[tuple[str, Path, subprocess.Popen[bytes]]]]:
    """One writer per kill point, all started at once so their start-up overlaps."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    started = []
    for seed, kill_at in enumerate(KILL_POINTS):
        directory = tmp_path / f"ssd{seed}"
        argv = [sys.executable, "-m", "tests.kvstore.ssd_writer", str(directory), str(seed), str(MAX_BLOCKS)]
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        started.append((kill_at, directory, proc))
    try:
        yield started
    finally:
        for _, _, proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=DEADLINE_S)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


class LineReader:
    """Lines from a child's stdout pipe, with a deadline (select on the raw fd; a buffered
    reader could hold lines that select would not see)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._proc = proc
        self._fd = proc.stdout.fileno()
        self._buffer = b""

    def readline(self) -> str:
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._fd], [], [], DEADLINE_S)
            chunk = os.read(self._fd, 4096) if ready else b""
            assert chunk, f"writer silent or gone (rc={self._proc.poll()})"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().strip()


def _kill_at(proc: subprocess.Popen[bytes], kill_at: str, directory: Path, seed: int) -> None:
    """Step the writer block by block until ``kill_at`` happens, then SIGKILL it."""
    assert proc.stdin is not None
    word, _, index = kill_at.partition(" ")
    watch_line = f"begin {index}" if word in FILE_EVENTS else kill_at
    watch: DirWatch | None = None
    lines = LineReader(proc)
    try:
        while (line := lines.readline()) != watch_line:
            if line == "ready" and word in FILE_EVENTS:
                watch = DirWatch(directory)  # exists now; watching before "next" misses nothing
            if line == "ready" or line.startswith("done"):
                proc.stdin.write(b"next\n")
                proc.stdin.flush()
        if watch is not None:
            suffix = ".blk" if word == "renamed" else ".tmp"
            watch.wait_for(FILE_EVENTS[word], key_for(seed, int(index)).hex(), suffix)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if watch is not None:
            watch.close()
    assert proc.wait(timeout=DEADLINE_S) == -signal.SIGKILL


def _expected_indices(kill_at: str) -> tuple[set[int], set[int]]:
    """(blocks that must survive, blocks that may) for a kill at ``kill_at``."""
    if kill_at == "ready":
        return set(), set()
    word, index = kill_at.split()
    finished = set(range(int(index) + (word in ("done", "renamed"))))
    return finished, finished | {int(index)}


def test_sigkilled_writers_leave_only_verified_blocks(writers) -> None:
    for seed, (kill_at, directory, proc) in enumerate(writers):
        _kill_at(proc, kill_at, directory, seed)
        must, may = _expected_indices(kill_at)
        expected = dict(block_for(seed, i) for i in sorted(may))
        with TieredStore(store_config(str(directory))) as store:
            assert not list(directory.glob("*.tmp")), "rescan must delete temp files"
            keys = set(store.keys(Tier.SSD))
            assert {key_for(seed, i) for i in must} <= keys <= expected.keys(), kill_at
            for key in keys:
                file_bytes = (directory / f"{key.hex()}.blk").read_bytes()
                assert file_bytes == encode(expected[key])
                got = store.try_get(key)
                assert got is not None and got.same_as(expected[key])
            store.check_integrity()


def _payload(seed: int, fingerprint: str = FP):
    return make_random_payload(torch.Generator().manual_seed(seed), model_fingerprint=fingerprint)


def test_rescan_drops_damaged_files_and_temp_files(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, 1 << 20, FP)
    keys = [block_key(ROOT_KEY, [i], FP) for i in range(6)]
    for i, key in enumerate(keys[:5]):
        assert tier.put(key, [encode(_payload(i))])
    path = [tier.path_of(key) for key in keys]
    path[0].write_bytes(path[0].read_bytes()[:-7])  # truncated
    flipped = bytearray(path[1].read_bytes())
    flipped[len(flipped) // 2] ^= 0x04
    path[1].write_bytes(flipped)  # bit rot
    path[3].write_bytes(b"")  # empty
    path[4].write_bytes(encode(_payload(4, fingerprint="other-model")))  # another model's block
    path[5].write_bytes(encode(_payload(5))[:100])  # a torn block that was never in the ledger
    (tmp_path / f"{keys[0].hex()}.1234.0.tmp").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("not ours")
    tier.close()

    fresh = SsdTier(tmp_path, 1 << 20, FP)
    assert fresh.rescan() == [keys[2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path[2].name, "notes.txt"])
    data = fresh.try_get(keys[2])
    assert data is not None and bytes(data) == encode(_payload(2))
    fresh.check_integrity()
    fresh.close()


def test_rescan_over_capacity_keeps_the_newest(tmp_path: Path) -> None:
    blob_bytes = len(encode(_payload(0)))
    tier = SsdTier(tmp_path, 3 * blob_bytes, FP)
    keys = [block_key(ROOT_KEY, [i], FP) for i in range(3)]
    for i, key in enumerate(keys):
        assert tier.put(key, [encode(_payload(i))])
        os.utime(tier.path_of(key), ns=(10**18 + i, 10**18 + i))
    tier.close()
    smaller = SsdTier(tmp_path, 2 * blob_bytes, FP)
    assert smaller.rescan() == [keys[1], keys[2]]  # oldest first, the oldest file dropped
    assert not tier.path_of(keys[0]).exists()
    smaller.close()


def test_corrupted_file_is_never_returned_by_a_read(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path, 1 << 20, FP)
    key = block_key(ROOT_KEY, [0], FP)
    assert tier.put(key, [encode(_payload(0))])
    data = bytearray(tier.path_of(key).read_bytes())
    data[-1] ^= 0x80
    tier.path_of(key).write_bytes(data)
    assert tier.try_get(key) is None
    assert key not in tier.ledger and not tier.path_of(key).exists()
    tier.check_integrity()
    tier.close()
