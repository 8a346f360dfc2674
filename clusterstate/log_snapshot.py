"""A whole ``ClusterState`` as the shared log stores it, apart from the stream: the snapshot a
replica starts or repairs from (made from the state's ``export``, read back into registry
entries with the blocks each worker holds), the script that stores one, and the log entries
that write a whole state into a new log after the store lost its data.

Pure functions of the state, the snapshot and the keys; reading the stream and when a
snapshot is due belong to ``clusterstate.redis_follow``, the snapshot lock's commands to
``clusterstate.redis_store``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from clusterstate.log import entry, record_of
from clusterstate.records import StoreKeys
from clusterstate.registry import WorkerEntry
from clusterstate.state import ClusterState
from clusterstate.workers import WorkerInfo
from kvstore.block_index import BlockHold
from kvstore.blocks import KEY_BYTES, BlockKey
from proto import state_pb2 as spb
from proto.convert import block_event, load_from_proto, load_to_proto

SNAPSHOT_LOCK_MS = 5_000  # one replica writes a snapshot at a time (released when written)
REPUBLISH_EVENTS = 20_000  # block events per entry when a replica writes its state into a new log

# KEYS: snapshot hash, stream, lock; ARGV: seq, position, epoch, sealed blob, the writer's id.
# A snapshot replaces the stored one only when it is newer in the same epoch; the stream is
# then trimmed up to the *previous* snapshot's position, so a replica a little behind the
# writer reads on without a gap (one falling a whole interval behind repairs from the snapshot).
PUT_SNAPSHOT = """
if redis.call('GET', KEYS[3]) == ARGV[5] then redis.call('DEL', KEYS[3]) end
local old = redis.call('HMGET', KEYS[1], 'seq', 'epoch', 'position')
if old[1] and old[2] == ARGV[3] and tonumber(old[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'seq', ARGV[1], 'position', ARGV[2], 'epoch', ARGV[3], 'blob', ARGV[4])
if old[3] and old[2] == ARGV[3] then redis.call('XTRIM', KEYS[2], 'MINID', old[3]) end
return 1
"""

Holdings = Sequence[tuple[WorkerEntry, dict[BlockKey, BlockHold]]]  # a ClusterState's ``export``


def state_snapshot(state: ClusterState, keys: StoreKeys, position: str, seq: int, epoch: str) -> spb.StateSnapshot:
    """``state`` as of stream ``position`` (sequence number ``seq``) in ``epoch``: every worker's
    sealed registration, load, lease and heartbeat number, and its blocks (keys sorted, one
    holding code per key)."""
    out = spb.StateSnapshot(position=position, seq=seq, epoch=epoch)
    for worker, held in state.export():
        block_keys = sorted(held)
        out.workers.append(spb.WorkerSnapshot(
            record=record_of(worker.info, keys), load=load_to_proto(worker.load),
            last_seen_s=worker.last_seen_s, heartbeat_seq=worker.heartbeat_seq, keys=b"".join(block_keys),
            codes=bytes(held[k].code for k in block_keys)))
    return out


def snapshot_workers(snapshot: spb.StateSnapshot,
                     worker_of: Callable[[spb.WorkerRecord], WorkerInfo]) -> Holdings:
    """What ``ClusterState.replace`` takes, read from ``snapshot`` (``worker_of``: a sealed
    registration opened, ``EntryApplier.worker_of``)."""
    workers = []
    for w in snapshot.workers:
        held = {w.keys[i:i + KEY_BYTES]: BlockHold.of_code(w.codes[i // KEY_BYTES])
                for i in range(0, len(w.keys), KEY_BYTES)}
        workers.append((WorkerEntry(worker_of(w.record), load_from_proto(w.load), w.last_seen_s, w.heartbeat_seq),
                        held))
    return workers


def republished(holdings: Holdings, keys: StoreKeys, replica_id: str) -> list[dict[bytes, bytes]]:
    """``holdings`` (a state's ``export``) as log entries' fields: each registration at the time
    it was last heard of, then its blocks in entries of ``REPUBLISH_EVENTS``, so that a replica
    reading a new log from its start finds the cluster before any snapshot of it exists."""
    fields: list[dict[bytes, bytes]] = []
    for worker, held in holdings:
        info = worker.info
        fields.append(keys.entry_fields(entry(replica_id, worker.last_seen_s, registered=record_of(info, keys))))
        events = [block_event(k, h.tier, h.has_snapshot) for k, h in held.items()]
        for start in range(0, len(events), REPUBLISH_EVENTS):
            blocks = spb.BlocksEntry(worker_id=info.worker_id, events=events[start:start + REPUBLISH_EVENTS])
            fields.append(keys.entry_fields(entry(replica_id, worker.last_seen_s, blocks=blocks)))
    return fields


__all__ = ["PUT_SNAPSHOT", "REPUBLISH_EVENTS", "SNAPSHOT_LOCK_MS", "republished", "snapshot_workers",
           "state_snapshot"]
