"""Encrypted tcp transfer links (``TransferConfig.encrypt``, what ``--tls`` turns on), with real
processes: a sender child pushes one request through a relay (a thread of this test that
forwards and records every byte, and can flip one) to a receiver child, all on 127.0.0.1.

- Encryption off: the relay finds the KV bytes and the request id in what it saw.
- Encryption on: it finds neither, and the request lands byte-exact.
- A byte flipped inside a sealed body: the receiver fails the request (authentication), the
  sender's finish fails, and the receiver reports no cache for it.
- Settings that differ fail the connection naming ``TransferConfig.encrypt``; ucx refuses it.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from kvstore.transfer import Receiver, TransferConfig, TransferError, connect
from tests.kvstore.transfer_peer import LAYOUT, digest, source

KEY = bytes(range(32))
RID = "req-secret-7f3a"
SEED = 21
# Past the connector's AUTH answer (a 160-byte header and 64 bytes) and the first data frame's
# header (160 bytes, 176 sealed): inside its 8 KiB body either way.
TAMPER_AT = 1000


class Relay:
    """A one-connection TCP relay on 127.0.0.1 that records both directions and can flip the
    byte at offset ``tamper_at`` of the sender's stream."""

    def __init__(self, target: tuple[str, int], tamper_at: int | None = None):
        self._target = target
        self._tamper_at = tamper_at
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(30)
        self.port = self._server.getsockname()[1]
        self.sent = bytearray()  # sender -> receiver, as the sender wrote it
        self.replied = bytearray()
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            client, _ = self._server.accept()
        except OSError:
            return
        upstream = socket.create_connection(self._target, timeout=30)
        for src, dst, record, tamper in ((client, upstream, self.sent, self._tamper_at),
                                         (upstream, client, self.replied, None)):
            thread = threading.Thread(target=self._pump, args=(src, dst, record, tamper), daemon=True)
            thread.start()
            self._threads.append(thread)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray, tamper_at: int | None) -> None:
        try:
            while chunk := src.recv(1 << 16):
                start = len(record)
                record += chunk
                if tamper_at is not None and start <= tamper_at < len(record):
                    chunk = bytearray(chunk)
                    chunk[tamper_at - start] ^= 0x5A
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._server.close()
        for thread in self._threads:
            thread.join(timeout=10)


def run_through_relay(spawn, encrypt: bool, tamper_at: int | None = None) -> tuple[dict, dict, Relay]:
    flags = ["--auth-key", KEY.hex()] + (["--encrypt"] if encrypt else [])
    # The receiver stays up until the sender is done: one that exits once it has failed the
    # request closes the link while the sender reads its verdict, and the sender then sees the
    # connection closing instead of the reason (a race of this harness; a worker stays up).
    receiver = spawn("receive", "--backend", "tcp", "--rids", RID, "--hold-open", *flags)
    host, port = receiver.event("listening")["address"].removeprefix("tcp://").split(":")
    relay = Relay((host, int(port)), tamper_at)
    try:
        sender = spawn("send", "--address", f"tcp://127.0.0.1:{relay.port}", "--rid", RID, "--seed", str(SEED), *flags)
        sent = sender.event("done")
        result = receiver.event("result")
        receiver.tell("close")
    finally:
        relay.close()
    return sent, result, relay


def kv_pattern() -> bytes:
    """64 bytes of the first MLA chunk's rows, as they sit in the sender's memory."""
    return source(SEED)["mla", LAYOUT.mla_layers[0]][:1].tobytes()[:64]


def test_plaintext_link_shows_the_kv_bytes_to_a_relay(spawn):
    sent, result, relay = run_through_relay(spawn, encrypt=False)
    assert sent["error"] is None and result["digest"] == digest(source(SEED))
    assert kv_pattern() in relay.sent and RID.encode() in relay.sent


def test_encrypted_link_hides_the_kv_bytes_and_lands_byte_exact(spawn):
    sent, result, relay = run_through_relay(spawn, encrypt=True)
    assert sent["error"] is None and result["error"] is None
    assert result["digest"] == digest(source(SEED))
    assert len(relay.sent) > sum(a.nbytes for a in source(SEED).values())  # the KV went through it
    assert kv_pattern() not in relay.sent
    assert RID.encode() not in relay.sent and RID.encode() not in relay.replied


def test_tampered_ciphertext_fails_the_request_and_leaves_no_cache(spawn):
    sent, result, _ = run_through_relay(spawn, encrypt=True, tamper_at=TAMPER_AT)
    assert result["digest"] is None and "failed authentication" in result["error"], result
    assert RID in result["error"]
    assert sent["error"] is not None  # the sender's finish failed too: the connection is gone


def test_tampered_plaintext_fails_by_checksum(spawn):
    """The same flip without encryption: the checksum catches it (what encryption replaces)."""
    sent, result, _ = run_through_relay(spawn, encrypt=False, tamper_at=TAMPER_AT)
    assert result["digest"] is None and "checksum mismatch" in result["error"], result
    assert "checksum mismatch" in sent["error"]


@pytest.mark.parametrize("rx_encrypt", [True, False], ids=["receiver-only", "sender-only"])
def test_encryption_on_one_side_only_fails_naming_it(rx_encrypt):
    rx = Receiver(TransferConfig(auth_key=KEY, encrypt=rx_encrypt), backends="tcp")
    try:
        with pytest.raises(TransferError, match=r"TransferConfig.encrypt differs"):
            connect(rx.address, TransferConfig(auth_key=KEY, encrypt=not rx_encrypt))
    finally:
        rx.close()


def test_encrypt_needs_a_key_and_ucx_refuses_it():
    with pytest.raises(ValueError, match="encrypt needs an auth_key"):
        TransferConfig(encrypt=True)
    with pytest.raises(TransferError, match="ucx links do not encrypt"):
        Receiver(TransferConfig(auth_key=KEY, encrypt=True), backends="ucx")


def test_every_frame_kind_round_trips_sealed():
    """Control frames with bodies both ways (an ABORT's reason, an ERROR's), staged data (blobs),
    a sink's refusal and a retry after abort, all over one encrypted link."""
    from kvstore.transfer import BlobSink, Expected, Kind
    from tests.kvstore.transfer_peer import make_destination, received, send_chunks, send_states

    config = TransferConfig(deadline_s=20.0, auth_key=KEY, encrypt=True, max_frame_bytes=2 << 20)
    rx = Receiver(config, backends="tcp")
    tx = connect(rx.address, config)
    try:
        blobs, blob = BlobSink(), bytes(range(256)) * 4096
        rx.expect("pull", blobs, Expected(num_blobs=1))
        tx.send("pull", 0, Kind.BLOB, (0, 0), blob)
        tx.finish("pull", 1)
        sink, expected = make_destination()
        rx.expect("aborted", sink, expected)
        data = source(SEED)
        send_chunks(tx, "aborted", data, LAYOUT.chunks[:1])
        tx.abort("aborted", "prefill ran out of memory", wait_s=10.0)
        with pytest.raises(TransferError, match="aborted by the sender: prefill ran out of memory"):
            rx.wait_complete("aborted")
        with pytest.raises(TransferError, match="'stranger' is not expected by this receiver"):
            tx.send("stranger", 0, Kind.BLOB, (0, 0), b"x" * 64)
            tx.finish("stranger", 1)
        rx.expect("aborted", sink, expected)  # the same id again, as a retry does
        send_chunks(tx, "aborted", data, LAYOUT.chunks)
        send_states(tx, "aborted", data)
        tx.finish("aborted", LAYOUT.num_units)
        assert not tx.failed
    finally:
        tx.close()
    rx.wait_complete("pull")
    rx.wait_complete("aborted")
    assert blobs.blobs[0] == blob and digest(received(sink)) == digest(data)
    rx.check_integrity()
    rx.close()
