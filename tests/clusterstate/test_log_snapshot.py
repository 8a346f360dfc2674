"""A whole state through the store's two forms of it (``clusterstate.log_snapshot``): its
snapshot, sealed and opened as a replica stores and reads it, and the entries that write it
into a new log. No Redis: the reading and writing around them is test_redis_log's."""

from __future__ import annotations

from clusterstate.log import EntryApplier
from clusterstate.log_snapshot import REPUBLISH_EVENTS, republished, snapshot_workers, state_snapshot
from clusterstate.state import ClusterState
from clusterstate.workers import WorkerLoad, WorkerRole
from tests.clusterstate.state_support import KEYS, KEYS_OF_STORE, LONG_TTL_S, FakeClock, info, stored


def _state(clock: FakeClock) -> ClusterState:
    state = ClusterState(ttl_s=LONG_TTL_S, clock=clock)
    state.register(info("p0"))
    state.register(info("d0", WorkerRole.DECODE))
    clock.advance(0.5)
    state.register(info("p1"))
    state.heartbeat("p0", WorkerLoad(num_free_pages=7, num_running=1, timestamp_s=clock()),
                    [stored("p0", 0), stored("p0", 1, snap=True)])
    state.apply([stored("p1", 2), stored("p1", 3), stored("d0", 4)])
    return state


def test_a_state_restored_from_its_sealed_snapshot_is_the_same_state() -> None:
    clock = FakeClock()
    state = _state(clock)
    snapshot = state_snapshot(state, KEYS_OF_STORE, "12-0", 5, "epoch")
    opened = KEYS_OF_STORE.open_snapshot(KEYS_OF_STORE.seal_snapshot(snapshot))
    assert (opened.position, opened.seq, opened.epoch) == ("12-0", 5, "epoch")
    restored = ClusterState(ttl_s=LONG_TTL_S, clock=clock)
    restored.register(info("gone"))  # replaced: a restore leaves nothing of what was there
    restored.replace(snapshot_workers(opened, EntryApplier(restored, KEYS_OF_STORE).worker_of))
    assert restored.digest() == state.digest()
    assert restored.worker("gone") is None and restored.worker("p0").instance_id == "i" * 16


def test_a_state_republished_into_a_new_log_holds_its_workers_and_blocks() -> None:
    """What a replica reading the new log from its start finds: every registration (at its
    last-seen time) and every holding; loads come with the next heartbeats."""
    clock = FakeClock()
    state = _state(clock)
    fields = republished(state.export(), KEYS_OF_STORE, "r-1")
    assert len(fields) == 6  # per worker: its registration, then its blocks (one entry each here)
    rebuilt = ClusterState(ttl_s=LONG_TTL_S, clock=clock)
    applier = EntryApplier(rebuilt, KEYS_OF_STORE)
    for f in fields:
        applier.apply(KEYS_OF_STORE.open_entry(f), own=False)
    assert rebuilt.blocks_digest() == state.blocks_digest()
    assert [(e.info, e.last_seen_s) for e, _ in rebuilt.export()] == [(e.info, e.last_seen_s)
                                                                       for e, _ in state.export()]


def test_a_worker_s_blocks_are_republished_in_bounded_entries() -> None:
    clock = FakeClock()
    state = ClusterState(ttl_s=LONG_TTL_S, clock=clock)
    state.register(info("p0"))
    state.apply([stored("p0", i) for i in range(len(KEYS))])
    worker, held = state.export()[0]
    many = {bytes([i % 256, i // 256]) + k[2:]: held[k] for i in range(REPUBLISH_EVENTS + 1) for k in KEYS[:1]}
    fields = republished([(worker, many)], KEYS_OF_STORE, "r-1")
    sizes = [len(KEYS_OF_STORE.open_entry(f).blocks.events) for f in fields[1:]]
    assert sizes == [REPUBLISH_EVENTS, 1]
