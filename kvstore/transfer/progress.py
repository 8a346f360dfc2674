"""One request's receive progress and the rules a chunk must meet to fit its destination.

``TransferProgress`` is the mutable state the ``stream.RequestTable`` keeps per expected request (it
guards every instance with its condition); ``chunk_problem`` says why a chunk does not fit, and
``describe_missing`` what has not arrived. Pure functions over that state; no locks here.

Token coverage of an MLA layer is a sorted list of merged half-open intervals::

    expected   [token_start ..................................... token_end)
    received   [0, 64) [64, 128)           [192, 256)
    covered    [(0, 128), (192, 256)]      -> layer incomplete: [128, 192) missing

A chunk claims its place when it is admitted (``claim``), before its body lands, and the fit
rules read the claims: a receiver that admits the next frame while a body is still landing
(ucx, ``receiver``) cannot let two overlapping chunks in. What has landed and been verified
is counted apart (``mla_covered``, ``kda_parts``, ``blobs``); a claimed chunk that never
lands fails its request, so a claim is never given back.

Direct placement (shm): once the receiver hands a connection the request's placement, that
peer may write into the destination until it is *fenced* (its END, ABORT or REVOKED arrived, or
it is gone); until then a failed request's memory must not be reused (``fenced`` is False).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.transfer.base import Expected, Sink
from kvstore.transfer.frames import DType, FrameHeader, Kind
from kvstore.transfer.placement import LocalPlacement

KDA_PARTS = frozenset({Kind.KDA_STATE, Kind.KDA_CONV})


@dataclass
class TransferProgress:
    """Mutable state of one request; guarded by the owning table's condition."""

    request_id: str
    expected: Expected
    sink: Sink
    started_at: float
    deadline_at: float
    conn_id: int | None = None
    mla_covered: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    kda_parts: dict[int, set[Kind]] = field(default_factory=dict)
    blobs: set[int] = field(default_factory=set)
    done_layers: set[int] = field(default_factory=set)
    # Admitted chunks, landed or not (``claim``); the fit rules check these.
    claimed_rows: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    claimed_parts: dict[int, set[Kind]] = field(default_factory=dict)
    claimed_blobs: set[int] = field(default_factory=set)
    sender_units: int | None = None
    error: str | None = None
    complete: bool = False
    num_frames: int = 0
    num_bytes: int = 0
    placement: LocalPlacement | None = None  # handed to connection ``conn_id`` for direct writes
    fenced: bool = True  # False while a peer holding the placement may still write
    landing: int = 0  # chunks admitted that the receiver is writing into the sink (until ``landed``)

    @property
    def all_chunks_in(self) -> bool:
        return self.done_layers == self.expected.layers and len(self.blobs) == self.expected.num_blobs


def chunk_problem(expected: Expected, progress: TransferProgress, header: FrameHeader) -> str | None:
    """Why ``header``'s chunk does not fit the destination, or None when it does."""
    if header.kind == Kind.MLA_ROWS:
        return _mla_problem(expected, progress, header)
    if header.kind in KDA_PARTS:
        return _kda_problem(expected, progress, header)
    if header.kind == Kind.BLOB:
        return _blob_problem(expected, progress, header)
    return f"{header.kind.name} is not a data kind"


def _mla_problem(expected: Expected, progress: TransferProgress, header: FrameHeader) -> str | None:
    layer, t0, t1 = header.layer, header.token_start, header.token_end
    if layer not in expected.mla_layers:
        return f"layer {layer} is not an expected MLA layer {sorted(expected.mla_layers)}"
    if not expected.token_start <= t0 < t1 <= expected.token_end:
        return f"tokens [{t0}, {t1}) outside the expected range [{expected.token_start}, {expected.token_end})"
    want_shape = (t1 - t0, *expected.mla_row_shape)
    if header.shape != want_shape or header.dtype != expected.mla_dtype:
        return (
            f"chunk is {header.dtype.name.lower()} {header.shape}, destination expects "
            f"{expected.mla_dtype.name.lower()} {want_shape}"
        )
    overlapping = [(a, b) for a, b in progress.claimed_rows.get(layer, ()) if a < t1 and t0 < b]
    if overlapping:
        return f"tokens [{t0}, {t1}) of layer {layer} overlap tokens already received {overlapping}"
    return None


def _kda_problem(expected: Expected, progress: TransferProgress, header: FrameHeader) -> str | None:
    if header.layer not in expected.kda_layers:
        return f"layer {header.layer} is not an expected KDA layer {sorted(expected.kda_layers)}"
    want_shape = expected.kda_state_shape if header.kind == Kind.KDA_STATE else expected.kda_conv_shape
    if header.shape != tuple(want_shape) or header.dtype != expected.kda_dtype:
        return (
            f"{header.kind.name} is {header.dtype.name.lower()} {header.shape}, destination expects "
            f"{expected.kda_dtype.name.lower()} {tuple(want_shape)}"
        )
    if header.kind in progress.claimed_parts.get(header.layer, ()):
        return f"duplicate {header.kind.name} for layer {header.layer}"
    return None


def _blob_problem(expected: Expected, progress: TransferProgress, header: FrameHeader) -> str | None:
    if not 0 <= header.layer < expected.num_blobs:
        return f"blob index {header.layer} outside [0, {expected.num_blobs})"
    if header.dtype != DType.UINT8 or header.body_bytes > expected.max_blob_bytes:
        kind = header.dtype.name.lower()
        return f"blob is {kind} of {header.body_bytes} bytes; limit {expected.max_blob_bytes} uint8"
    if header.layer in progress.claimed_blobs:
        return f"duplicate blob {header.layer}"
    return None


def claim(progress: TransferProgress, header: FrameHeader) -> None:
    """Mark the place of an admitted chunk (one ``chunk_problem`` found none for) as taken."""
    if header.kind == Kind.MLA_ROWS:
        rows = progress.claimed_rows.setdefault(header.layer, [])
        t0, t1 = header.token_start, header.token_end
        if rows and rows[-1][1] == t0:  # the usual order: right after the last chunk
            rows[-1] = (rows[-1][0], t1)
        else:
            progress.claimed_rows[header.layer] = merge_interval(rows, (t0, t1))
    elif header.kind in KDA_PARTS:
        progress.claimed_parts.setdefault(header.layer, set()).add(header.kind)
    else:
        progress.claimed_blobs.add(header.layer)


def merge_interval(intervals: list[tuple[int, int]], new: tuple[int, int]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted([*intervals, new]):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def describe_missing(progress: TransferProgress, limit: int = 4) -> str:
    """What has not arrived yet, e.g. ``layer 3 tokens [(0, 64)] of [0, 128); blob 1``."""
    exp = progress.expected
    items: list[str] = []
    for layer in sorted(exp.mla_layers):
        if layer not in progress.done_layers:
            covered = progress.mla_covered.get(layer, [])
            items.append(f"layer {layer} has tokens {covered} of [{exp.token_start}, {exp.token_end})")
    for layer in sorted(exp.kda_layers):
        missing = KDA_PARTS - progress.kda_parts.get(layer, set())
        if missing:
            items.append(f"layer {layer} lacks {sorted(k.name for k in missing)}")
    items += [f"blob {i} missing" for i in range(exp.num_blobs) if i not in progress.blobs]
    if progress.all_chunks_in and progress.sender_units is None:
        items.append("all chunks in but no END from the sender")
    extra = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return "; ".join(items[:limit]) + extra
