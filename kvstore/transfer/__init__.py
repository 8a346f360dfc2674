"""Tidekv's transfer engine: moves a request's KV (layerwise MLA rows, final KDA states) and
opaque blobs between workers, over shm (same host), tcp, or ucx, with per-chunk checksums,
deadlines, bounded in-flight bytes and loud failures.

Sending side (prefill worker)::

    tx = connect(pick_address(my_host, peer_host, peer_addresses), config)
    for layer ...: tx.send(rid, layer, Kind.MLA_ROWS, (t0, t1), rows)   # blocks on backpressure
    for layer ...: tx.send(rid, layer, Kind.KDA_STATE, (0, n), state); tx.send(..., Kind.KDA_CONV, ...)
    tx.finish(rid, num_layers)            # raises TransferError unless the receiver has it all

Receiving side (decode worker)::

    rx = Receiver(config, backends=("shm", "tcp"))      # rx.addresses go to the registry
    rx.expect(rid, PagePoolSink(pool, page_table, ...), Expected(...))
    rx.wait_layer(rid, 0); result = rx.wait_complete(rid)   # TransferError on any failure

Same host, ``shm`` copies each chunk once, straight into the receiver's pages when its sink
lives in shareable memory (``base.DirectSink``; the engine's host cache does), and the receiver
verifies it there before it counts; elsewhere it goes through a ring.

Over tcp a body is received straight into the sink's pages (``base.ViewSink``), checksummed as
it lands. Connections authenticate: with ``TransferConfig.auth_key`` set on both ends, every
connection of every backend starts with a mutual HMAC challenge-response (``auth``); with
``TransferConfig.encrypt`` (what ``--tls`` sets) tcp links are then sealed with AES-256-GCM
under per-connection keys from that handshake (``aead``).

Modules: ``frames`` (header layout, checksums), ``base`` (config, errors, interfaces), ``auth``
(the connection handshake, the link keys), ``aead`` (a sealed direction), ``progress`` /
``stream`` (receiver bookkeeping, fences), ``outgoing`` (queued frames, coalescing), ``sender``
/ ``receiver`` (the engine), ``connection`` (frames over a stream, plain or sealed; ``body``:
the body being received, ``writer``: the send side), ``wire`` / ``tcp`` / ``shm`` / ``ring`` /
``ucx`` (backends; ``orphans``: abandoned UCX operations), ``placement`` / ``regions`` /
``direct`` (one-copy shm placement: the description, the receiver's shared memory, the sender's
copy), ``ioloop`` (the I/O thread), ``sinks``, ``metrics``.
"""

from kvstore.transfer.base import (
    Address,
    Expected,
    FaultInjection,
    Sink,
    TransferConfig,
    TransferError,
    TransferResult,
    pick_address,
)
from kvstore.transfer.frames import ChecksumAlgo, DType, Kind
from kvstore.transfer.ioloop import IoThread
from kvstore.transfer.registry import get_backend, ucx_unavailable_reason
from kvstore.transfer.sender import Sender, connect

# The receiving side imports torch; load it on first use so a sender-only process stays light.
_LAZY = {
    "Receiver": "kvstore.transfer.receiver",
    "PagePoolSink": "kvstore.transfer.sinks",
    "BlobSink": "kvstore.transfer.sinks",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Address",
    "BlobSink",
    "ChecksumAlgo",
    "DType",
    "Expected",
    "FaultInjection",
    "IoThread",
    "Kind",
    "PagePoolSink",
    "Receiver",
    "Sender",
    "Sink",
    "TransferConfig",
    "TransferError",
    "TransferResult",
    "connect",
    "get_backend",
    "pick_address",
    "ucx_unavailable_reason",
]
