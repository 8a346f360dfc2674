"""SSD tier: a bounded directory of encoded block payloads, one file per block.

Directory layout (the directory belongs to one store; nothing else may write there)::

    <dir>/<key hex, 32 chars>.blk                  a complete, verified-on-read payload
    <dir>/<key hex>.<pid>.<seq>.tmp                a write in progress (or a crashed one)

Writes are crash-safe: the bytes go to a temp file in the same directory, are fsynced, the
file is renamed over the final name (atomic on POSIX) and the directory is fsynced. A reader
therefore sees either no file or a whole one; a SIGKILL or power cut leaves at most a temp
file, which ``rescan`` deletes. Every read verifies the payload (header, lengths, CRC-32,
model fingerprint); a file that fails is deleted, logged at WARNING naming the block, reported
to ``on_corrupt`` (the store counts it) and reported absent, never returned.
Sizes are file lengths in bytes. Modes: the directory 0700, block files 0600 (a rescan
narrows files an older version left wider). Not thread-safe: used under the store's lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvstore.blocks import KEY_BYTES, BlockKey, Tier
from kvstore.ledger import TierLedger
from kvstore.payload_format import PayloadError, read_header, verify
from runtime.private import FILE_MODE, private_dir

logger = logging.getLogger(__name__)

BLOCK_SUFFIX = ".blk"
TEMP_SUFFIX = ".tmp"
_IOV_MAX = 1024

Buffer = bytes | bytearray | memoryview


def _write_all(fd: int, parts: Sequence[Buffer]) -> None:
    """Write every byte of ``parts`` in order (``os.writev`` may write only some)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def _read_into(fd: int, view: memoryview) -> int:
    """Fill ``view`` from ``fd``; returns the bytes read (fewer only at end of file)."""
    num_read = 0
    while num_read < view.nbytes:
        n = os.readv(fd, [view[num_read:]])
        if n == 0:
            break
        num_read += n
    return num_read


def key_from_name(name: str) -> BlockKey | None:
    """The key a ``<hex>.blk`` file name stands for, None for any other name."""
    if not name.endswith(BLOCK_SUFFIX):
        return None
    stem = name[: -len(BLOCK_SUFFIX)]
    if len(stem) != 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


class SsdTier:
    """Encoded payloads as files under ``directory``, at most ``capacity_bytes`` of them.

    ``model_fingerprint``: files for another model fail verification and are dropped.
    ``fsync=False`` keeps the temp-file + rename protocol (safe against a killed process)
    but skips the fsyncs (unsafe against power loss); for benchmarks and tests only.
    ``on_corrupt(key)``: called (under the caller's lock; keep it quick) for each block file
    that fails verification, on a read or a rescan, after the file is deleted.
    """

    tier = Tier.SSD

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        model_fingerprint: str,
        fsync: bool = True,
        on_corrupt: Callable[[BlockKey], None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self._on_corrupt = on_corrupt
        private_dir(self.directory)  # block files hold prompts' KV: 0600 files in a 0700 directory
        self.ledger = TierLedger("ssd", capacity_bytes)
        self.model_fingerprint = model_fingerprint
        self.fsync = fsync
        self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        self._temp_seq = itertools.count()

    @property
    def sizes_bytes(self) -> Mapping[BlockKey, int]:
        return self.ledger.sizes_bytes

    def path_of(self, key: BlockKey) -> Path:
        return self.directory / f"{key.hex()}{BLOCK_SUFFIX}"

    def close(self) -> None:
        """Release the directory handle; the files stay for the next ``rescan``."""
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def rescan(self) -> list[BlockKey]:
        """Rebuild the ledger from the directory, as at startup: delete temp files and block
        files that fail verification, drop the oldest files that pass the capacity, and
        return the valid keys, oldest first (by modification time)."""
        for key in list(self.ledger.sizes_bytes):
            self.ledger.discard(key)
        found: list[tuple[int, str, BlockKey]] = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(TEMP_SUFFIX):
                logger.info("ssd: deleting leftover temp file %s", entry.name)
                self._unlink(entry.name)
                continue
            key = key_from_name(entry.name)
            if key is None:
                logger.warning("ssd: ignoring foreign file %s", entry.name)
                continue
            found.append((entry.stat().st_mtime_ns, entry.name, key))
            os.chmod(entry.name, FILE_MODE, dir_fd=self._dir_fd)
        found.sort(reverse=True)  # newest first: they win when the directory is over capacity
        kept: list[BlockKey] = []
        for _, name, key in found:
            data = self._read_verified(key)
            if data is None:
                continue
            if not self.ledger.fits(len(data)):
                logger.info("ssd: deleting %s, over capacity on rescan", name)
                self._unlink(name)
                continue
            self.ledger.add(key, len(data), read_header(data).has_snapshot)
            kept.append(key)
        kept.reverse()
        return kept

    def put(self, key: BlockKey, parts: Sequence[Buffer]) -> bool:
        """Write a block crash-safely; ``parts`` concatenated form its encoded payload (the
        first part holds at least the whole header). ValueError when the key is present or
        the bytes do not fit (the caller makes room first); False when the write fails
        (e.g. the disk is full), with nothing left behind."""
        head = read_header(parts[0], complete=False)
        size_bytes = sum(memoryview(p).nbytes for p in parts)
        if size_bytes != head.total_bytes:
            raise ValueError(f"parts hold {size_bytes} bytes, the header declares {head.total_bytes}")
        self.ledger.add(key, size_bytes, head.has_snapshot)
        temp_name = f"{key.hex()}.{os.getpid()}.{next(self._temp_seq)}{TEMP_SUFFIX}"
        try:
            self._write_file(temp_name, parts)
            os.rename(temp_name, self.path_of(key).name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
            if self.fsync:
                os.fsync(self._dir_fd)
        except OSError as e:
            logger.warning("ssd: writing %s failed: %s", key.hex(), e)
            self._unlink(temp_name)
            self.ledger.discard(key)
            return False
        return True

    def _write_file(self, name: str, parts: Sequence[Buffer]) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=self._dir_fd)
        try:
            _write_all(fd, parts)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def try_get(self, key: BlockKey) -> bytearray | None:
        """The verified encoded payload in a fresh buffer, or None when absent. A file that
        fails verification (or vanished, or changed size) is deleted and forgotten."""
        if key not in self.ledger:
            return None
        data = self._read_verified(key)
        if data is None or len(data) != self.ledger.sizes_bytes[key]:
            self.remove(key)
            return None
        return data

    def _read_verified(self, key: BlockKey) -> bytearray | None:
        name = self.path_of(key).name
        try:
            fd = os.open(name, os.O_RDONLY, dir_fd=self._dir_fd)
        except FileNotFoundError:
            logger.warning("ssd: %s vanished", name)
            return None
        try:
            data = bytearray(os.fstat(fd).st_size)
            num_read = _read_into(fd, memoryview(data))
        finally:
            os.close(fd)
        try:
            if num_read != len(data):
                raise PayloadError(f"short read: {num_read} of {len(data)} bytes")
            verify(data, self.model_fingerprint)
        except PayloadError as e:
            logger.warning("ssd: block %s is corrupt on disk (%s): file %s deleted, block dropped",
                           key.hex(), e, self.path_of(key))
            self._unlink(name)
            if self._on_corrupt is not None:
                self._on_corrupt(key)
            return None
        return data

    def remove(self, key: BlockKey) -> int:
        """Delete a block's file; returns the bytes freed (0 when absent)."""
        freed = self.ledger.discard(key)
        if freed:
            self._unlink(self.path_of(key).name)
        return freed

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._dir_fd)

    def check_integrity(self) -> None:
        """Ledger invariants, and every ledger key has a file of its recorded size."""
        self.ledger.check_integrity()
        for key, size_bytes in self.ledger.sizes_bytes.items():
            try:
                actual = self.path_of(key).stat().st_size
            except FileNotFoundError:
                raise AssertionError(f"ssd: file for {key.hex()} is missing") from None
            if actual != size_bytes:
                raise AssertionError(f"ssd: {key.hex()} file has {actual} bytes, ledger says {size_bytes}")
