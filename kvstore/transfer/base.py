"""The transfer engine's interface values: config, errors, what a receiver expects, the sink it
writes into, results, peer addresses and backend choice, and the link protocols each backend
implements. Frozen values and protocols only; no I/O and no threads here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from kvstore.transfer.frames import ChecksumAlgo, DType, FrameHeader, Kind, default_checksum_algo

MIB = 1 << 20
SCHEMES = ("shm", "tcp", "ucx")
MIN_AUTH_KEY_BYTES = 16


class TransferError(RuntimeError):
    """A transfer failed: corruption, truncation, peer death, abort, rejection or deadline.

    The destination of a failed request must be treated as garbage; the caller retries or
    recomputes, never serves it.
    """

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class TransferConfig:
    """Limits of one sender or receiver. Sizes in bytes, times in seconds.

    ``deadline_s`` bounds every wait: a request not complete ``deadline_s`` after ``expect``
    fails on the receiver; ``send`` blocked by backpressure and ``finish`` waiting for the
    receiver fail after ``deadline_s``. ``max_inflight_bytes`` bounds body bytes a sender has
    handed over but the receiver has not yet consumed. ``fence_timeout_s`` bounds how long
    ``wait_complete``/``cancel`` of a failed request written directly over shm wait for the
    sender to confirm it stopped writing (see ``stream``).

    ``auth_key``: when non-empty, every connection is mutually authenticated before any
    other frame (HMAC-SHA256 challenge-response, ``auth``); a peer that fails, stalls past
    ``connect_timeout_s`` or sends anything else first is disconnected and nothing it sent
    reaches a sink. Both ends need the same key: a key on one side only fails the
    connection. Never printed (``repr=False``).

    ``encrypt``: tcp links are encrypted and authenticated after the handshake (AES-256-GCM,
    per-connection, per-direction keys derived from ``auth_key`` and the handshake's nonces;
    ``auth``, ``aead``); both ends need the same setting, or the connection fails naming it.
    shm links stay plaintext (their bodies never leave the host's memory), and ucx refuses it
    (its bodies travel as UCX messages this engine does not seal). The cluster sets it with
    ``--tls`` (the workers' ``TlsFiles.serves``).
    """

    deadline_s: float = 30.0
    connect_timeout_s: float = 5.0
    fence_timeout_s: float = 2.0  # how long a failed shm request waits for its sender to stop writing
    max_inflight_bytes: int = 128 * MIB
    max_frame_bytes: int = 32 * MIB
    bind_host: str = "127.0.0.1"
    advertise_host: str = ""  # the host put in listener addresses (default: the bound one)
    checksum: ChecksumAlgo = field(default_factory=default_checksum_algo)
    # UCX options for ucxx.init (without the UCX_ prefix); the default keeps UCX on loopback TCP,
    # in 256 KiB segments (8 KiB by default: a 16 MiB body took 2048 sends; about 15% less CPU
    # per byte measured on both ends). RDMA deployments pass their own (docs/architecture.md).
    ucx_options: tuple[tuple[str, str], ...] = (
        ("TLS", "tcp"), ("NET_DEVICES", "lo"), ("TCP_TX_SEG_SIZE", "256K"), ("TCP_RX_SEG_SIZE", "256K"),
    )
    auth_key: bytes = field(default=b"", repr=False)
    encrypt: bool = False

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(f"deadline_s {self.deadline_s} and connect_timeout_s {self.connect_timeout_s} must be > 0")
        if not 0 < self.max_frame_bytes <= self.max_inflight_bytes:
            raise ValueError(
                f"need 0 < max_frame_bytes ({self.max_frame_bytes}) <= max_inflight_bytes ({self.max_inflight_bytes})"
            )
        if self.auth_key and len(self.auth_key) < MIN_AUTH_KEY_BYTES:
            raise ValueError(f"auth_key has {len(self.auth_key)} bytes; a key needs at least {MIN_AUTH_KEY_BYTES}")
        if self.encrypt and not self.auth_key:
            raise ValueError("encrypt needs an auth_key: the link's keys come from the authenticated handshake")

    @property
    def shm_ring_bytes(self) -> int:
        """Ring size of one shm connection: the in-flight bound plus one frame of wrap-around slack."""
        return self.max_inflight_bytes + self.max_frame_bytes


@dataclass(frozen=True)
class FaultInjection:
    """Test-only faults a sender applies to the frame with the given sequence number."""

    corrupt_seq: int | None = None  # flip one body byte after checksumming
    truncate_seq: int | None = None  # send part of the frame, then close the connection


@dataclass(frozen=True)
class Expected:
    """What a receiver expects for one request; every chunk is checked against it.

    MLA layers must each be covered exactly once by row chunks over [token_start, token_end),
    each chunk shaped ``(num_tokens, *mla_row_shape)``. KDA layers need one KDA_STATE of
    ``kda_state_shape`` and one KDA_CONV of ``kda_conv_shape``. Blobs 0..num_blobs-1 need one
    BLOB each of at most ``max_blob_bytes``. Dtypes are names ("float32", "bfloat16") or torch
    or numpy dtypes.
    """

    mla_layers: tuple[int, ...] = ()
    token_start: int = 0
    token_end: int = 0
    mla_row_shape: tuple[int, ...] = ()
    mla_dtype: Any = "float32"
    kda_layers: tuple[int, ...] = ()
    kda_state_shape: tuple[int, ...] = ()
    kda_conv_shape: tuple[int, ...] = ()
    kda_dtype: Any = "float32"
    num_blobs: int = 0
    max_blob_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        object.__setattr__(self, "mla_dtype", DType.from_name(self.mla_dtype))
        object.__setattr__(self, "kda_dtype", DType.from_name(self.kda_dtype))
        if set(self.mla_layers) & set(self.kda_layers):
            raise ValueError(f"layers {set(self.mla_layers) & set(self.kda_layers)} are both MLA and KDA")
        if self.mla_layers and not self.token_start < self.token_end:
            raise ValueError(f"empty MLA token range [{self.token_start}, {self.token_end})")
        if not (self.mla_layers or self.kda_layers or self.num_blobs):
            raise ValueError("Expected names no layer and no blob")

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self.mla_layers) | frozenset(self.kda_layers)

    @property
    def num_units(self) -> int:
        """Layers plus blobs: what the sender's END must report."""
        return len(self.mla_layers) + len(self.kda_layers) + self.num_blobs


class Sink(Protocol):
    """Destination of one request's chunks.

    ``write`` runs on the receiver's I/O thread, only for chunks already verified (checksum,
    shape, dtype, token range), and must copy ``tensor`` before returning: the view is reused.
    Raise ``ValueError`` to reject a chunk; that fails the request.
    """

    def write(self, kind: Kind, layer: int, token_start: int, token_end: int, tensor: Any) -> None: ...


class ViewSink(Sink, Protocol):
    """A sink whose destination a stream backend can receive into (optional extension of ``Sink``).

    ``views(kind, layer, token_start, token_end)`` returns writable uint8 arrays, in body order,
    of exactly the chunk's bytes (or None: use ``write``), after the chunk was checked against
    ``Expected``; ValueError rejects it. The body lands there before its checksum is verified
    (as it arrives, piece by piece), and ``write`` is not called for it; a chunk that fails
    fails the request, whose destination then holds garbage. So, as for any sink, nothing may
    read the destination before ``wait_complete`` returns.
    """

    def views(self, kind: Kind, layer: int, token_start: int, token_end: int) -> list[Any] | None: ...


class DirectSink(Sink, Protocol):
    """A sink whose destination lies in shareable memory (optional extension of ``Sink``).

    ``placement`` returns a ``placement.LocalPlacement`` (or None: not shareable). A same-host
    (shm) sender then writes chunks straight into that memory; the receiver verifies each one
    there (checksum over the destination, shape and range against ``Expected``) before counting
    it, and ``write`` is not called for them. Until the request completes, its destination holds
    unverified bytes: nothing may read it before ``wait_complete`` returns, as for any sink.
    """

    def placement(self) -> Any: ...


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    num_frames: int
    num_bytes: int
    elapsed_s: float


@dataclass(frozen=True)
class SenderStats:
    frames_sent: int
    bytes_sent: int
    inflight_bytes: int
    inflight_high_water_bytes: int
    num_backpressure_waits: int  # sends that blocked because in-flight bytes were at the bound


@dataclass(frozen=True)
class Address:
    """A receiver endpoint: ``tcp://HOST:PORT``, ``ucx://HOST:PORT`` (TCP control port) or ``shm://NAME``."""

    scheme: str
    host: str = ""
    port: int = 0
    name: str = ""

    @classmethod
    def parse(cls, text: str) -> Address:
        parts = urlsplit(text)
        if parts.scheme not in SCHEMES:
            raise ValueError(f"address {text!r}: scheme must be one of {SCHEMES}")
        if parts.scheme == "shm":
            if not parts.netloc:
                raise ValueError(f"address {text!r}: shm needs a name, shm://NAME")
            return cls("shm", name=parts.netloc)
        if not parts.hostname or not parts.port:
            raise ValueError(f"address {text!r}: needs host and port, {parts.scheme}://HOST:PORT")
        return cls(parts.scheme, host=parts.hostname, port=parts.port)

    def __str__(self) -> str:
        if self.scheme == "shm":
            return f"shm://{self.name}"
        return f"{self.scheme}://{self.host}:{self.port}"


def pick_address(
    local_host: str, peer_host: str, offered: Sequence[str], remote_preference: Sequence[str] = ("tcp", "ucx")
) -> str:
    """Choose which of a receiver's ``offered`` addresses a sender should use.

    Same host: shm if offered. Otherwise the first scheme of ``remote_preference`` offered
    (tcp before ucx unless the deployment has an RDMA network and says so).
    """
    by_scheme = {Address.parse(a).scheme: a for a in offered}
    order = (("shm",) if local_host == peer_host else ()) + tuple(remote_preference)
    for scheme in order:
        if scheme in by_scheme:
            return by_scheme[scheme]
    raise ValueError(f"no usable address among {list(offered)} for {local_host} -> {peer_host}")


# ---- backend link protocols (implemented by tcp.py, shm.py, ucx.py) ----------------------------


class LinkClosed(Exception):
    """Delivered instead of a frame when a link's stream ends; ``reason`` says how."""

    def __init__(self, reason: str, partial: FrameHeader | None = None):
        super().__init__(reason)
        self.reason = reason
        self.partial = partial


@dataclass(frozen=True)
class Frame:
    """A received header and its inline body (a view valid until the frame is released)."""

    header: FrameHeader
    inline: memoryview | None


class SendLink(Protocol):
    """Sender end of one connection; all methods run on the I/O loop."""

    coalesces: bool  # send_data accepts a body of several parts (coalesced chunks)

    async def send_data(
        self, header: FrameHeader, parts: Sequence[memoryview], corrupt: bool = False, more: bool = False
    ) -> None:
        """Checksum and send one data frame whose body is ``parts`` in order (``corrupt``:
        test-only, damage it after checksumming; ``more``: another data frame is queued behind
        it, so the receiver has work while this one is sent)."""

    async def flush(self) -> None:
        """Write out frames the link batches; called whenever the sender's queue runs dry."""

    async def send_control(self, header: FrameHeader, payload: bytes) -> None: ...
    async def send_truncated(self, header: FrameHeader, body: memoryview) -> None: ...
    async def shutdown(self, timeout_s: float) -> None: ...
    async def next_reply(self) -> Frame | LinkClosed: ...
    def on_ack(self, seq: int) -> None: ...
    def close(self) -> None: ...


class RecvLink(Protocol):
    """Receiver end of one connection; all methods run on the I/O loop. ``supports_placement``:
    the peer can write into a ``DirectSink``'s memory (shm); ``closed_by_peer``: the stream
    ended from the peer's side (EOF, reset, death), not by our close."""

    supports_placement: bool
    closed_by_peer: bool

    async def next_frame(self) -> Frame | LinkClosed: ...
    def lands_apart(self, frame: Frame) -> bool:
        """The frame's body travels apart from the frame stream (ucx), so the next frame can be
        read while it lands (``landing``)."""

    async def read_body(self, frame: Frame) -> memoryview:
        """The inline body of a control frame (ABORT's reason)."""

    async def read_data(self, frame: Frame, targets: list[Any] | None) -> tuple[memoryview, int, int]:
        """Receive a data frame's body into ``targets`` (writable uint8 arrays in body order) or,
        with None, into a buffer of the link's, valid until ``release``; returns that buffer
        (empty for targets), the body's checksum under the header's algorithm as received, and
        the checksum its sender gave (in the header, or trailing the body)."""

    def release(self, frame: Frame) -> None: ...
    def ack(self, seq: int) -> None: ...
    def reply(self, header: FrameHeader, payload: bytes = b"") -> None: ...
    def close(self) -> None: ...


class Listener(Protocol):
    address: str

    def close(self) -> None: ...


class Backend(Protocol):
    scheme: str

    async def listen(self, config: TransferConfig, on_link: Callable[[RecvLink], Awaitable[None]]) -> Listener: ...
    async def connect(self, address: Address, config: TransferConfig) -> SendLink: ...
