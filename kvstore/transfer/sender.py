"""Sender: pushes one peer's chunks (layer KV rows, KDA states, blobs) over one link.

Threads: ``send``/``finish``/``abort``/``close`` are called from caller threads (a prefill
loop); they take ``self._cond`` (a ``threading.Condition``) only to account bytes and hand
the frame to the I/O thread, whose link checksums it and writes it zero-copy from the tensor's
memory (tcp, ucx) or copies it once into the receiver's memory (shm). Another I/O-thread task
reads the receiver's replies (ACK / ERROR / DONE).

Backpressure: ``send`` blocks while the body bytes handed over but not yet acknowledged by the
receiver (``inflight_bytes``) plus the new frame would exceed ``config.max_inflight_bytes``;
the receiver acknowledges a frame only after its sink copied it. Every blocking call gives up
with ``TransferError`` after ``config.deadline_s``.

Ownership: the sender keeps a reference to the tensor and reads its memory from the I/O thread
until the frame is written; do not modify it in place before ``flush`` or ``finish`` returns.
Every request ends with ``finish`` or ``abort`` (also after a TransferError), which forgets it.
``sync`` (and ``abort(..., wait_s=)``) waits until the receiver has handled every frame sent
before it, so a retry under the same request id cannot meet frames of the failed attempt.

Metrics (``kvstore.transfer.metrics``, the process context): frames and bytes written,
the seconds from a request's first frame to its verdict, aborts.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvstore.transfer.base import (
    Address,
    FaultInjection,
    LinkClosed,
    SenderStats,
    SendLink,
    TransferConfig,
    TransferError,
)
from kvstore.transfer.frames import (
    MAX_NDIM,
    FrameHeader,
    Kind,
    control_header,
)
from kvstore.transfer.ioloop import IoThread
from kvstore.transfer.metrics import process_link
from kvstore.transfer.outgoing import Outgoing, as_body, checked_id, coalesce
from kvstore.transfer.registry import get_backend

logger = logging.getLogger(__name__)


class _InjectedTruncation(ConnectionError):
    """Raised by the writer after a test-only truncated frame."""


@dataclass
class _OutRequest:
    """Per-request sender state; guarded by ``Sender._cond``."""

    error: str | None = None
    done: bool = False
    started: float = field(default_factory=time.monotonic)


def connect(
    address: str,
    config: TransferConfig | None = None,
    *,
    io: IoThread | None = None,
    faults: FaultInjection | None = None,
) -> Sender:
    """Open a sender to a receiver's ``address`` (``tcp://``, ``shm://`` or ``ucx://``);
    TransferError when it cannot connect or the peers do not authenticate each other."""
    config = config or TransferConfig()
    io = io or IoThread.shared()
    parsed = Address.parse(address)
    # Each of the backend's steps is bounded by connect_timeout_s: the connect, the auth
    # exchange and (shm, ucx) the HELLO; this outer bound only catches a hung loop.
    link = io.run(get_backend(parsed.scheme).connect(parsed, config), config.connect_timeout_s * 4)
    return Sender(link, address, config, io, faults or FaultInjection())


class Sender:
    """One connection's sending side; thread-safe. Build it with ``connect``."""

    def __init__(self, link: SendLink, address: str, config: TransferConfig, io: IoThread, faults: FaultInjection):
        self.address = address
        self.config = config
        self._link = link
        self._io = io
        self._faults = faults
        self._cond = threading.Condition()
        self._requests: dict[str, _OutRequest] = {}
        self._unacked: collections.deque[tuple[int, int]] = collections.deque()  # (seq, body bytes), in seq order
        self._inflight_bytes = 0
        self._high_water_bytes = 0
        self._backpressure_waits = 0
        self._frames_sent = 0
        self._bytes_sent = 0
        self._next_seq = 1
        self._synced_seq = 0  # highest SYNC the receiver has answered
        self._failure: str | None = None
        # Frames handed to the writer, in seq order (None: close). Caller threads append under
        # _cond; the writer is woken (one call into the loop) only when it waits for work, so a
        # burst of small frames costs one wakeup, not one per frame.
        self._outbox: collections.deque[Outgoing | None] = collections.deque()
        self._writer_waiting = False  # guarded by _cond
        self._wakeup = asyncio.Event()  # I/O thread only
        self._metrics = process_link(address, "send")
        self._writer = io.submit(self._write_loop())
        self._reader = io.submit(self._read_loop())

    @property
    def failed(self) -> bool:
        """True once the connection has failed; a new ``connect`` is needed."""
        with self._cond:
            return self._failure is not None

    # ---- caller threads --------------------------------------------------------------------

    def send(self, request_id: str, layer: int, kind: Kind, token_range: tuple[int, int], tensor: Any) -> None:
        """Queue one chunk; blocks while in-flight bytes are over the bound (backpressure).

        MLA rows: ``tensor`` is ``[token_end - token_start, latent_dim]``. KDA state/conv: the
        layer's whole final tensor (token_range is informational). BLOB: bytes-like, layer is
        the blob index. Raises ValueError for a broken contract, TransferError when the request
        or the connection has failed or the deadline passed while blocked.
        """
        kind = Kind(kind)
        if not kind.is_data:
            raise ValueError(f"send carries data kinds only, got {kind.name}; use finish/abort")
        body, dtype, shape = as_body(tensor)
        token_start, token_end = token_range
        if kind == Kind.MLA_ROWS and (not shape or shape[0] != token_end - token_start or token_end <= token_start):
            raise ValueError(f"MLA rows of shape {shape} do not match token range [{token_start}, {token_end})")
        if body.nbytes > self.config.max_frame_bytes:
            raise ValueError(
                f"chunk of {body.nbytes} bytes exceeds max_frame_bytes {self.config.max_frame_bytes}; "
                "split it into smaller token ranges"
            )
        if len(shape) > MAX_NDIM:
            raise ValueError(f"tensor has {len(shape)} dims, frames carry at most {MAX_NDIM}")
        header = FrameHeader(
            kind=kind,
            request_id=checked_id(request_id),
            layer=layer,
            token_start=token_start,
            token_end=token_end,
            dtype=dtype,
            shape=shape,
            body_bytes=body.nbytes,
            checksum_algo=self.config.checksum,
        )
        self._enqueue(Outgoing(header, parts=(body,)), body.nbytes)

    def finish(self, request_id: str, num_layers: int, timeout_s: float | None = None) -> None:
        """Tell the receiver the request is complete (``num_layers`` layers + blobs pushed) and
        wait for its verdict; TransferError if it found the transfer incomplete or corrupt."""
        header = control_header(Kind.END, checked_id(request_id), layer=num_layers)
        until = time.monotonic() + (self.config.deadline_s if timeout_s is None else timeout_s)
        try:
            self._enqueue(Outgoing(header, payload=b""), 0)
            with self._cond:
                request = self._requests[request_id]
                while not request.done:
                    self._raise_if_failed(request, request_id)
                    if not self._wait_until(until):
                        raise TransferError(
                            f"request {request_id!r}: no verdict from {self.address} within the deadline",
                            request_id,
                        )
                self._metrics.transferred(time.monotonic() - request.started)
        finally:
            with self._cond:
                self._requests.pop(request_id, None)

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until the receiver has consumed every chunk sent so far (no bytes in flight);
        after it, the sent tensors may be reused. TransferError on failure or deadline."""
        until = time.monotonic() + (self.config.deadline_s if timeout_s is None else timeout_s)
        with self._cond:
            while self._inflight_bytes:
                if self._failure is not None:
                    raise TransferError(self._failure)
                if not self._wait_until(until):
                    raise TransferError(f"{self._inflight_bytes} bytes to {self.address} not consumed in time")

    def _wait_until(self, until: float) -> bool:
        """Wait on the condition (held) until notified or ``until``; False once ``until`` passed."""
        remaining = until - time.monotonic()
        if remaining <= 0:
            return False
        self._cond.wait(remaining)
        return True

    def abort(self, request_id: str, reason: str, wait_s: float = 0.0) -> None:
        """Give up on a request; the receiver fails it with ``reason``. Never raises for a
        request that has already failed (its usual caller: a prefill that got a TransferError)
        and forgets the request. With ``wait_s`` > 0 it then waits (``sync``, at most
        ``wait_s``) until the receiver has handled the ABORT and every frame before it, so
        nothing of this attempt can reach a request the receiver expects under the same id
        later (a retry); otherwise it does not wait."""
        payload = reason.encode()[:4096]
        with self._cond:
            # Forget its failure first: a request that failed would refuse the ABORT frame.
            self._requests.pop(request_id, None)
            if self._failure is not None:
                return
        header = control_header(Kind.ABORT, checked_id(request_id), payload=payload)
        self._metrics.aborted()
        try:
            self._enqueue(Outgoing(header, payload=payload), 0)
        except TransferError as exc:  # the connection failed meanwhile: nothing more reaches the receiver
            logger.debug("abort of %r not sent: %s", request_id, exc)
        with self._cond:
            self._requests.pop(request_id, None)
        if wait_s > 0 and not self.sync(wait_s) and not self.failed:
            logger.warning("abort of %r: %s did not confirm it within %.3g s", request_id, self.address, wait_s)

    def sync(self, timeout_s: float | None = None) -> bool:
        """Block until the receiver has handled every frame queued before this call (a SYNC,
        answered in order). False when the connection failed or ``timeout_s`` (default
        ``config.deadline_s``) passed first."""
        if self._io.in_thread():
            raise RuntimeError("Sender.sync blocks; call it from a worker thread, not the I/O thread")
        until = time.monotonic() + (self.config.deadline_s if timeout_s is None else timeout_s)
        with self._cond:
            if self._failure is not None:
                return False
            item = Outgoing(control_header(Kind.SYNC, ""), payload=b"", seq=self._next_seq)
            self._next_seq += 1
            self._hand_over(item)
            while self._synced_seq < item.seq:
                if self._failure is not None or not self._wait_until(until):
                    return False
            return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Write out queued frames, then close gracefully (see ``StreamSendLink.shutdown``);
        requests not yet finished fail. Idempotent; waits at most about ``2 * timeout_s``."""
        if self._io.in_thread():
            raise RuntimeError("Sender.close blocks; call it from a worker thread, not the I/O thread")
        with self._cond:
            self._hand_over(None)
        try:
            self._writer.result(timeout_s)
        except TimeoutError:
            logger.warning("sender to %s did not flush within %.1f s; closing anyway", self.address, timeout_s)
        self._fail_all("sender closed")
        try:
            self._io.run(self._link.shutdown(timeout_s), timeout_s + 1.0)
        except TimeoutError:
            self._io.call_soon(self._link.close)

    def stats(self) -> SenderStats:
        with self._cond:
            return SenderStats(
                self._frames_sent,
                self._bytes_sent,
                self._inflight_bytes,
                self._high_water_bytes,
                self._backpressure_waits,
            )

    def _enqueue(self, item: Outgoing, nbytes: int) -> None:
        if self._io.in_thread():
            raise RuntimeError("Sender calls block; call them from a worker thread, not the I/O thread")
        rid = item.header.request_id
        until = time.monotonic() + self.config.deadline_s
        with self._cond:
            request = self._requests.get(rid)
            if request is None:
                request = self._requests[rid] = _OutRequest()
            blocked = False
            while True:
                self._raise_if_failed(request, rid)
                if self._inflight_bytes + nbytes <= self.config.max_inflight_bytes:
                    break
                self._backpressure_waits += 0 if blocked else 1
                blocked = True
                if not self._wait_until(until):
                    raise TransferError(
                        f"request {rid!r}: {self._inflight_bytes} bytes in flight to {self.address} "
                        f"did not drain within the {self.config.deadline_s:g} s deadline",
                        rid,
                    )
            seq = self._next_seq
            self._next_seq += 1
            if nbytes:
                self._unacked.append((seq, nbytes))
                self._inflight_bytes += nbytes
                self._high_water_bytes = max(self._high_water_bytes, self._inflight_bytes)
            item.seq = seq
            self._hand_over(item)

    def _hand_over(self, item: Outgoing | None) -> None:
        """Queue ``item`` for the writer (``_cond`` held), waking it if it waits."""
        self._outbox.append(item)
        if self._writer_waiting:
            self._writer_waiting = False
            self._io.call_soon(self._wakeup.set)

    def _raise_if_failed(self, request: _OutRequest, request_id: str) -> None:
        if request.error is not None:
            raise TransferError(request.error, request_id)
        if self._failure is not None:
            raise TransferError(f"request {request_id!r}: {self._failure}", request_id)

    def _fail_all(self, reason: str) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = reason
            self._cond.notify_all()

    # ---- I/O thread ------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        try:
            while (item := await self._next_item()) is not None:
                if self._failure is None:
                    await self._write_one(item)
            await self._link.flush()
        except _InjectedTruncation as exc:
            self._fail_all(str(exc))  # the link stays half-open so the receiver reads the partial frame
        except (ConnectionError, OSError, TransferError) as exc:
            self._fail_all(f"connection to {self.address} failed: {exc}")
            self._link.close()
        except Exception:  # outermost boundary of the writer task
            logger.exception("transfer sender to %s crashed", self.address)
            self._fail_all(f"sender to {self.address} crashed (see log)")
            self._link.close()

    async def _next_item(self) -> Outgoing | None:
        """The next queued frame; while none is queued, flush the link and wait for one."""
        while True:
            with self._cond:
                if self._outbox:
                    return self._coalesce(self._outbox.popleft())
                self._writer_waiting = True
                self._wakeup.clear()
            await self._link.flush()  # links may batch small frames until the queue runs dry
            await self._wakeup.wait()

    def _coalesce(self, item: Outgoing | None) -> Outgoing | None:
        """``item`` merged with the queued frames that continue its rows (``_cond`` held)."""
        if item is None or not self._link.coalesces:
            return item
        faulty = (self._faults.corrupt_seq, self._faults.truncate_seq)
        return coalesce(item, self._outbox, self.config.max_frame_bytes, faulty)

    async def _write_one(self, item: Outgoing) -> None:
        if item.parts is None:
            await self._link.send_control(item.header._replace(seq=item.seq), item.payload or b"")
            return
        header = item.header._replace(seq=item.seq)
        if header.seq == self._faults.truncate_seq:
            await self._link.send_truncated(header, item.parts[0])
            raise _InjectedTruncation(f"fault injection: truncated frame seq {header.seq}")
        # The link checksums the body (the shm link while copying it into the destination).
        with self._cond:
            more = bool(self._outbox) and self._outbox[0] is not None and self._outbox[0].parts is not None
        await self._link.send_data(header, item.parts, header.seq == self._faults.corrupt_seq, more)
        self._metrics.frame(header.body_bytes)
        with self._cond:
            self._frames_sent += 1
            self._bytes_sent += header.body_bytes

    async def _read_loop(self) -> None:
        try:
            while True:
                item = await self._link.next_reply()
                if isinstance(item, LinkClosed):
                    self._fail_all(f"connection to receiver {self.address} lost: {item.reason}")
                    return
                self._on_reply(item.header, bytes(item.inline or b""))
        except Exception:  # outermost boundary of the reader task
            logger.exception("transfer sender to %s: reply reader crashed", self.address)
            self._fail_all(f"reply reader for {self.address} crashed (see log)")
            self._link.close()

    def _on_reply(self, header: FrameHeader, payload: bytes) -> None:
        if header.kind == Kind.ACK:
            self._link.on_ack(header.seq)
        with self._cond:
            request = self._requests.get(header.request_id)
            if header.kind == Kind.ACK:
                while self._unacked and self._unacked[0][0] <= header.seq:
                    self._inflight_bytes -= self._unacked.popleft()[1]
            elif header.kind == Kind.ERROR and request is not None and request.error is None:
                request.error = f"receiver {self.address} failed request {header.request_id!r}: {payload.decode()}"
            elif header.kind == Kind.DONE and request is not None:
                request.done = True
            elif header.kind == Kind.SYNCED:
                self._synced_seq = max(self._synced_seq, header.seq)
            elif header.kind not in (Kind.ACK, Kind.ERROR, Kind.DONE):
                logger.warning("unexpected reply %s from %s", header.describe(), self.address)
            self._cond.notify_all()
