"""The pending overlay: what this Conductor routed that the workers' heartbeats may not show
yet, and what finished since they were sent.

Without it, requests arriving within one heartbeat interval all see the same stale load and
herd onto the same worker. The Conductor records a request here when it routes it
(``route``), marks its prefill and decode progress, and forgets it at the end; finished
records are kept for ``finished_ttl_s`` so a heartbeat sent before they finished is not
trusted about them (``conductor.snapshot`` merges the two).

Records are grouped by worker, and each worker's group is frozen (a tuple; finished records a
dict by request id) only when it changed since the last ``view()``, and a view's maps by worker
are those of the last view where no group in them changed, so a view costs the groups that
changed (every token a stream receives changes its decode worker's) and a copy of their maps.
Each view is numbered (with its overlay's number) and names the workers whose groups changed
since the one before it (``PendingView.overlay``, ``serial``, ``changed``), so a snapshot can
start from the last one's views.
Thread-safe (one lock); time is given by the caller (the Conductor's injected clock).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from clusterstate.workers import PrefillJobLoad
from conductor.decode_batch import DecodeJobs
from conductor.routing import DecodeJob, RouteDecision, RouteRequest, decode_need_pages

# Groups frozen from another group's records (thawed with it).
_DERIVED = {"on_decode": "decode_jobs", "in_prefill": "prefill_jobs"}
_OVERLAYS = itertools.count(1)  # numbers each PendingWork: whose view a PendingView is


@dataclass(frozen=True)
class PendingRequest:
    request_id: str
    prefill_worker: str
    decode_worker: str
    num_new_tokens: int
    num_reused_tokens: int
    num_prompt_tokens: int
    max_tokens: int
    num_pages: int
    routed_at_s: float
    ready_at_s: float  # predicted moment it joins the decode batch (routing time + predicted TTFT)
    prefill_done_at_s: float = math.inf
    decode_started_at_s: float = math.inf
    num_generated: int = 0
    finished_at_s: float = math.inf

    @property
    def in_prefill(self) -> bool:
        return self.prefill_done_at_s == math.inf and self.finished_at_s == math.inf

    @property
    def decoding(self) -> bool:
        return self.decode_started_at_s < math.inf

    def prefill_job(self) -> PrefillJobLoad:
        """This request as a queued job of its prefill worker (not started, as far as known)."""
        return PrefillJobLoad(self.request_id, self.num_new_tokens, self.num_reused_tokens)

    def decode_job(self) -> DecodeJob:
        """This request as its decode worker's job, built like ``_with`` builds records: a
        view rebuilds one per streaming request of every decode worker whose streams moved."""
        job = object.__new__(DecodeJob)
        job.__dict__.update(request_id=self.request_id, num_tokens=self.num_prompt_tokens + self.num_generated,
                            num_remaining_tokens=max(0, self.max_tokens - self.num_generated),
                            decoding=self.decoding, ready_at_s=self.ready_at_s)
        return job


def _with(record: PendingRequest, **changes: float | int) -> PendingRequest:
    """``dataclasses.replace`` without its per-call introspection (this runs per decode chunk)."""
    new = object.__new__(PendingRequest)
    new.__dict__.update(record.__dict__, **changes)
    return new


@dataclass(frozen=True)
class PendingView:
    """A frozen copy for one snapshot, by worker id (absent: nothing there)."""

    in_prefill: Mapping[str, tuple[PendingRequest, ...]] = field(default_factory=dict)  # by prefill worker
    prefill_jobs: Mapping[str, tuple[PrefillJobLoad, ...]] = field(default_factory=dict)  # the same, as jobs
    left_prefill: Mapping[str, frozenset[str]] = field(default_factory=dict)  # prefill done or request ended
    on_decode: Mapping[str, tuple[PendingRequest, ...]] = field(default_factory=dict)  # live, by decode worker
    decode_jobs: Mapping[str, tuple[DecodeJob, ...]] = field(default_factory=dict)  # the same, as DecodeJobs
    # Finished lately, by decode worker and request id (a snapshot looks up the few requests a
    # heartbeat lists: there may be thousands, every request of the last ``finished_ttl_s``).
    ended_on_decode: Mapping[str, Mapping[str, PendingRequest]] = field(default_factory=dict)
    # By prefill worker: when this Conductor last saw one of its prefills end there (its engine
    # was free to start the next one then).
    prefill_free_at_s: Mapping[str, float] = field(default_factory=dict)
    # The workers whose groups (or free moment) changed since the view numbered ``serial - 1``
    # of the same overlay (``overlay``: its number); None: not known (a snapshot memo then
    # checks every worker). Not part of what a view holds: two views of the same records are equal.
    overlay: int = field(default=0, compare=False)
    serial: int = field(default=0, compare=False)
    changed: frozenset[str] | None = field(default=None, compare=False)


class PendingWork:
    def __init__(self, finished_ttl_s: float = 6.0):
        self.finished_ttl_s = finished_ttl_s
        self._live: dict[str, PendingRequest] = {}
        self._ended: deque[PendingRequest] = deque()  # in finishing order
        self._groups: dict[str, dict[str, dict[str, PendingRequest]]] = {
            name: defaultdict(dict) for name in ("in_prefill", "on_decode", "ended_on_decode")}
        self._left: dict[str, dict[str, int]] = defaultdict(dict)  # prefill worker -> id -> references
        self._free_at: dict[str, float] = {}  # prefill worker -> when its last prefill seen here ended
        self._frozen: dict[tuple[str, str], object] = {}
        # By group: the map the last view handed out and the workers whose group changed since.
        # A view hands the same map out again while none changed, else a copy with theirs
        # replaced (handed-out maps are never changed), so it costs the changed groups only.
        self._published: dict[str, dict[str, object]] = {}
        self._changed: dict[str, set[str]] = defaultdict(set)
        self._overlay = next(_OVERLAYS)
        self._serial = 0  # views handed out
        self._touched: set[str] = set()  # workers with a group changed since the last view
        self._lock = threading.Lock()

    # ---- grouping (under the lock) ------------------------------------------------------------
    def _unfreeze(self, group: str, worker: str) -> None:
        self._frozen.pop((group, worker), None)
        self._changed[group].add(worker)
        self._touched.add(worker)

    def _thaw(self, group: str, worker: str) -> None:
        self._unfreeze(group, worker)
        derived = _DERIVED.get(group)
        if derived is not None:
            self._unfreeze(derived, worker)

    def _put(self, group: str, worker: str, record: PendingRequest) -> None:
        self._groups[group][worker][record.request_id] = record
        self._thaw(group, worker)

    def _drop(self, group: str, worker: str, request_id: str) -> None:
        if self._groups[group][worker].pop(request_id, None) is not None:
            self._thaw(group, worker)

    def _mark_left(self, worker: str, request_id: str, delta: int) -> None:
        refs = self._left[worker]
        refs[request_id] = refs.get(request_id, 0) + delta
        if refs[request_id] <= 0:
            del refs[request_id]
        self._unfreeze("left_prefill", worker)

    def _set(self, record: PendingRequest) -> None:
        self._live[record.request_id] = record
        self._put("on_decode", record.decode_worker, record)
        if record.in_prefill:
            self._put("in_prefill", record.prefill_worker, record)

    # ---- changes ------------------------------------------------------------------------------
    def route(self, request: RouteRequest, decision: RouteDecision, now_s: float) -> PendingRequest:
        """Record a routed request (its reuse plan fixes the new and reused token counts)."""
        reused = decision.reuse.num_blocks * request.block_size
        record = PendingRequest(
            request.request_id, decision.prefill_worker, decision.decode_worker,
            request.num_prompt_tokens - reused, reused, request.num_prompt_tokens, request.max_tokens,
            decode_need_pages(request), now_s, now_s + decision.predicted.ttft_s)
        self.add(record)
        return record

    def add(self, record: PendingRequest) -> None:
        """Record a request routed as ``record`` says (another replica's, or this one's)."""
        with self._lock:
            self._set(record)

    def prefill_done(self, request_id: str, now_s: float) -> None:
        with self._lock:
            record = self._live.get(request_id)
            if record is not None and record.in_prefill:
                self._drop("in_prefill", record.prefill_worker, request_id)
                self._mark_left(record.prefill_worker, request_id, +1)
                self._free_at[record.prefill_worker] = now_s
                self._set(_with(record, prefill_done_at_s=now_s, ready_at_s=now_s))

    def decode_started(self, request_id: str, now_s: float) -> None:
        with self._lock:
            record = self._live.get(request_id)
            if record is not None:
                self._set(_with(record, decode_started_at_s=now_s))

    def generated(self, request_id: str, num_tokens: int) -> None:
        with self._lock:
            record = self._live.get(request_id)
            if record is not None:
                self._set(_with(record, num_generated=num_tokens))

    def finish(self, request_id: str, now_s: float) -> bool:
        """The request ended (any way) or is routed again: its work leaves both workers.
        True when it was in the overlay."""
        with self._lock:
            record = self._live.pop(request_id, None)
            if record is not None:
                if record.in_prefill:
                    self._drop("in_prefill", record.prefill_worker, request_id)
                    self._mark_left(record.prefill_worker, request_id, +1)
                    self._free_at[record.prefill_worker] = now_s
                self._drop("on_decode", record.decode_worker, request_id)
                ended = _with(record, finished_at_s=now_s)
                self._ended.append(ended)
                self._put("ended_on_decode", ended.decode_worker, ended)
            while self._ended and now_s - self._ended[0].finished_at_s > self.finished_ttl_s:
                old = self._ended.popleft()
                self._mark_left(old.prefill_worker, old.request_id, -1)
                if self._groups["ended_on_decode"][old.decode_worker].get(old.request_id) is old:
                    self._drop("ended_on_decode", old.decode_worker, old.request_id)
            return record is not None

    # ---- reading --------------------------------------------------------------------------------
    def _frozen_group(self, group: str, worker: str):
        key = (group, worker)
        if key not in self._frozen:
            if group == "decode_jobs":
                value = DecodeJobs(r.decode_job() for r in self._groups["on_decode"][worker].values())
            elif group == "prefill_jobs":
                value = tuple(r.prefill_job() for r in self._groups["in_prefill"][worker].values())
            elif group == "left_prefill":
                value = frozenset(self._left[worker])
            elif group == "ended_on_decode":
                value = dict(self._groups[group][worker])
            else:
                value = tuple(self._groups[group][worker].values())
            self._frozen[key] = value
        return self._frozen[key]

    def _by_worker(self, group: str, source: Mapping[str, Mapping[str, object]]) -> dict[str, object]:
        """The frozen ``group`` of every worker with members in ``source`` (see ``_published``)."""
        published, changed = self._published.get(group), self._changed[group]
        if published is None:
            published = {w: self._frozen_group(group, w) for w, members in source.items() if members}
        elif changed:
            published = dict(published)
            for w in changed:
                if source.get(w):
                    published[w] = self._frozen_group(group, w)
                else:
                    published.pop(w, None)
        changed.clear()
        self._published[group] = published
        return published

    def view(self) -> PendingView:
        with self._lock:
            self._serial += 1
            changed, self._touched = frozenset(self._touched), set()
            return PendingView(
                in_prefill=self._by_worker("in_prefill", self._groups["in_prefill"]),
                prefill_jobs=self._by_worker("prefill_jobs", self._groups["in_prefill"]),
                left_prefill=self._by_worker("left_prefill", self._left),
                on_decode=self._by_worker("on_decode", self._groups["on_decode"]),
                decode_jobs=self._by_worker("decode_jobs", self._groups["on_decode"]),
                ended_on_decode=self._by_worker("ended_on_decode", self._groups["ended_on_decode"]),
                prefill_free_at_s=dict(self._free_at),
                overlay=self._overlay, serial=self._serial, changed=changed,
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)
