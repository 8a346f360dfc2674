"""``IncomingBody``: the body a ``connection.FrameConnection`` is reading: where it lands, how
much has, the checksum of what has landed and, on an encrypted link, its decryption and tag.

Its targets are writable byte buffers filled in order: the connection's staging view, or the
destination views a consumer gave (``receive_into``), then the trailer when the checksum trails
the body (``FLAG_TRAILING_CHECKSUM``)::

    targets   [ view 0 .......... | view 1 ...... | ... | view k ... ][ trailer ]
               index, filled ──► ^                                    (not checksummed)
    landed    filled_bytes of expect_bytes (the body and its trailer)

Plaintext, the kernel writes each piece straight into ``targets[index]`` and the connection
reports it (``landed``), which checksums it while it is in cache. Encrypted, ciphertext lands
in the connection's cipher buffer and ``open`` decrypts it straight into the targets, then takes
and checks the tag. The connection owns the stream around the body (read area, cipher buffer,
headers, holding, delivery): it starts each body here and ends it in its ``_body_complete``
(called back from here when the body ends inside ``start`` or ``open``), which clears
``header``, ``filled_bytes`` and ``decryptor`` directly (a method for that would be one more
call per frame). One per connection, reused body after body; I/O loop only, nothing locked.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from cryptography.exceptions import InvalidTag

from kvstore.transfer.aead import TAG_BYTES, Direction
from kvstore.transfer.frames import FLAG_TRAILING_CHECKSUM, TRAILER, ChecksumAlgo, FrameHeader, checksum

# Bodies move a piece at a time both ways (a recv into a body here, a piece checksummed or
# sealed then written by ``writer``), so each piece is still in cache when it is checked.
RECV_PIECE_BYTES = 512 << 10  # at most this per recv into a body (or per sealed piece): in L2 still
SMALL_PIECE_BYTES = 64 << 10  # checksummed without releasing the GIL (a hand-off costs more)


class BodyOwner(Protocol):
    """What a body calls back on its connection (``FrameConnection``)."""

    def _body_complete(self) -> None:
        """The body is in (its tag checked, when sealed): deliver it and clear ``header``."""

    def _fail(self, reason: str) -> None:
        """Fail the connection, and so every request on it."""


class IncomingBody:
    """The body being read (see the module docstring); ``header`` is None between bodies."""

    def __init__(self, owner: BodyOwner):
        # The connection owns its body: a strong reference back would make a cycle, and a closed
        # connection's buffers would then wait for the cycle collector.
        self._owner = weakref.proxy(owner)
        self.header: FrameHeader | None = None  # set while a body is being read
        self.filled_bytes = 0  # body bytes of header landed so far
        # Where the body being read goes, in order (the staging buffer, or a consumer's views),
        # and the checksum of what has landed (deferred data bodies only).
        self.targets: list = []
        self.body_targets = 0  # targets of the body proper; a trailing checksum's follows them
        self.expect_bytes = 0  # the body and its trailer
        self.trailer = bytearray(TRAILER.size)
        self.index = 0
        self.filled = 0  # bytes of targets[index] landed so far
        self.algo: ChecksumAlgo | None = None
        self.crc = 0
        # Encryption: what is still to come of the body being read.
        self.decryptor = None
        self.cipher_left = 0
        self.tag = bytearray(TAG_BYTES)
        self.tag_filled = 0

    def start(
        self, header: FrameHeader, targets: list, algo: ChecksumAlgo | None, cipher: Direction | None
    ) -> None:
        """Read ``header``'s body into ``targets`` (their lengths add up to its ``body_bytes``),
        checksummed under ``algo`` (None: not checksummed here), decrypted when ``cipher`` (the
        connection's receive direction) is set. An empty plaintext body is complete at once."""
        self.header = header
        self.targets = [t for t in targets if len(t)]
        self.body_targets = len(self.targets)
        self.expect_bytes = header.body_bytes
        if header.flags & FLAG_TRAILING_CHECKSUM:
            self.targets.append(memoryview(self.trailer))
            self.expect_bytes += TRAILER.size
        self.index = self.filled = self.filled_bytes = 0
        self.algo = None if algo == ChecksumAlgo.AEAD else algo
        self.crc = 0
        if cipher is not None:  # the body's nonce follows its header's
            self.decryptor = cipher.decryptor()
            self.cipher_left = header.body_bytes
            self.tag_filled = 0
        elif header.body_bytes == 0:
            self._owner._body_complete()

    def landed(self, nbytes: int) -> bool:
        """``nbytes`` more of the body are in the current target: checksum them, move on; True
        once the whole body is in."""
        target = self.targets[self.index]
        if self.algo is not None and self.index < self.body_targets:
            piece = target[self.filled : self.filled + nbytes]
            self.crc = checksum(self.algo, piece, self.crc, hold_gil=nbytes <= SMALL_PIECE_BYTES)
        self.filled += nbytes
        self.filled_bytes += nbytes
        if self.filled == len(target):
            self.index += 1
            self.filled = 0
        return self.filled_bytes == self.expect_bytes

    def open(self, data: memoryview) -> int:
        """Decrypt ciphertext of the body being read into its targets, then take its tag; returns
        how many bytes of ``data`` that used (the rest belongs to what follows)."""
        used = 0
        while used < len(data) and self.header is not None:
            if self.cipher_left:
                target = self.targets[self.index]
                take = min(len(data) - used, self.cipher_left, len(target) - self.filled)
                self.decryptor.update_into(data[used : used + take], target[self.filled : self.filled + take])
                self.cipher_left -= take
                used += take
                self.landed(take)
                continue
            take = min(len(data) - used, TAG_BYTES - self.tag_filled)
            self.tag[self.tag_filled : self.tag_filled + take] = data[used : used + take]
            self.tag_filled += take
            used += take
            if self.tag_filled == TAG_BYTES:
                try:
                    self.decryptor.finalize_with_tag(bytes(self.tag))
                except InvalidTag:
                    self._owner._fail(f"protocol error: the body of {self.header.describe()} failed authentication "
                               "(tampered with or corrupted in transit)")
                    return used
                self._owner._body_complete()
        return used
