"""What a sender queues: the byte view of a chunk (``as_body``), the queued frame
(``Outgoing``), and the coalescing of queued row chunks that continue each other into one frame.

Coalescing: a prefill that pushes one layer in many small chunks (or a benchmark at 64 KiB)
would pay the per-frame cost (header, admission, verification, ACK) for each; queued chunks of
the same request and layer with adjacent token ranges and the same row shape become one frame
of up to ``max_frame_bytes`` whose body is their views in order (no copy)::

    queued   rows [0, 64) L3 | rows [64, 128) L3 | rows [128, 192) L3 | KDA_STATE L0
    written  rows [0, 192) L3, seq of the last, 3 parts          | KDA_STATE L0

Pure functions and values; the sender calls ``coalesce`` under its lock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.transfer.frames import REQUEST_ID_MAX_BYTES, DType, FrameHeader, Kind


def as_body(tensor: Any) -> tuple[memoryview, DType, tuple[int, ...]]:
    """A flat byte view of a contiguous CPU tensor, numpy array or bytes-like; no copy."""
    if isinstance(tensor, bytes | bytearray | memoryview):
        view = memoryview(tensor).cast("B")
        return view, DType.UINT8, (view.nbytes,)
    if not isinstance(tensor, np.ndarray):  # a torch.Tensor: torch is already imported by its owner
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"tensor must be contiguous on cpu, got {tensor.device} contiguous={tensor.is_contiguous()}"
            )
        dtype = DType.from_name(tensor.dtype)
        import torch

        carrier = tensor.detach().view(torch.int16) if dtype == DType.BFLOAT16 else tensor.detach()
        array, shape = carrier.numpy(), tuple(tensor.shape)
    else:
        if not tensor.flags.c_contiguous:
            raise ValueError("numpy array must be C-contiguous")
        array, shape, dtype = tensor, tensor.shape, DType.from_name(tensor.dtype)
    return memoryview(array.reshape(-1).view(np.uint8)), dtype, shape


@dataclass(slots=True)
class Outgoing:
    """A queued frame; ``seq`` is set under the sender's lock just before it is queued."""

    header: FrameHeader  # without seq and body checksum
    parts: tuple[memoryview, ...] | None = None  # data frames: the body, in order
    payload: bytes | None = None  # control frames
    seq: int = 0


def coalesce(
    item: Outgoing, outbox: collections.deque[Outgoing | None], max_frame_bytes: int, faulty: tuple[int | None, ...]
) -> Outgoing:
    """``item`` merged with the frames at the head of ``outbox`` that continue its rows (they
    are taken out of ``outbox``). The merged frame carries the last seq: ACKs are cumulative, so
    acknowledging it acknowledges them all. Frames whose seq is in ``faulty`` (fault injection)
    are never merged."""
    if item.parts is None or item.header.kind != Kind.MLA_ROWS:
        return item
    header, parts, seq = item.header, list(item.parts), item.seq
    # The merged frame's growing fields, put into one header at the end (not one per chunk).
    token_end, num_rows, body_bytes = header.token_end, header.shape[0], header.body_bytes
    while outbox and seq not in faulty:
        nxt = outbox[0]
        if nxt is None or nxt.seq in faulty or not _continues(header, token_end, body_bytes, nxt.header,
                                                               max_frame_bytes):
            break
        outbox.popleft()
        h = nxt.header
        token_end, num_rows, body_bytes = h.token_end, num_rows + h.shape[0], body_bytes + h.body_bytes
        parts += nxt.parts
        seq = nxt.seq
    if seq == item.seq:
        return item
    header = header._replace(token_end=token_end, shape=(num_rows, *header.shape[1:]), body_bytes=body_bytes)
    return Outgoing(header, tuple(parts), seq=seq)


def _continues(header: FrameHeader, token_end: int, body_bytes: int, nxt: FrameHeader, max_frame_bytes: int) -> bool:
    """Whether ``nxt`` carries the rows right after those of ``header`` (merged up to
    ``token_end``, ``body_bytes`` so far) and all of them fit one frame."""
    return (
        nxt.kind == Kind.MLA_ROWS
        and nxt.request_id == header.request_id
        and nxt.layer == header.layer
        and nxt.token_start == token_end
        and nxt.dtype == header.dtype
        and nxt.shape[1:] == header.shape[1:]
        and body_bytes + nxt.body_bytes <= max_frame_bytes
    )


def checked_id(request_id: str) -> str:
    if not request_id or len(request_id.encode()) > REQUEST_ID_MAX_BYTES:
        raise ValueError(f"request id must be 1..{REQUEST_ID_MAX_BYTES} utf-8 bytes, got {request_id!r}")
    return request_id
