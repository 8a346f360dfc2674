"""Mutual authentication of transfer connections: the first frames of every stream connection
(tcp, shm's unix socket, ucx's TCP control connection), before any other frame.

With ``TransferConfig.auth_key`` K on both ends, each proves it knows K without sending it,
each over a nonce the other drew (so a recorded exchange proves nothing on a new connection)::

    listener                                              connector
      AUTH  nL                                  ──►       (32 random bytes)
            verify macC                         ◄──       AUTH  macC = HMAC(K, P + nL + nC) + nC
      AUTH  macL = HMAC(K, P + nC + nL)         ──►       verify macL
    ... frames of the backend (shm/ucx HELLO, data) ...
    P = PROTOCOL = b"tidekv-transfer/1"; HMAC-SHA256, compared with hmac.compare_digest

Each side's MAC covers the peer's nonce first, so neither proof can be reflected back as the
other's. The listener answers only after it has verified the connector. Without a key the
listener's first AUTH carries no nonce and both go on; a key on one side only fails the
connection on both with a reason naming it. While a listener waits for the proof it accepts
only inline bodies of ``HANDSHAKE_BODY_BYTES`` and nothing but AUTH: a peer that sends
anything else first, a wrong proof, or nothing within ``connect_timeout_s`` is aborted,
logged at WARNING with its address and counted (``tidekv:transfer_auth_failures_total``);
its connection never reaches the receiver, so nothing it sent is ever written to a sink.

This authenticates the two processes; it neither encrypts nor integrity-protects the stream
after the handshake (frames carry checksums against accidents, not attackers). Runs on the
I/O loop only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import socket
import struct
from collections.abc import Callable

from kvstore.transfer.base import LinkClosed, TransferConfig, TransferError
from kvstore.transfer.frames import Kind, control_header
from kvstore.transfer.metrics import process_link
from kvstore.transfer.wire import FrameConnection

logger = logging.getLogger(__name__)

PROTOCOL = b"tidekv-transfer/1"
NONCE_BYTES = 32
MAC_BYTES = 32  # SHA-256
HANDSHAKE_BODY_BYTES = MAC_BYTES + NONCE_BYTES  # the largest AUTH body
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class _Refused(Exception):
    """The peer broke the handshake; the message says how."""


def proof(key: bytes, peer_nonce: bytes, own_nonce: bytes) -> bytes:
    """What one side sends to prove it holds ``key``: HMAC-SHA256 over P + the peer's nonce + its own."""
    return hmac.new(key, PROTOCOL + peer_nonce + own_nonce, hashlib.sha256).digest()


def connection_factory(
    config: TransferConfig,
    on_connected: Callable[[FrameConnection], None] | None = None,
    defer_data_bodies: bool = False,
) -> Callable[[], FrameConnection]:
    """Protocol factory of a stream connection that starts with the handshake's body limit
    (``HANDSHAKE_BODY_BYTES`` when a key is set) until ``accept_peer``/``prove_to`` lift it
    (``defer_data_bodies``: see ``wire.FrameConnection``)."""
    first_limit = HANDSHAKE_BODY_BYTES if config.auth_key else config.max_frame_bytes
    return lambda: FrameConnection(first_limit, on_connected, defer_data_bodies)


def describe_peer(conn: FrameConnection) -> str:
    """The peer's address for logs: host:port, or the pid and uid behind a unix socket. Ask
    while the connection is open (uvloop's transports forget their socket once closed)."""
    try:
        peer = conn.transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            return f"{peer[0]}:{peer[1]}"
        sock = conn.transport.get_extra_info("socket")
        if getattr(sock, "family", None) == socket.AF_UNIX:
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            return f"unix socket peer pid {pid} uid {uid}"
    except (AttributeError, OSError):  # closed meanwhile
        return "a peer that has gone"
    return repr(peer) if peer else "an unknown peer"


async def _read_auth(conn: FrameConnection) -> bytes:
    """The body of the next frame, which must be an AUTH frame; _Refused otherwise."""
    item = await conn.next_frame()
    if isinstance(item, LinkClosed):
        raise _Refused(f"the connection closed ({item.reason})")
    payload = bytes(item.inline) if item.inline is not None else b""
    if item.inline is not None:
        conn.release()
    if item.header.kind != Kind.AUTH:
        raise _Refused(f"it sent {item.header.describe()} before authenticating")
    return payload


async def _send_auth(conn: FrameConnection, payload: bytes) -> None:
    await conn.write(control_header(Kind.AUTH, "", payload=payload).pack(), payload)


async def accept_peer(conn: FrameConnection, config: TransferConfig, scheme: str) -> bool:
    """Listener side, first thing on a new connection: True when the peer may go on (it
    proved the key, or no key is configured). Otherwise the connection is aborted, the peer
    logged at WARNING and counted, and False returned."""
    key = config.auth_key
    peer = describe_peer(conn)
    nonce = secrets.token_bytes(NONCE_BYTES) if key else b""
    try:
        await _send_auth(conn, nonce)
        if not key:
            return True
        async with asyncio.timeout(config.connect_timeout_s):
            answer = await _read_auth(conn)
        if len(answer) != HANDSHAKE_BODY_BYTES:
            raise _Refused(
                f"its answer has {len(answer)} bytes, not {HANDSHAKE_BODY_BYTES} (a peer without an auth_key?)"
            )
        mac, peer_nonce = answer[:MAC_BYTES], answer[MAC_BYTES:]
        if not hmac.compare_digest(mac, proof(key, nonce, peer_nonce)):
            raise _Refused("its proof is wrong (its auth_key differs)")
        await _send_auth(conn, proof(key, peer_nonce, nonce))
    except (_Refused, ConnectionError, TimeoutError) as exc:
        why = f"no answer within {config.connect_timeout_s:g} s" if isinstance(exc, TimeoutError) else str(exc)
        logger.warning("transfer peer %s did not authenticate on %s: %s; disconnected", peer, scheme, why)
        process_link(scheme, "recv").auth_failure()
        conn.abort()
        return False
    conn.limit_body_bytes(config.max_frame_bytes)
    return True


async def prove_to(conn: FrameConnection, config: TransferConfig, address: str) -> None:
    """Connector side, first thing on a new connection to the listener at ``address``:
    returns once both sides are authenticated (or neither has a key); TransferError naming
    the reason otherwise. The caller closes the connection on error."""
    key = config.auth_key
    scheme = address.partition("://")[0]
    try:
        try:
            async with asyncio.timeout(config.connect_timeout_s):
                challenge = await _read_auth(conn)
                if not key and challenge:
                    raise _Refused("it requires authentication and this sender has no auth_key")
                if key and not challenge:
                    raise _Refused("it has no auth_key and this sender has one; both ends need the same key")
                if not key:
                    return
                if len(challenge) != NONCE_BYTES:
                    raise _Refused(f"its challenge has {len(challenge)} bytes, not {NONCE_BYTES}")
                nonce = secrets.token_bytes(NONCE_BYTES)
                await _send_auth(conn, proof(key, challenge, nonce) + nonce)
                try:
                    answer = await _read_auth(conn)
                except _Refused as exc:
                    raise _Refused(f"it refused our proof, {exc} (do the auth_keys differ?)") from None
        except TimeoutError:
            raise _Refused(f"no authentication from it within {config.connect_timeout_s:g} s") from None
        except ConnectionError as exc:
            raise _Refused(f"the connection failed ({exc})") from None
        if not hmac.compare_digest(answer, proof(key, nonce, challenge)):
            raise _Refused("its proof is wrong (its auth_key differs)")
    except _Refused as exc:
        logger.warning("transfer peer %s did not authenticate: %s", address, exc)
        process_link(scheme, "send").auth_failure()
        raise TransferError(f"transfer peer {address} did not authenticate: {exc}") from None
    conn.limit_body_bytes(config.max_frame_bytes)
