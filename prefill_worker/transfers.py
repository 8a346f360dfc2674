"""The prefill worker's transfer endpoints: cached senders to decode workers, and pulls of
cached blocks from other prefill workers.

A pull asks the holder (gRPC ``PushBlocks``) to send encoded blocks as BLOB frames to this
worker's receiver; each blob is checksummed by the transfer engine and verified again when
decoded as a payload. Thread-safe.

Test-only fault hook: ``faults`` (``PrefillConfig.fault_corrupt_frame``) makes the first
sender the hub opens flip a byte of its ``seq``-th frame (1-based, counted per connection)
after checksumming, once; the receiver must detect it.
"""

from __future__ import annotations

import logging
import threading

import grpc

from kvstore.transfer.base import Expected, FaultInjection, TransferConfig, TransferError
from kvstore.transfer.frames import Kind
from kvstore.transfer.receiver import Receiver
from kvstore.transfer.sender import Sender, connect
from kvstore.transfer.sinks import BlobSink
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import Member, worker_principal
from runtime.grpc_server import channel

log = logging.getLogger(__name__)


class TransferHub:
    """``member`` signs the pulls' PushBlocks calls (None: unsigned, for tests of one piece).
    ``faults`` (test-only) go to the first sender opened, once."""

    def __init__(self, config: TransferConfig, backend: str = "tcp", member: Member | None = None,
                 faults: FaultInjection | None = None):
        self.config = config
        self.member = member
        self.receiver = Receiver(config, backends=backend)
        self._senders: dict[str, Sender] = {}
        self._lock = threading.Lock()
        self._faults = faults  # guarded by _lock
        if self._faults is not None:
            log.warning("test-only fault injection armed for the next transfer connection: %s", self._faults)

    @property
    def address(self) -> str:
        return self.receiver.address

    def sender(self, address: str) -> Sender:
        """A connected sender to address (reused while healthy)."""
        with self._lock:
            s = self._senders.get(address)
            if s is not None and not s.failed:
                return s
            s = connect(address, self.config, faults=self._faults)
            self._faults = None  # applied once: to the first connection made
            self._senders[address] = s
            return s

    def pull_blocks(self, transfer_id: str, holder_rpc_address: str, keys: list[bytes], timeout_s: float,
                    request_id: str = "", grant: bytes = b"", grant_expiry_ms: int = 0,
                    holder_worker_id: str = "") -> list[bytes]:
        """Encoded payloads of keys from the holder (worker ``holder_worker_id``, the audience
        of the signed call), in order, under the Conductor's ``grant`` for ``request_id``.
        TransferError on any failure."""
        sink = BlobSink()
        self.receiver.expect(transfer_id, sink, Expected(num_blobs=len(keys)), timeout_s)
        ch = (self.member.channel(holder_rpc_address, audience=worker_principal(holder_worker_id))
              if self.member is not None else channel(holder_rpc_address))
        stub = igrpc.PrefillStub(ch)
        try:
            stub.PushBlocks(ipb.PushBlocksRequest(transfer_id=transfer_id, block_keys=keys,
                                                  dest_transfer_address=self.address, request_id=request_id,
                                                  grant=grant, grant_expiry_ms=grant_expiry_ms),
                            timeout=timeout_s)
        except grpc.RpcError as e:
            self.receiver.cancel(transfer_id)
            raise TransferError(f"holder {holder_rpc_address} could not push blocks: {e.details()}") from e
        finally:
            ch.close()
        self.receiver.wait_complete(transfer_id, timeout_s)  # complete: every blob index arrived
        return [sink.blobs[i] for i in range(len(keys))]

    def push_blobs(self, transfer_id: str, dest: str, blobs: list[bytes]) -> None:
        sender = self.sender(dest)
        for i, blob in enumerate(blobs):
            sender.send(transfer_id, i, Kind.BLOB, (0, 0), blob)
        sender.finish(transfer_id, len(blobs))

    def close(self) -> None:
        with self._lock:
            for s in self._senders.values():
                s.close()
            self._senders.clear()
        self.receiver.close()
