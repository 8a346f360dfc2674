"""Confidentiality of a tcp transfer link: one direction's AES-256-GCM state (its key and its
message counter, which is the nonce). Keys come from the connection's mutual handshake
(``auth.link_keys``): fresh per connection and per direction, so with the counter no nonce is
ever used twice under one key. Both ends take nonces in the same order, one per message::

    nonce = label (4 bytes: b"c2l\\0" connector -> listener, b"l2c\\0" back) + counter (8 bytes, LE)

    encrypted frame = seal(header: 160 B) -> 176 B          [header, 16-byte tag]
                      + for an inline body: body ciphertext (body_bytes) + 16-byte tag

A body is sealed and opened as a stream (``encryptor``/``decryptor``), piece by piece, so the
receiver decrypts straight into the destination pages; its tag is checked once the last byte
is in (``body.IncomingBody``), and a failed tag fails the connection: the destination then
holds garbage and its request fails, as for a bad checksum. Frames on such a link name
``ChecksumAlgo.AEAD``: the tag, a 128-bit MAC under a key only the two ends hold, replaces the
CRC (a CRC guards against accidents, the tag against attackers too).

Pure state, no I/O; one ``Direction`` belongs to one connection's I/O loop.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore.transfer.frames import HEADER_BYTES

KEY_BYTES = 32  # AES-256
TAG_BYTES = 16
SEALED_HEADER_BYTES = HEADER_BYTES + TAG_BYTES
CONNECTOR_TO_LISTENER = b"c2l\0"
LISTENER_TO_CONNECTOR = b"l2c\0"


class Direction:
    """Sealing (or opening) of every message one way on one connection, in order."""

    def __init__(self, key: bytes, label: bytes):
        if len(key) != KEY_BYTES or len(label) != 4:
            raise ValueError(f"need a {KEY_BYTES}-byte key and a 4-byte label, got {len(key)} and {len(label)}")
        self._key = key
        self._aead = AESGCM(key)
        self._label = label
        self._counter = 0

    def _nonce(self) -> bytes:
        nonce = self._label + self._counter.to_bytes(8, "little")
        self._counter += 1
        return nonce

    def seal(self, plaintext: bytes) -> bytes:
        """``plaintext`` encrypted, followed by its tag (a header, a small payload)."""
        return self._aead.encrypt(self._nonce(), plaintext, None)

    def open(self, sealed: bytes) -> bytes:
        """The plaintext of ``seal``'s output; ``cryptography.exceptions.InvalidTag`` if it was
        altered, replayed, reordered or sealed under another key."""
        return self._aead.decrypt(self._nonce(), sealed, None)

    def encryptor(self) -> CipherContext:
        """A streaming encryptor for one body (``update`` per piece; ``finalize`` then ``tag``)."""
        return Cipher(algorithms.AES(self._key), modes.GCM(self._nonce())).encryptor()

    def decryptor(self) -> CipherContext:
        """A streaming decryptor for one body (``update_into`` per piece, ``finalize_with_tag``)."""
        return Cipher(algorithms.AES(self._key), modes.GCM(self._nonce())).decryptor()
