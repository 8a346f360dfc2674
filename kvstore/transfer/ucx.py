"""UCX backend through ucxx: headers over a TCP control connection, bodies as UCX tag messages.

The receiver listens on a TCP control port (``config.bind_host``, 127.0.0.1 by default; UCX's
own sockaddr listener would bind every interface, so it is not used). On connect, after the
authentication exchange of ``auth`` on that control connection, it sends a HELLO carrying
its UCX worker address and a per-connection tag prefix; the sender opens a UCX endpoint to
that worker address and answers with a HELLO naming its own, to which the receiver opens the
endpoint its receives are posted on (so closing the link cancels them). Each data frame's
header goes over TCP and its body as one tag message ``tag = prefix << 32 | seq`` from the
tensor's memory; the receiver admits the header, then posts the matching tag receive straight
into the destination when that is one contiguous view (else into a staging buffer), and
checksums the body there (UCX holds a message that arrives first), reading the next header
meanwhile (``lands_apart``: the receiver's ``landing``). The sender pipelines:
several bodies are in flight at once, bounded by its in-flight credit. Every body send/recv
races the control connection closing, so a dead peer fails, not hangs.

Coalesced frames are one tag message too (``UcxSendLink``). Operations given up on are parked
and logged once per link (``Orphans``); ``shutdown_ucx`` stops ucxx's notifier thread at exit.
``TransferConfig.encrypt`` is refused: UCX messages are not sealed here.

``ucxx.init`` runs once per process, in ucxx's thread progress mode (``_progress_mode``), with
``config.ucx_options`` (default: UCX's tcp transport on loopback, ``TLS=tcp NET_DEVICES=lo``;
UCX's shared-memory transports stay unused because endpoints are opened with error handling;
RDMA deployments pass their own, e.g.
``TLS=rc,ud,self,cuda_copy,cuda_ipc`` with ``NET_DEVICES=mlx5_0:1``, and get zero-copy RDMA).
All of it runs on the I/O loop, whose UCX progress ucxx drives from its own progress thread;
completions reach the loop as Python futures set by ucxx's notifier thread
(``enable_python_future``), not by polling.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import functools
import itertools
import logging
import os
import struct
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import numpy as np

# UCX logs to stdout by default, which corrupts commands that print JSON; ucxx itself sets
# UCX_MEMTYPE_CACHE, which CPU builds of UCX then warn about. Callers' settings win.
os.environ.setdefault("UCX_LOG_FILE", "stderr")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx  # after the environment defaults above
from ucxx.exceptions import UCXError

from kvstore.transfer.base import Address, Frame, LinkClosed, RecvLink, TransferConfig, TransferError
from kvstore.transfer.direct import checksum_of, copy_with_checksum
from kvstore.transfer.frames import HEADER_BYTES, FrameError, FrameHeader, Kind, checksum, control_header
from kvstore.transfer.orphans import Orphans
from kvstore.transfer.tcp import StreamListener, open_tcp, serve_factory
from kvstore.transfer.wire import FrameConnection, StreamRecvLink, StreamSendLink, land

logger = logging.getLogger(__name__)
_HELLO = struct.Struct("<I")  # tag prefix; followed by the receiver's UCX worker address
_init_lock = threading.Lock()
_initialized_options: tuple[tuple[str, str], ...] | None = None
_tag_prefixes = itertools.count(1)  # process-wide: every connection to this worker gets its own
_stopped = False  # shutdown_ucx ran: the notifier thread is gone


def shutdown_ucx() -> None:
    """Stop ucxx's notifier thread (``ucxx.stop_notifier_thread``), waking it at once rather
    than at its next 1 s poll; idempotent. Registered to run at exit before the I/O thread
    stops (atexit runs in reverse order), so no ucxx thread is inside UCX while the
    interpreter finalizes. No ucx link may be used after it."""
    global _stopped
    with _init_lock:
        if _initialized_options is None or _stopped:
            return
        _stopped = True
    worker = getattr(ucxx.core._get_ctx(), "worker", None)  # the Cython worker: its wake-up call
    if worker is not None:
        worker.stop_request_notifier_thread()
    ucxx.stop_notifier_thread()


def ensure_ucx(config: TransferConfig) -> None:
    """Initialise ucxx once per process; later configs must agree on the options. Refuses
    ``config.encrypt``: bodies travel as UCX tag messages, which this engine does not seal."""
    global _initialized_options
    if config.encrypt:
        raise TransferError(
            "ucx links do not encrypt KV bodies (TransferConfig.encrypt, set by --tls): use the tcp backend, "
            "or shm on one host"
        )
    with _init_lock:
        if _stopped:
            raise TransferError("ucx was shut down in this process (shutdown_ucx)")
        if _initialized_options is None:
            ucxx.init(options=dict(config.ucx_options), progress_mode=_progress_mode(), enable_python_future=True)
            _initialized_options = config.ucx_options
            atexit.register(shutdown_ucx)
        elif _initialized_options != config.ucx_options:
            logger.warning("ucxx already initialised with %s; ignoring %s", _initialized_options, config.ucx_options)


def _progress_mode() -> str:
    """ucxx's progress mode: a progress thread, which this backend's completions need (Python
    futures set by the notifier thread). ``UCXPY_PROGRESS_MODE=thread-polling`` (a busy-polling
    thread: lower latency, one core spent) is honoured; ``blocking`` and ``polling`` would turn
    those futures off and fail every transfer, so they are refused with a warning."""
    asked = os.environ.get("UCXPY_PROGRESS_MODE", "thread")
    if asked in ("thread", "thread-polling"):
        return asked
    logger.warning("UCXPY_PROGRESS_MODE=%s ignored: the ucx backend needs a progress thread ('thread' or "
                   "'thread-polling'); using 'thread'", asked)
    return "thread"


async def _started(start: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """The ucxx send or receive ``start()`` makes, made once ucxx's pool of Python futures is
    topped up: each operation takes one as it starts, and ucxx's notifier thread refills the
    pool only between its waits, so a burst of more operations than it holds (a transfer
    calibration's) made ucxx warn "No Futures available during getFuture()" for every one it
    then made on the spot. The refill is a no-op while the pool is over half full. (A factory,
    not the coroutine: one cancelled before it runs makes none, so none is left un-awaited.)"""
    ucxx.core._get_ctx().worker.populate_python_futures_pool()
    return await start()


def _tag(prefix: int, seq: int) -> int:
    return (prefix << 32) | (seq & 0xFFFFFFFF)


def _back_to_back(arrays: list[np.ndarray]) -> np.ndarray | None:
    """One array over ``arrays`` when each starts where the one before ends (chunks cut from one
    tensor), without copying; None otherwise. The caller keeps ``arrays`` alive while it is used."""
    if len(arrays) == 1:
        return arrays[0]
    start = position = arrays[0].ctypes.data
    for array in arrays:
        if array.ctypes.data != position:
            return None
        position += array.nbytes
    return np.ctypeslib.as_array((ctypes.c_uint8 * (position - start)).from_address(start))


async def _race_close(
    start: Callable[[], Coroutine[Any, Any, Any]], conn: FrameConnection, timeout_s: float, what: str,
    orphans: Orphans,
) -> None:
    """Await the UCX operation ``start()`` makes unless the control connection closes or
    ``timeout_s`` passes (then the operation goes to ``orphans``)."""
    task = asyncio.ensure_future(_started(start))
    closed = asyncio.ensure_future(conn.closed.wait())
    done, _ = await asyncio.wait({task, closed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    closed.cancel()
    if task not in done:
        orphans.park([task])
        why = (
            f"control connection closed: {conn.closed_reason}" if closed in done else f"no progress in {timeout_s:g} s"
        )
        raise ConnectionError(f"{what} over UCX did not complete ({why})")
    try:
        task.result()
    except UCXError as exc:
        raise ConnectionError(f"{what} over UCX failed: {exc!r}") from exc


class UcxSendLink(StreamSendLink):
    """Sender end: header over TCP, body as one UCX tag message.

    Sends are pipelined: ``send_data`` returns once the header is written and the body's tag
    send is posted; the sender's in-flight bound (ACK credit) limits how many are outstanding.
    A failed body send closes the control connection, which fails the sender.

    Coalesced frames (several chunks' bodies) go as one message too: parts that lie back to
    back in memory (chunks cut from one tensor) as one view of them, no copy; others gathered
    into a buffer of the link's, checksummed block by block while copied (the checksum pass a
    frame needs anyway, ``direct.copy_with_checksum``). Gather buffers are reused once their
    send completed.
    """

    MAX_GATHER_BUFFERS = 4

    def __init__(self, conn: FrameConnection, endpoint: Any, tag_prefix: int, config: TransferConfig):
        super().__init__(conn)
        self._endpoint = endpoint
        self._tag_prefix = tag_prefix
        self._timeout_s = config.deadline_s
        self._sends: set[asyncio.Future] = set()
        self._send_error: str | None = None
        self._gather_free: list[np.ndarray] = []
        self._orphans = Orphans(f"ucx sender link (tag prefix {tag_prefix})")

    coalesces = True  # several parts become one tag message

    async def send_data(
        self, header: FrameHeader, parts: Sequence[memoryview], corrupt: bool = False, more: bool = False
    ) -> None:
        if self._send_error is not None:
            raise ConnectionError(self._send_error)
        body, crc, gathered = self._one_body(header, parts)
        if corrupt:  # fault injection: damage a copy after checksumming
            body = body.copy()
            body[len(body) // 2] ^= 0xFF
        header = header._replace(body_checksum=crc)
        await self.conn.write(header.pack())
        if header.body_bytes:
            tag = _tag(self._tag_prefix, header.seq)
            send = functools.partial(self._endpoint.send, body, tag=tag, force_tag=True)
            task = asyncio.ensure_future(
                _race_close(send, self.conn, self._timeout_s, header.describe(), self._orphans)
            )
            self._sends.add(task)
            # The callback holds the parts (and the buffer) until UCX is done with their memory.
            task.add_done_callback(functools.partial(self._on_sent, keep=(parts, body), gathered=gathered))

    def _one_body(self, header: FrameHeader, parts: Sequence[memoryview]) -> tuple[np.ndarray, int, np.ndarray | None]:
        """The body as one uint8 array, its checksum, and the gather buffer it was copied into (None)."""
        arrays = [np.frombuffer(part, dtype=np.uint8) for part in parts]
        span = _back_to_back(arrays)
        if span is not None:
            return span, checksum(header.checksum_algo, span), None
        buffer = self._take_gather(header.body_bytes)
        body = buffer[: header.body_bytes]
        return body, copy_with_checksum(header.checksum_algo, parts, [body]), buffer

    def _take_gather(self, nbytes: int) -> np.ndarray:
        for i, buffer in enumerate(self._gather_free):
            if buffer.nbytes >= nbytes:
                return self._gather_free.pop(i)
        return np.empty(nbytes, dtype=np.uint8)

    def _on_sent(self, task: asyncio.Future, keep: object, gathered: np.ndarray | None) -> None:
        self._sends.discard(task)
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled() and self._send_error is None:
                self._send_error = str(task.exception())
                logger.warning("ucx body send failed: %s", self._send_error)
                self.conn.close()
            return  # an unfinished operation may still read the gather buffer: never reuse it
        if gathered is not None and len(self._gather_free) < self.MAX_GATHER_BUFFERS:
            self._gather_free.append(gathered)

    async def send_truncated(self, header: FrameHeader, body: memoryview) -> None:
        """Fault injection: half a header, then end the stream."""
        await self.conn.write(header.pack()[: HEADER_BYTES // 2])
        self.conn.write_eof()

    async def shutdown(self, timeout_s: float) -> None:
        if self._sends:
            await asyncio.wait(set(self._sends), timeout=timeout_s)
        await super().shutdown(timeout_s)

    def close(self) -> None:
        super().close()
        self._orphans.park(list(self._sends))  # the endpoint abort below makes UCX fail them
        self._orphans.seal()
        if not self._endpoint.closed:
            self._endpoint.abort()


class UcxRecvLink(StreamRecvLink):
    """Receiver end: a data body arrives as the tag message matching its header.

    The tag receive is posted when the consumer reads the body (``read_data``), after it has
    admitted the frame: straight into the destination when that is one contiguous view (pages
    adjacent in memory), then checksummed there in one read pass (no staging copy); otherwise
    into a buffer from a small free list, then checksummed while copied into the targets.
    UCX holds a message that arrives before its receive is posted (a large one, rendezvous,
    moves once the receive is posted), so nothing lands in memory the receiver has not given
    to it, and only after the frame was admitted. Receives are posted on this link's own
    endpoint back to the sender, so closing the link (or the sender's death) cancels one still
    pending: none waits forever on a message that will never come. A receive into the
    destination that does not complete aborts the endpoint before the failure is reported, so
    UCX writes no more into memory the caller may reuse.
    """

    MAX_FREE_BUFFERS = 4

    def __init__(self, conn: FrameConnection, endpoint: Any, tag_prefix: int, config: TransferConfig):
        super().__init__(conn)
        self._endpoint = endpoint
        self._tag_prefix = tag_prefix
        self._config = config
        self._staged: dict[int, np.ndarray] = {}  # seq -> the buffer its body was received into
        self._free: list[np.ndarray] = []
        self._orphans = Orphans(f"ucx receiver link (tag prefix {tag_prefix})")

    def _has_ucx_body(self, frame: Frame) -> bool:
        header = frame.header
        return frame.inline is None and header.kind.is_data and 0 < header.body_bytes <= self._config.max_frame_bytes

    def lands_apart(self, frame: Frame) -> bool:
        return self._has_ucx_body(frame)  # its body is a tag message, not on the control stream

    def _take(self, nbytes: int) -> np.ndarray:
        for i, buffer in enumerate(self._free):
            if buffer.nbytes >= nbytes:
                return self._free.pop(i)
        return np.empty(nbytes, dtype=np.uint8)

    async def read_data(self, frame: Frame, targets: list | None) -> tuple[memoryview, int, int]:
        """The body's tag message, received into the single target and checksummed there, or
        received into a buffer of the link's and checksummed while copied into ``targets``."""
        header = frame.header
        if not self._has_ucx_body(frame):
            if header.kind.is_data and header.body_bytes > self._config.max_frame_bytes:
                raise FrameError(f"{header.describe()}: {header.body_bytes} bytes exceed max_frame_bytes")
            return await super().read_data(frame, targets)
        what = f"body of {header.describe()}"
        if targets is not None and len(targets) == 1:
            destination = targets[0]
            try:
                await self._receive(destination, header.seq, what)
            except ConnectionError:
                if not self._endpoint.closed:
                    self._endpoint.abort()  # cancels the receive: nothing more lands in the destination
                raise
            return memoryview(b""), checksum_of(header.checksum_algo, [memoryview(destination)]), header.body_checksum
        buffer = self._take(header.body_bytes)
        await self._receive(buffer[: header.body_bytes], header.seq, what)
        self._staged[header.seq] = buffer  # its receive completed: reusable once released
        return land(header, buffer[: header.body_bytes], targets)

    async def _receive(self, buffer, seq: int, what: str) -> None:
        recv = functools.partial(self._endpoint.recv, buffer, tag=_tag(self._tag_prefix, seq), force_tag=True)
        await _race_close(recv, self.conn, self._config.deadline_s, what, self._orphans)

    def release(self, frame: Frame) -> None:
        super().release(frame)
        buffer = self._staged.pop(frame.header.seq, None) if frame.header.kind.is_data else None
        # Only buffers whose receive completed are listed: one still pending (parked by
        # ``_race_close``, the link then failed) could still be written, so it is never reused.
        if buffer is not None and len(self._free) < self.MAX_FREE_BUFFERS:
            self._free.append(buffer)

    def close(self) -> None:
        self._orphans.seal()
        self._staged.clear()
        if not self._endpoint.closed:
            self._endpoint.abort()  # cancels a receive still posted on it
        super().close()


class UcxBackend:
    scheme = "ucx"

    async def listen(self, config: TransferConfig, on_link: Callable[[RecvLink], Awaitable[None]]) -> StreamListener:
        ensure_ucx(config)
        ucxx.continuous_ucx_progress()
        worker_address = bytes(ucxx.get_worker_address())
        tasks: set[asyncio.Task] = set()

        async def make_link(conn: FrameConnection) -> RecvLink:
            """HELLO both ways: ours names our worker and the link's tag prefix, the sender's
            its worker, to which the link opens the endpoint its receives are posted on."""
            prefix = next(_tag_prefixes)
            payload = _HELLO.pack(prefix) + worker_address
            await conn.write(control_header(Kind.HELLO, "", payload=payload).pack(), payload)
            try:
                async with asyncio.timeout(config.connect_timeout_s):
                    sender_worker = await _read_hello(conn)
                    endpoint = await ucxx.create_endpoint_from_worker_address(
                        ucxx.get_ucx_address_from_buffer(sender_worker)
                    )
            except UCXError as exc:
                raise TransferError(f"ucx handshake failed: {exc!r}") from exc
            return UcxRecvLink(conn, endpoint, prefix, config)

        factory = serve_factory(config, self.scheme, make_link, on_link, tasks)
        server = await asyncio.get_running_loop().create_server(factory, config.bind_host, 0)
        host, port = server.sockets[0].getsockname()[:2]
        return StreamListener(str(Address("ucx", host=config.advertise_host or host, port=port)), server, tasks)

    async def connect(self, address: Address, config: TransferConfig) -> UcxSendLink:
        ensure_ucx(config)
        conn = await open_tcp(address, config)
        try:
            async with asyncio.timeout(config.connect_timeout_s):
                payload = await _read_hello(conn)
                (prefix,) = _HELLO.unpack_from(payload)
                worker = ucxx.get_ucx_address_from_buffer(payload[_HELLO.size :])
                endpoint = await ucxx.create_endpoint_from_worker_address(worker)
                own = bytes(ucxx.get_worker_address())
                await conn.write(control_header(Kind.HELLO, "", payload=own).pack(), own)
        except (TimeoutError, UCXError, FrameError, ConnectionError) as exc:
            conn.close()
            raise TransferError(f"ucx handshake with {address} failed: {exc!r}") from exc
        return UcxSendLink(conn, endpoint, prefix, config)


async def _read_hello(conn: FrameConnection) -> bytes:
    """The body of the next frame, which must be a HELLO; FrameError otherwise."""
    hello = await conn.next_frame()
    if isinstance(hello, LinkClosed) or hello.header.kind != Kind.HELLO or hello.inline is None:
        raise FrameError(f"ucx handshake: expected HELLO, got {hello}")
    payload = bytes(hello.inline)
    conn.release()
    return payload
