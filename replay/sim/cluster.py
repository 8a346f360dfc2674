"""The registry the simulated Conductor reads: what the workers' last heartbeats said.

Implements ``conductor.core.ClusterView`` over the modelled workers. Every
``heartbeat_interval_s`` each worker's load is copied here, stamped with the simulated wall
clock, as a live worker's heartbeat would arrive; between heartbeats the core relies on its
pending overlay, exactly as the live Conductor does. Block holdings go straight to the
``ClusterState`` (the live Prefill response carries them the same way).
"""

from __future__ import annotations

from collections.abc import Sequence

from clusterstate.state import ClusterState
from clusterstate.workers import WorkerInfo, WorkerLoad, WorkerRole
from conductor.snapshot import RegistryEntry
from kvstore.blocks import BlockKey
from kvstore.index import BlockEvent, MatchSnapshot
from replay.sim.decode import SimDecode
from replay.sim.events import EventLoop
from replay.sim.prefill import SimPrefill

FINGERPRINT = "simulated"


class SimCluster:
    model_fingerprint = FINGERPRINT

    def __init__(self, loop: EventLoop, block_size: int, heartbeat_interval_s: float):
        self.loop, self.block_size, self.heartbeat_interval_s = loop, block_size, heartbeat_interval_s
        self.index = ClusterState(ttl_s=1e18, clock=loop.clock.now)
        self._infos: dict[str, WorkerInfo] = {}
        self.prefill: dict[str, SimPrefill] = {}
        self.decode: dict[str, SimDecode] = {}
        self._loads: dict[str, WorkerLoad] = {}
        self._entries: list[WorkerInfo] | None = None  # registry order, made once
        self._made: list[RegistryEntry | None] = []  # the entries last handed out, in that order
        self._position: dict[str, int] = {}  # worker id -> its place in that order
        self._stale: set[str] = set()  # workers whose load changed since the last registry view
        self._listing: set[str] = set()  # workers whose load lists prefill jobs
        self.last_match: MatchSnapshot | None = None

    def add(self, worker: SimPrefill | SimDecode) -> None:
        is_prefill = isinstance(worker, SimPrefill)
        (self.prefill if is_prefill else self.decode)[worker.worker_id] = worker  # type: ignore[index]
        role = WorkerRole.PREFILL if is_prefill else WorkerRole.DECODE
        address = f"{worker.backend}://{worker.worker_id}" if is_prefill else f"tcp://{worker.worker_id}"
        stages = getattr(worker.config, "cpp_stages", 1)
        info = WorkerInfo(worker.worker_id, role, f"sim://{worker.worker_id}", worker.config.num_pages,
                          transfer_address=address, cpp_stages=stages,
                          cpp_chunk_tokens=worker.config.cpp_chunk_tokens if stages > 1 else 0)
        self._infos[worker.worker_id] = info
        self.index.register(info)
        self._set_load(worker.worker_id, worker.load())
        self._entries = None

    def start_heartbeats(self) -> None:
        """Staggered heartbeats: worker ``i`` of ``n`` beats at phase ``(i + 1) / n`` of the interval.

        An idle worker's load does not change, so once a heartbeat has reported it idle the
        next ones are skipped until ``wake`` (new work); the loads read are the same."""
        workers = [*self.prefill.values(), *self.decode.values()]
        self._phase_s = {w.worker_id: self.heartbeat_interval_s * (i + 1) / len(workers)
                         for i, w in enumerate(workers)}
        self._beating: set[str] = set()
        for w in workers:
            self.wake(w)

    def wake(self, worker: SimPrefill | SimDecode) -> None:
        """``worker`` got work: make sure its heartbeats run (at its phase)."""
        if worker.worker_id in self._beating:
            return
        self._beating.add(worker.worker_id)
        interval, phase = self.heartbeat_interval_s, self._phase_s[worker.worker_id]
        next_s = phase + interval * max(0, int((self.loop.now - phase) // interval) + 1)
        self.loop.at(next_s, self._beat, worker)

    def _set_load(self, worker_id: str, load: WorkerLoad) -> None:
        self._loads[worker_id] = load
        self._stale.add(worker_id)
        if load.prefill_jobs:
            self._listing.add(worker_id)
        else:
            self._listing.discard(worker_id)

    def _beat(self, worker: SimPrefill | SimDecode) -> None:
        self._set_load(worker.worker_id, worker.load())
        if worker.idle:
            self._beating.discard(worker.worker_id)
        else:
            self.loop.at(self.loop.now + self.heartbeat_interval_s, self._beat, worker)

    # ---- ClusterView ----------------------------------------------------------------------------
    def registry_view(self, wall_now_s: float) -> tuple[RegistryEntry, ...]:
        """Every worker's entry: prefill workers then decode workers, each by id. An entry is
        made again when its worker's load changed or the load lists prefill jobs; any other
        keeps the age it was made with, which nothing reads (the snapshot reads a load's age
        only to advance the jobs it lists), so a decision costs the entries remade, not a pass
        over every worker."""
        if self._entries is None:  # infos fixed
            self._entries = [self._infos[wid] for workers in (self.prefill, self.decode) for wid in sorted(workers)]
            self._position = {info.worker_id: i for i, info in enumerate(self._entries)}
            self._made = [None] * len(self._entries)  # every worker is stale: all made below
            self._stale.update(self._position)
        loads, made, entries, position, entry = self._loads, self._made, self._entries, self._position, RegistryEntry.of
        for w in self._stale.union(self._listing):
            i = position[w]
            load = loads[w]
            made[i] = entry(entries[i], load, max(0.0, wall_now_s - load.timestamp_s))
        self._stale.clear()
        return tuple(made)

    def match(self, keys: Sequence[BlockKey]) -> MatchSnapshot | None:
        self.last_match = self.index.match(keys) if keys else None
        return self.last_match

    def apply_events(self, events: Sequence[BlockEvent]) -> None:
        self.index.apply(events)
