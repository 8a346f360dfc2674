"""Mutual authentication of transfer connections, and the keys of their encryption: the first
frames of every stream connection (tcp, shm's unix socket, ucx's TCP control connection),
before any other frame.

With ``TransferConfig.auth_key`` K on both ends, each proves it knows K without sending it,
each over a nonce the other drew (so a recorded exchange proves nothing on a new connection),
and both over the link's mode M (one byte: 1 when the link is encrypted, ``link_encrypted``)::

    listener                                              connector
      AUTH  nL + M                              ──►       (32 random bytes, mode)
            verify macC                         ◄──       AUTH  macC = HMAC(K, P + nL + nC + M) + nC
      AUTH  macL = HMAC(K, P + nC + nL + M)     ──►       verify macL
    ... frames of the backend (shm/ucx HELLO, data), sealed when M = 1 ...
    P = PROTOCOL = b"tidekv-transfer/1"; HMAC-SHA256, compared with hmac.compare_digest

Each side's MAC covers the peer's nonce first, so neither proof can be reflected back as the
other's, and the mode, so a relay cannot strip the encryption off (a connector whose own mode
differs from the listener's refuses it, naming ``TransferConfig.encrypt``). With M = 1 both
derive per-direction AES-256-GCM keys from K and both nonces (``link_keys``, HKDF-SHA256:
fresh for every connection) and every frame after the proofs is sealed (``aead``); each side
switches its reading over at the frame boundary, before anything sealed can arrive.

The listener answers only after it has verified the connector. Without a key the
listener's first AUTH carries no nonce and both go on; a key on one side only fails the
connection on both with a reason naming it. While a listener waits for the proof it accepts
only inline bodies of ``HANDSHAKE_BODY_BYTES`` and nothing but AUTH: a peer that sends
anything else first, a wrong proof, or nothing within ``connect_timeout_s`` is aborted,
logged at WARNING with its address and counted (``tidekv:transfer_auth_failures_total``);
its connection never reaches the receiver, so nothing it sent is ever written to a sink.

Without encryption this authenticates the two processes only; frames then carry checksums
against accidents, not attackers. Runs on the I/O loop only.
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

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstore.transfer.aead import CONNECTOR_TO_LISTENER, KEY_BYTES, LISTENER_TO_CONNECTOR, Direction
from kvstore.transfer.base import LinkClosed, TransferConfig, TransferError
from kvstore.transfer.connection import FrameConnection
from kvstore.transfer.frames import Kind, control_header
from kvstore.transfer.metrics import process_link

logger = logging.getLogger(__name__)

PROTOCOL = b"tidekv-transfer/1"
NONCE_BYTES = 32
MAC_BYTES = 32  # SHA-256
HANDSHAKE_BODY_BYTES = MAC_BYTES + NONCE_BYTES  # the largest AUTH body
CHALLENGE_BYTES = NONCE_BYTES + 1  # the listener's nonce and the link's mode
PLAIN, SEALED = b"\x00", b"\x01"  # the link's mode byte
ENCRYPTED_SCHEMES = ("tcp",)  # shm moves bodies through shared memory, never a network
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class _Refused(Exception):
    """The peer broke the handshake; the message says how."""


def proof(key: bytes, peer_nonce: bytes, own_nonce: bytes, mode: bytes = PLAIN) -> bytes:
    """What one side sends to prove it holds ``key``: HMAC-SHA256 over P + the peer's nonce +
    its own + the link's mode."""
    return hmac.new(key, PROTOCOL + peer_nonce + own_nonce + mode, hashlib.sha256).digest()


def link_encrypted(config: TransferConfig, scheme: str) -> bool:
    """Whether a link of ``scheme`` under ``config`` is sealed: ``encrypt`` on a tcp link (shm
    stays on the host; ucx refuses ``encrypt`` when it starts, ``ucx.ensure_ucx``)."""
    return bool(config.encrypt and scheme in ENCRYPTED_SCHEMES)


def link_keys(key: bytes, listener_nonce: bytes, connector_nonce: bytes) -> tuple[bytes, bytes]:
    """The link's AES-256-GCM keys (connector -> listener, listener -> connector): HKDF-SHA256
    of the transfer key, salted with both handshake nonces, so every connection has its own."""
    okm = HKDF(
        algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=listener_nonce + connector_nonce,
        info=PROTOCOL + b" aes-256-gcm link keys",
    ).derive(key)
    return okm[:KEY_BYTES], okm[KEY_BYTES:]


def connection_factory(
    config: TransferConfig,
    on_connected: Callable[[FrameConnection], None] | None = None,
    defer_data_bodies: bool = False,
) -> Callable[[], FrameConnection]:
    """Protocol factory of a stream connection that starts with the handshake's body limit
    (``HANDSHAKE_BODY_BYTES`` when a key is set) until ``accept_peer``/``prove_to`` lift it
    (``defer_data_bodies``: see ``connection.FrameConnection``)."""
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


async def _read_auth(conn: FrameConnection, before_release: Callable[[bytes], None] | None = None) -> bytes:
    """The body of the next frame, which must be an AUTH frame; _Refused otherwise.
    ``before_release(body)`` runs before the connection parses anything behind it (where a
    sealed stream starts)."""
    item = await conn.next_frame()
    if isinstance(item, LinkClosed):
        raise _Refused(f"the connection closed ({item.reason})")
    payload = bytes(item.inline) if item.inline is not None else b""
    if item.header.kind == Kind.AUTH and before_release is not None:
        before_release(payload)
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
    mode = SEALED if link_encrypted(config, scheme) else PLAIN

    def switch_reading(answer: bytes) -> None:  # the connector seals everything after its proof
        if mode == SEALED and len(answer) == HANDSHAKE_BODY_BYTES:
            conn.set_receive_cipher(Direction(link_keys(key, nonce, answer[MAC_BYTES:])[0], CONNECTOR_TO_LISTENER))

    try:
        await _send_auth(conn, nonce + mode if key else b"")
        if not key:
            return True
        async with asyncio.timeout(config.connect_timeout_s):
            answer = await _read_auth(conn, switch_reading)
        if len(answer) != HANDSHAKE_BODY_BYTES:
            raise _Refused(
                f"its answer has {len(answer)} bytes, not {HANDSHAKE_BODY_BYTES} (a peer without an auth_key?)"
            )
        mac, peer_nonce = answer[:MAC_BYTES], answer[MAC_BYTES:]
        if not hmac.compare_digest(mac, proof(key, nonce, peer_nonce, mode)):
            raise _Refused("its proof is wrong (its auth_key differs, or a relay changed the link's mode)")
        await _send_auth(conn, proof(key, peer_nonce, nonce, mode))
        if mode == SEALED:
            conn.set_send_cipher(Direction(link_keys(key, nonce, peer_nonce)[1], LISTENER_TO_CONNECTOR))
    except (_Refused, ConnectionError, TimeoutError) as exc:
        why = f"no answer within {config.connect_timeout_s:g} s" if isinstance(exc, TimeoutError) else str(exc)
        logger.warning("transfer peer %s did not authenticate on %s: %s; disconnected", peer, scheme, why)
        process_link(scheme, "recv").auth_failure()
        conn.abort()
        return False
    conn.limit_body_bytes(config.max_frame_bytes)
    return True


def _mode_mismatch(listener_mode: bytes) -> str:
    if listener_mode == SEALED:
        return "it encrypts its link and this sender does not (TransferConfig.encrypt differs: turn it on both ends)"
    if listener_mode == PLAIN:
        return "this sender encrypts its link and it does not (TransferConfig.encrypt differs: turn it on both ends)"
    return f"its challenge names an unknown link mode {listener_mode!r}"


async def _answer(conn: FrameConnection, key: bytes, encrypt: bool, challenge: bytes) -> None:
    """The connector's part after the listener's challenge: prove the key, check the
    listener's proof, seal the link if its mode says so; _Refused otherwise."""
    if len(challenge) != CHALLENGE_BYTES:
        raise _Refused(f"its challenge has {len(challenge)} bytes, not {CHALLENGE_BYTES}")
    challenge, mode = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
    if mode != (SEALED if encrypt else PLAIN):
        raise _Refused(_mode_mismatch(mode))
    nonce = secrets.token_bytes(NONCE_BYTES)
    await _send_auth(conn, proof(key, challenge, nonce, mode) + nonce)
    keys = link_keys(key, challenge, nonce) if mode == SEALED else None

    def switch_reading(_: bytes) -> None:  # the listener seals everything after its proof
        if keys is not None:
            conn.set_receive_cipher(Direction(keys[1], LISTENER_TO_CONNECTOR))

    try:
        answer = await _read_auth(conn, switch_reading)
    except _Refused as exc:
        raise _Refused(f"it refused our proof, {exc} (do the auth_keys differ?)") from None
    if not hmac.compare_digest(answer, proof(key, nonce, challenge, mode)):
        raise _Refused("its proof is wrong (its auth_key differs)")
    if keys is not None:
        conn.set_send_cipher(Direction(keys[0], CONNECTOR_TO_LISTENER))


async def prove_to(conn: FrameConnection, config: TransferConfig, address: str) -> None:
    """Connector side, first thing on a new connection to the listener at ``address``:
    returns once both sides are authenticated (or neither has a key), the link sealed if its
    mode says so; TransferError naming the reason otherwise. The caller closes the connection
    on error."""
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
                if key:
                    await _answer(conn, key, link_encrypted(config, scheme), challenge)
        except TimeoutError:
            raise _Refused(f"no authentication from it within {config.connect_timeout_s:g} s") from None
        except ConnectionError as exc:
            raise _Refused(f"the connection failed ({exc})") from None
    except _Refused as exc:
        logger.warning("transfer peer %s did not authenticate: %s", address, exc)
        process_link(scheme, "send").auth_failure()
        raise TransferError(f"transfer peer {address} did not authenticate: {exc}") from None
    conn.limit_body_bytes(config.max_frame_bytes)
