"""What the shared store holds, as records that prove who wrote them: log entries and
snapshots with a MAC, instance ids sealed.

The store (Redis) is shared, not trusted: anyone who can reach it may read or write it. So
every record a Conductor writes carries an HMAC-SHA256 (truncated to 16 bytes) under a key
derived from the cluster secret, and a reader drops (and logs once) whatever fails it,
never acting on it; the one secret a registration holds, the worker's ``instance_id`` (it
derives the worker's session key), is sealed with AES-GCM under another derived key, bound
to the worker id. Reading the store therefore tells nothing that lets anyone speak for a
worker or the Conductor; block keys in it are keyed hashes (``kvstore.blocks``), so they tell
nothing about the prompts either.

    log entry:  fields e = StateEntry bytes, m = MAC(b"tidekv-log/1" + e), s = sequence number
    snapshot:   b"tidekv-snap/1" + MAC(prefix + body) + body, body = zlib(StateSnapshot bytes)
    sealed id:  12-byte nonce + AES-GCM(instance id, associated data = worker id)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import zlib
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.message import DecodeError

from proto import state_pb2 as spb

MAC_BYTES = 16
_LOG = b"tidekv-log/1"
_SNAPSHOT = b"tidekv-snap/1"
MAX_ENTRY_BYTES = 4 << 20  # a heartbeat carries at most ~20,000 events (about 1 MB)
MAX_SNAPSHOT_BYTES = 256 << 20


class RecordError(ValueError):
    """A record that is malformed, oversized, or not written by a holder of the cluster secret."""


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for one purpose, derived from the cluster secret (HMAC-SHA256)."""
    return hmac.new(secret, f"tidekv/{purpose}".encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class StoreKeys:
    """The keys a Conductor signs and seals the store's records with."""

    mac_key: bytes
    seal_key: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> StoreKeys:
        return cls(derive_key(secret, "store-mac"), derive_key(secret, "store-seal"))

    def _mac(self, prefix: bytes, body: bytes) -> bytes:
        return hmac.new(self.mac_key, prefix + body, hashlib.sha256).digest()[:MAC_BYTES]

    # ---- log entries --------------------------------------------------------------------------
    def entry_fields(self, entry: spb.StateEntry) -> dict[bytes, bytes]:
        body = entry.SerializeToString()
        return {b"e": body, b"m": self._mac(_LOG, body)}

    def open_entry(self, fields: dict[bytes, bytes]) -> spb.StateEntry:
        """The entry of a stream record's fields; ``RecordError`` unless it is well formed and
        its MAC holds."""
        body, mac = fields.get(b"e"), fields.get(b"m")
        if body is None or mac is None:
            raise RecordError(f"log record without its entry or MAC (fields {sorted(fields)[:4]})")
        if len(body) > MAX_ENTRY_BYTES:
            raise RecordError(f"log record of {len(body)} bytes, over the {MAX_ENTRY_BYTES} limit")
        if not hmac.compare_digest(mac, self._mac(_LOG, body)):
            raise RecordError("log record whose MAC does not hold (not written by a cluster member)")
        try:
            return spb.StateEntry.FromString(body)
        except DecodeError as e:
            raise RecordError(f"log record that is not a StateEntry: {e}") from e

    # ---- snapshots ----------------------------------------------------------------------------
    def seal_snapshot(self, snapshot: spb.StateSnapshot) -> bytes:
        body = zlib.compress(snapshot.SerializeToString(), 1)
        return _SNAPSHOT + self._mac(_SNAPSHOT, body) + body

    def open_snapshot(self, blob: bytes) -> spb.StateSnapshot:
        if len(blob) > MAX_SNAPSHOT_BYTES:
            raise RecordError(f"snapshot of {len(blob)} bytes, over the {MAX_SNAPSHOT_BYTES} limit")
        if not blob.startswith(_SNAPSHOT) or len(blob) < len(_SNAPSHOT) + MAC_BYTES:
            raise RecordError("snapshot record of an unknown format")
        mac, body = blob[len(_SNAPSHOT): len(_SNAPSHOT) + MAC_BYTES], blob[len(_SNAPSHOT) + MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(_SNAPSHOT, body)):
            raise RecordError("snapshot whose MAC does not hold (not written by a cluster member)")
        try:
            return spb.StateSnapshot.FromString(zlib.decompress(body, bufsize=1 << 20))
        except (zlib.error, DecodeError) as e:
            raise RecordError(f"snapshot that does not decode: {e}") from e

    # ---- sealed instance ids -------------------------------------------------------------------
    def seal_instance(self, worker_id: str, instance_id: str) -> bytes:
        nonce = os.urandom(12)
        return nonce + AESGCM(self.seal_key).encrypt(nonce, instance_id.encode(), worker_id.encode())

    def unseal_instance(self, worker_id: str, sealed: bytes) -> str:
        if len(sealed) < 12 + 16:
            raise RecordError(f"sealed instance id of worker {worker_id} is {len(sealed)} bytes")
        try:
            return AESGCM(self.seal_key).decrypt(sealed[:12], sealed[12:], worker_id.encode()).decode()
        except (InvalidTag, UnicodeDecodeError) as e:
            raise RecordError(f"sealed instance id of worker {worker_id} does not open") from e
