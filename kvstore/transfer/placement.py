"""Direct placement: where each chunk of one request lands in the receiver's shareable memory,
so a same-host sender can write a chunk straight into the destination (the only copy) and the
receiver can verify it in place. Frozen values, their wire form and segment arithmetic; no I/O.

A ``PagePlacement`` names byte ranges of ``Region``s, shared-memory files of the receiver (its fd
number, inode and size; the sender opens ``/proc/<receiver pid>/fd/<fd>`` and checks the inode)::

    MLA rows of layer L, token t (B = rows_per_page):
        offset = layer_offset[L] + page_ids[t // B] * page_stride + (t % B) * row_bytes
        tokens [t0, t1) split at page boundaries; pages adjacent in memory merge into one segment
    KDA_STATE / KDA_CONV of layer L: one flat range (region, offset, nbytes)

Both ends compute a frame's segments from (kind, layer, t0, t1) with ``segments``; the receiver
from its own placement, never from anything the sender claims. ``LocalPlacement`` adds the
receiver's byte views of its regions.

Wire form (little-endian): ``<4sHHH`` magic, #regions, #layer offsets, #flats; per region
``<qqq`` (fd, inode, nbytes); ``<qqqqq`` rows (region or -1, rows_per_page, row_bytes,
page_stride, #pages); per layer offset ``<qq`` (layer, offset); per flat ``<Biqqq`` (kind,
layer, region, offset, nbytes); then the page ids as int64.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvstore.transfer.frames import FrameError, Kind

_MAGIC = b"TKP1"
_HEAD = struct.Struct("<4sHHH")
_REGION = struct.Struct("<qqq")
_ROWS = struct.Struct("<qqqqq")
_OFFSET = struct.Struct("<qq")
_FLAT = struct.Struct("<Biqqq")  # kind, layer, region, offset, nbytes
MAX_PLACEMENT_BYTES = 1 << 20
_NUMPY_FROM_PAGES = 16  # chunks spanning more pages are split with numpy

Segment = tuple[int, int, int]
"""(region index, byte offset in the region, nbytes)."""


@dataclass(frozen=True)
class Region:
    """A receiver shared-memory file: fd number in the receiver process, inode, size in bytes."""

    fd: int
    inode: int
    nbytes: int


@dataclass(frozen=True)
class RowPlacement:
    """Where MLA rows land: paged, ``rows_per_page`` rows of ``row_bytes`` per page."""

    region: int
    layer_offsets: tuple[tuple[int, int], ...]  # (layer, byte offset of page 0 row 0)
    page_ids: tuple[int, ...]
    rows_per_page: int
    row_bytes: int
    page_stride: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_offset_of", dict(self.layer_offsets))  # looked up per frame

    def segments(self, layer: int, token_start: int, token_end: int) -> list[Segment] | None:
        """Byte ranges of tokens [token_start, token_end) of ``layer``, merged; None if outside."""
        base = self._offset_of.get(layer)
        rpp = self.rows_per_page
        if base is None or not 0 <= token_start < token_end <= len(self.page_ids) * rpp:
            return None
        first, last = token_start // rpp, (token_end - 1) // rpp
        if last - first < _NUMPY_FROM_PAGES:
            return self._few_segments(base, token_start, token_end, first, last)
        pages = np.asarray(self.page_ids[first : last + 1], dtype=np.int64)
        starts = base + pages * self.page_stride
        lengths = np.full(len(pages), rpp * self.row_bytes, dtype=np.int64)
        starts[0] += (token_start - first * rpp) * self.row_bytes
        lengths[0] -= (token_start - first * rpp) * self.row_bytes
        lengths[-1] -= ((last + 1) * rpp - token_end) * self.row_bytes
        # Merge runs where one segment ends exactly where the next begins (consecutive pages).
        breaks = np.flatnonzero(starts[1:] != starts[:-1] + lengths[:-1]) + 1
        run_starts = np.concatenate(([0], breaks))
        run_ends = np.concatenate((breaks, [len(pages)]))
        ends = starts + lengths
        return [
            (self.region, int(starts[a]), int(ends[b - 1] - starts[a]))
            for a, b in zip(run_starts.tolist(), run_ends.tolist(), strict=True)
        ]

    def _few_segments(self, base: int, token_start: int, token_end: int, first: int, last: int) -> list[Segment]:
        """``segments`` for a chunk within a few pages, without numpy's per-call overhead."""
        rpp, row_bytes = self.rows_per_page, self.row_bytes
        out: list[Segment] = []
        for index in range(first, last + 1):
            lo, hi = max(token_start, index * rpp), min(token_end, (index + 1) * rpp)
            start = base + self.page_ids[index] * self.page_stride + (lo - index * rpp) * row_bytes
            nbytes = (hi - lo) * row_bytes
            if out and out[-1][1] + out[-1][2] == start:
                out[-1] = (self.region, out[-1][1], out[-1][2] + nbytes)
            else:
                out.append((self.region, start, nbytes))
        return out


@dataclass(frozen=True)
class FlatPlacement:
    """Where one whole-tensor unit lands (a KDA layer's state or conv window)."""

    kind: Kind
    layer: int
    region: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PagePlacement:
    """Every destination of one request that can be written directly; see the module docstring."""

    regions: tuple[Region, ...]
    rows: RowPlacement | None = None
    flats: tuple[FlatPlacement, ...] = ()

    def segments(self, kind: Kind, layer: int, token_start: int, token_end: int) -> list[Segment] | None:
        """The byte ranges a chunk occupies, in body order; None when it has no direct destination."""
        if kind == Kind.MLA_ROWS:
            return None if self.rows is None else self.rows.segments(layer, token_start, token_end)
        for flat in self.flats:
            if flat.kind == kind and flat.layer == layer:
                return [(flat.region, flat.offset, flat.nbytes)]
        return None

    def check(self) -> None:
        """Raise ``FrameError`` unless every range lies inside its region (a sender's safety check)."""
        sizes = [r.nbytes for r in self.regions]

        def inside(region: int, offset: int, nbytes: int) -> bool:
            return 0 <= region < len(sizes) and offset >= 0 and nbytes >= 0 and offset + nbytes <= sizes[region]

        rows = self.rows
        if rows is not None:
            span = (max(rows.page_ids, default=0) + 1) * rows.page_stride
            if rows.rows_per_page <= 0 or rows.row_bytes <= 0 or rows.page_stride < rows.rows_per_page * rows.row_bytes:
                raise FrameError(f"placement rows are inconsistent: {rows.rows_per_page} x {rows.row_bytes} bytes")
            if min(rows.page_ids, default=0) < 0:
                raise FrameError("placement has a negative page id")
            if not all(inside(rows.region, off, span) for _, off in rows.layer_offsets):
                raise FrameError("placement rows reach beyond their region")
        if not all(inside(f.region, f.offset, f.nbytes) for f in self.flats):
            raise FrameError("placement flat range beyond its region")

    def pack(self) -> bytes:
        rows = self.rows
        parts = [_HEAD.pack(_MAGIC, len(self.regions), len(rows.layer_offsets) if rows else 0, len(self.flats))]
        parts += [_REGION.pack(r.fd, r.inode, r.nbytes) for r in self.regions]
        if rows is None:
            parts.append(_ROWS.pack(-1, 0, 0, 0, 0))
        else:
            fields = (rows.region, rows.rows_per_page, rows.row_bytes, rows.page_stride, len(rows.page_ids))
            parts.append(_ROWS.pack(*fields))
            parts += [_OFFSET.pack(layer, off) for layer, off in rows.layer_offsets]
        parts += [_FLAT.pack(int(f.kind), f.layer, f.region, f.offset, f.nbytes) for f in self.flats]
        if rows is not None:
            parts.append(np.asarray(rows.page_ids, dtype="<i8").tobytes())
        return b"".join(parts)

    @classmethod
    def unpack(cls, payload: bytes) -> PagePlacement:
        """Parse a packed placement; ``FrameError`` on anything malformed."""
        try:
            return _unpack(memoryview(payload))
        except (struct.error, ValueError) as exc:
            raise FrameError(f"malformed placement: {exc}") from exc


def _unpack(view: memoryview) -> PagePlacement:
    if len(view) > MAX_PLACEMENT_BYTES:
        raise ValueError(f"{len(view)} bytes, limit {MAX_PLACEMENT_BYTES}")
    magic, num_regions, num_offsets, num_flats = _HEAD.unpack_from(view, 0)
    if magic != _MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    pos = _HEAD.size
    regions = []
    for _ in range(num_regions):
        regions.append(Region(*_REGION.unpack_from(view, pos)))
        pos += _REGION.size
    region, rpp, row_bytes, stride, num_pages = _ROWS.unpack_from(view, pos)
    pos += _ROWS.size
    offsets = []
    for _ in range(num_offsets):
        offsets.append(_OFFSET.unpack_from(view, pos))
        pos += _OFFSET.size
    flats = []
    for _ in range(num_flats):
        kind, layer, f_region, offset, nbytes = _FLAT.unpack_from(view, pos)
        flats.append(FlatPlacement(Kind(kind), layer, f_region, offset, nbytes))
        pos += _FLAT.size
    rows = None
    if region >= 0:
        if len(view) != pos + 8 * num_pages:
            raise ValueError(f"{len(view)} bytes, expected {pos + 8 * num_pages}")
        pages = tuple(np.frombuffer(view[pos:], dtype="<i8").tolist())
        rows = RowPlacement(region, tuple(offsets), pages, rpp, row_bytes, stride)
    elif len(view) != pos:
        raise ValueError(f"{len(view) - pos} trailing bytes")
    placement = PagePlacement(tuple(regions), rows, tuple(flats))
    placement.check()
    return placement


@dataclass(frozen=True)
class LocalPlacement:
    """The receiver's side of a placement: the placement plus a byte view of each region."""

    placement: PagePlacement
    views: tuple[memoryview, ...]

    def views_of(self, segments: list[Segment]) -> list[memoryview]:
        return [self.views[region][offset : offset + nbytes] for region, offset, nbytes in segments]
