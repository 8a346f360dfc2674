"""The other Conductor replicas' work, as this replica's pending overlay counts it.

Each replica routes on its own, so a burst split over replicas would herd onto the same
workers if each counted only its own decisions. Every transition of a replica's core is
shared through the cluster's log (``ConductorCore(share=...)``, as ``PendingEntry``); the
others apply it here to the same ``PendingWork`` their own decisions are in (a request id is
unique per replica, so records never collide). A replica that stops beating (its
``ReplicaEntry``, once a second) for ``REPLICA_TTL_S`` is gone: its records leave the
overlay, as its streams did when it died. Also kept: the live client request ids of the
others (keyed hashes), so a duplicate id of one tenant is refused on any replica.
Thread-safe (one lock; ``PendingWork`` has its own).
"""

from __future__ import annotations

import threading

from conductor.pending import PendingRequest, PendingWork
from proto import state_pb2 as spb

REPLICA_TTL_S = 3.0


def routed_entry(record: PendingRequest, live_key: bytes = b"") -> spb.PendingEntry:
    """A routed request as the other replicas' overlays take it."""
    return spb.PendingEntry(
        kind=spb.PENDING_KIND_ROUTED, request_id=record.request_id, prefill_worker=record.prefill_worker,
        decode_worker=record.decode_worker, num_new_tokens=record.num_new_tokens,
        num_reused_tokens=record.num_reused_tokens, num_prompt_tokens=record.num_prompt_tokens,
        max_tokens=record.max_tokens, num_pages=record.num_pages,
        ready_in_s=max(0.0, record.ready_at_s - record.routed_at_s), live_key=live_key)


class RemoteReplicas:
    def __init__(self, pending: PendingWork):
        self.pending = pending
        self._lock = threading.Lock()
        self._last_seen_s: dict[str, float] = {}  # replica -> this replica's monotonic time
        self._requests: dict[str, dict[str, bytes]] = {}  # replica -> request id -> live key
        self._live_keys: dict[bytes, str] = {}

    def apply(self, entry: spb.StateEntry, now_s: float, wall_now_s: float) -> None:
        """One entry another replica shared; ``now_s``: the overlay's clock, ``wall_now_s``: the
        wall clock the entry's time is on."""
        origin = entry.origin
        with self._lock:
            self._last_seen_s[origin] = now_s
        if entry.WhichOneof("change") != "pending":
            return
        p = entry.pending
        if p.kind == spb.PENDING_KIND_ROUTED:
            routed_at_s = now_s - max(0.0, wall_now_s - entry.wall_s)
            self.pending.add(PendingRequest(
                p.request_id, p.prefill_worker, p.decode_worker, p.num_new_tokens, p.num_reused_tokens,
                p.num_prompt_tokens, p.max_tokens, p.num_pages, routed_at_s, routed_at_s + p.ready_in_s))
            with self._lock:
                self._requests.setdefault(origin, {})[p.request_id] = p.live_key
                if p.live_key:
                    self._live_keys[p.live_key] = p.request_id
        elif p.kind == spb.PENDING_KIND_PREFILL_DONE:
            self.pending.prefill_done(p.request_id, now_s)
        elif p.kind == spb.PENDING_KIND_DECODING:
            self.pending.decode_started(p.request_id, now_s)
        elif p.kind == spb.PENDING_KIND_FINISHED:
            self.pending.finish(p.request_id, now_s)
            self._forget(origin, p.request_id)

    def _forget(self, origin: str, request_id: str) -> None:
        with self._lock:
            live_key = self._requests.get(origin, {}).pop(request_id, b"")
            if live_key and self._live_keys.get(live_key) == request_id:
                del self._live_keys[live_key]

    def holds(self, live_key: bytes) -> bool:
        """Whether another live replica has a request of this (tenant, client id) in flight."""
        with self._lock:
            return live_key in self._live_keys

    def sweep(self, now_s: float) -> list[str]:
        """Forgets the replicas silent for ``REPLICA_TTL_S`` and their requests; their ids."""
        with self._lock:
            gone = [r for r, seen in self._last_seen_s.items() if now_s - seen > REPLICA_TTL_S]
            orphans = {r: self._requests.pop(r, {}) for r in gone}
            for r in gone:
                del self._last_seen_s[r]
            for requests in orphans.values():
                for live_key in requests.values():
                    self._live_keys.pop(live_key, None)
        for requests in orphans.values():
            for request_id in requests:
                self.pending.finish(request_id, now_s)
        return gone

    def num_requests(self) -> int:
        with self._lock:
            return sum(len(r) for r in self._requests.values())
