"""Authenticated transfer connections (``kvstore.transfer.auth``), over every backend with the
two ends in different processes: matching keys deliver byte-exact both ways; a wrong key, or
a key on one side only, fails the connection with a reason naming it and leaves the
receiver's destination untouched; a raw peer that sends a well-formed data frame, or
nothing, instead of its proof is dropped, logged with its address and counted, and nothing
it sent lands; a listener that cannot prove the key is refused by the sender (mutual).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvstore.transfer import Address, BlobSink, Expected, Kind, Receiver, TransferConfig, TransferError, connect
from kvstore.transfer.auth import CHALLENGE_BYTES, MAC_BYTES, NONCE_BYTES, PLAIN, PROTOCOL, SEALED, proof
from kvstore.transfer.frames import (
    FLAG_INLINE_BODY,
    HEADER_BYTES,
    ChecksumAlgo,
    DType,
    FrameHeader,
    checksum,
    control_header,
    unpack_header,
)
from runtime.metrics import Identity, disable, enable
from tests.kvstore.transfer_peer import LAYOUT, digest, make_destination, received, send_chunks, send_states, source
from tests.kvstore.transfer_support import BACKENDS

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
IDENTITY = Identity("rx-test", "decode", "tiny")
SOCKET_TIMEOUT_S = 30.0


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """This process's transfer metrics, counted into a registry of the test's own."""
    registry = CollectorRegistry()
    enable(IDENTITY, registry)
    yield registry
    disable()


def auth_failures(registry: CollectorRegistry, backend: str, direction: str = "recv") -> float:
    labels = {**IDENTITY.labels, "backend": backend, "direction": direction}
    return registry.get_sample_value("tidekv:transfer_auth_failures_total", labels) or 0.0


def make_rx(backend: str, key: bytes, **kw) -> Receiver:
    return Receiver(TransferConfig(deadline_s=20.0, auth_key=key, **kw), backends=backend)


def close_rx(rx: Receiver, *expected_rids: str) -> None:
    """Cancel the requests a test expected but never let arrive, then check and close."""
    for rid in expected_rids:
        rx.cancel(rid)
    rx.check_integrity()
    assert rx.num_pending == 0, "a test left a request pending in the receiver"
    rx.close()


def untouched(sink) -> bool:
    """The destination still holds what make_destination filled it with (NaN rows, zero states)."""
    return bool(
        torch.isnan(sink.pool).all()
        and all((t == 0).all() for t in sink.kda_state.values())
        and all((t == 0).all() for t in sink.kda_conv.values())
    )


def _send_args(address: str, rid: str, key: bytes, *extra: str) -> list[str]:
    return ["send", "--address", address, "--rid", rid, "--auth-key", key.hex(), *extra]


# ---- mechanism -------------------------------------------------------------------------------


def test_proofs_bind_both_nonces_in_order_so_none_can_be_reflected():
    a, b = bytes(NONCE_BYTES), bytes([1]) * NONCE_BYTES
    assert proof(KEY, a, b) != proof(KEY, b, a)  # the listener's proof is not the connector's
    assert proof(KEY, a, b) != proof(OTHER_KEY, a, b)
    assert proof(KEY, a, b, PLAIN) != proof(KEY, a, b, SEALED)  # a relay cannot strip the encryption
    assert len(proof(KEY, a, b)) == MAC_BYTES and PROTOCOL == b"tidekv-transfer/1"
    with pytest.raises(ValueError, match="at least 16"):
        TransferConfig(auth_key=b"short")
    assert KEY.hex() not in repr(TransferConfig(auth_key=KEY))


# ---- matching keys ---------------------------------------------------------------------------


def test_matching_keys_deliver_byte_exact(backend, spawn, registry):
    rx = make_rx(backend, KEY)
    try:
        sink, expected = make_destination()
        rx.expect("req-a", sink, expected)
        peer = spawn(*_send_args(rx.address, "req-a", KEY, "--seed", "11"))
        rx.wait_complete("req-a")
        assert peer.event("done")["error"] is None
        assert digest(received(sink)) == digest(source(11))
        assert auth_failures(registry, backend) == 0
    finally:
        close_rx(rx)


def test_matching_keys_deliver_to_a_receiver_process(backend, spawn):
    receiver = spawn("receive", "--backend", backend, "--rids", "req-b", "--auth-key", KEY.hex())
    address = receiver.event("listening")["address"]
    tx = connect(address, TransferConfig(deadline_s=20.0, auth_key=KEY))
    try:
        data = source(12)
        send_chunks(tx, "req-b", data, LAYOUT.chunks)
        send_states(tx, "req-b", data)
        tx.finish("req-b", LAYOUT.num_units)
    finally:
        tx.close()
    result = receiver.event("result")
    assert result["error"] is None and result["digest"] == digest(source(12))


# ---- mismatched settings: the connection fails, nothing lands -------------------------------


@pytest.mark.parametrize(
    "rx_key,tx_key,reason",
    [
        (KEY, OTHER_KEY, r"did not authenticate: it refused our proof.*auth_keys differ"),
        (KEY, b"", r"did not authenticate: it requires authentication and this sender has no auth_key"),
        (b"", KEY, r"did not authenticate: it has no auth_key and this sender has one"),
    ],
    ids=["wrong-key", "key-on-receiver-only", "key-on-sender-only"],
)
def test_mismatched_keys_fail_clearly_and_nothing_is_written(backend, spawn, registry, rx_key, tx_key, reason):
    rx = make_rx(backend, rx_key)
    try:
        sink, expected = make_destination()
        rx.expect("req-m", sink, expected)
        peer = spawn(*_send_args(rx.address, "req-m", tx_key))
        error = peer.event("done")["error"]
        assert error.startswith("connect failed: transfer peer") and error.count(rx.address) == 1
        assert re.search(reason, error), error
        assert rx.frames_received == 0 and untouched(sink)
        # The receiver counts the failure on its own I/O loop, maybe after the sender has given up.
        want = 1 if rx_key else 0
        until = time.monotonic() + 10
        while auth_failures(registry, backend) < want and time.monotonic() < until:
            time.sleep(0.02)
        assert auth_failures(registry, backend) == want
    finally:
        close_rx(rx, "req-m")


# ---- raw peers that never authenticate -------------------------------------------------------


def raw_connect(address: str) -> socket.socket:
    parsed = Address.parse(address)
    if parsed.scheme == "shm":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(SOCKET_TIMEOUT_S)
        sock.connect("\0tidekv-" + parsed.name)
    else:
        sock = socket.create_connection((parsed.host, parsed.port), timeout=SOCKET_TIMEOUT_S)
    return sock


def read_exactly(sock: socket.socket, nbytes: int) -> bytes:
    out = b""
    while len(out) < nbytes:
        chunk = sock.recv(nbytes - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {nbytes} bytes")
        out += chunk
    return out


def read_challenge(sock: socket.socket) -> bytes:
    """The listener's nonce (its challenge's last byte is the link's mode)."""
    header = unpack_header(read_exactly(sock, HEADER_BYTES))
    assert header.kind == Kind.AUTH and header.body_bytes == CHALLENGE_BYTES
    return read_exactly(sock, CHALLENGE_BYTES)[:NONCE_BYTES]


def closed_by_listener(sock: socket.socket) -> bool:
    """True once the listener has dropped us (EOF or reset); False if it still talks."""
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def data_frame(rid: str, kind: Kind, layer: int, t0: int, t1: int, body: bytes, shape: tuple[int, ...]) -> bytes:
    header = FrameHeader(
        kind=kind, request_id=rid, seq=1, layer=layer, token_start=t0, token_end=t1,
        dtype=DType.FLOAT32 if kind == Kind.MLA_ROWS else DType.UINT8, shape=shape, body_bytes=len(body),
        body_checksum=checksum(ChecksumAlgo.CRC32, body), checksum_algo=ChecksumAlgo.CRC32, flags=FLAG_INLINE_BODY,
    )
    return header.pack() + body


def test_raw_peer_sending_data_before_authenticating_is_dropped(backend, registry, caplog):
    rx = make_rx(backend, KEY)
    sock = None
    try:
        sink, expected = make_destination()
        rx.expect("req-raw", sink, expected)
        blobs = BlobSink()
        rx.expect("req-blob", blobs, Expected(num_blobs=1))
        sock = raw_connect(rx.address)
        local = sock.getsockname()
        read_challenge(sock)
        with caplog.at_level(logging.WARNING, logger="kvstore.transfer.auth"):
            rows = np.ones((LAYOUT.chunk_tokens, LAYOUT.latent_dim), dtype=np.float32).tobytes()
            shape = (LAYOUT.chunk_tokens, LAYOUT.latent_dim)
            sock.sendall(data_frame("req-raw", Kind.MLA_ROWS, LAYOUT.mla_layers[0], 0, LAYOUT.chunk_tokens, rows, shape)
                         + data_frame("req-blob", Kind.BLOB, 0, 0, 0, b"x" * 16, (16,)))
            assert closed_by_listener(sock)
        assert rx.frames_received == 0 and untouched(sink) and not blobs.blobs
        assert auth_failures(registry, backend) == 1
        text = caplog.text
        assert "did not authenticate" in text
        where = f"pid {os.getpid()}" if backend == "shm" else f"{local[0]}:{local[1]}"
        assert where in text, text
    finally:
        if sock is not None:
            sock.close()
        close_rx(rx, "req-raw", "req-blob")


def test_small_data_frame_instead_of_a_proof_is_dropped(backend, registry, caplog):
    """A data frame small enough to pass the handshake's body limit is refused by its kind."""
    rx = make_rx(backend, KEY)
    try:
        blobs = BlobSink()
        rx.expect("req-tiny", blobs, Expected(num_blobs=1))
        with raw_connect(rx.address) as sock, caplog.at_level(logging.WARNING, logger="kvstore.transfer.auth"):
            read_challenge(sock)
            sock.sendall(data_frame("req-tiny", Kind.BLOB, 0, 0, 0, b"y" * 8, (8,)))
            assert closed_by_listener(sock)
        assert "it sent BLOB request 'req-tiny' seq 1 layer 0 tokens [0, 0) before authenticating" in caplog.text
        assert rx.frames_received == 0 and not blobs.blobs and auth_failures(registry, backend) == 1
    finally:
        close_rx(rx, "req-tiny")


def test_stalled_peer_is_dropped_after_connect_timeout(backend, registry):
    rx = make_rx(backend, KEY, connect_timeout_s=0.3)
    try:
        with raw_connect(rx.address) as sock:
            read_challenge(sock)
            assert closed_by_listener(sock)  # we sent nothing: the listener gave up on us
        assert auth_failures(registry, backend) == 1
    finally:
        close_rx(rx)


def test_sender_refuses_a_listener_that_cannot_prove_the_key(registry):
    """Mutual: a listener that accepts any proof but answers with a wrong one is refused."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(SOCKET_TIMEOUT_S)
    got: dict[str, bytes] = {}

    def rogue() -> None:
        conn, _ = server.accept()
        with conn:
            challenge = os.urandom(NONCE_BYTES) + PLAIN
            conn.sendall(control_header(Kind.AUTH, "", payload=challenge).pack() + challenge)
            unpack_header(read_exactly(conn, HEADER_BYTES))
            got["answer"] = read_exactly(conn, MAC_BYTES + NONCE_BYTES)
            fake = bytes(MAC_BYTES)
            conn.sendall(control_header(Kind.AUTH, "", payload=fake).pack() + fake)
            got["after"] = conn.recv(1)  # b"": the sender closed without sending a frame more

    thread = threading.Thread(target=rogue)
    thread.start()
    try:
        address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(TransferError, match=r"did not authenticate: its proof is wrong"):
            connect(address, TransferConfig(auth_key=KEY))
    finally:
        thread.join(timeout=SOCKET_TIMEOUT_S)
        server.close()
    assert len(got["answer"]) == MAC_BYTES + NONCE_BYTES and got["after"] == b""
    assert auth_failures(registry, "tcp", direction="send") == 1
