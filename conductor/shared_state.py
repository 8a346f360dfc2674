"""Opening the cluster state a Conductor routes on: in memory for one Conductor
(``--index memory``), or followed from the store's log that replicas share (``--index
redis://...``, ``rediss://...``, ``redis+sentinel://...``; ``clusterstate.redis_log``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from clusterstate.log import EntryApplier, LocalLog, StateLog
from clusterstate.records import StoreKeys
from clusterstate.redis_conn import connect, parse_store_url, read_password
from clusterstate.redis_log import RedisLog, RedisLogConfig
from clusterstate.state import ClusterState
from conductor.config import ConductorConfig
from runtime.auth import Nonces, NonceStore


@dataclass(frozen=True)
class SharedState:
    state: ClusterState
    log: StateLog
    applier: EntryApplier
    keys: StoreKeys

    @property
    def shared(self) -> bool:
        """Whether other replicas read this state's log (a store), not only this Conductor."""
        return self.log.shared

    def nonces(self) -> NonceStore:
        """The signatures' nonce memory of this Conductor: its own, and with replicas also the
        one they share in the store, so a call signed for one replica is refused by the others
        (the audience of every replica is ``conductor``)."""
        return ReplicaNonces(Nonces(), self.log) if self.shared else Nonces()


class ReplicaNonces:
    """First use here and in the store (while the store is down, here only)."""

    def __init__(self, local: NonceStore, store: NonceStore):
        self.local, self.store = local, store

    def first_use(self, nonce: str, expires_s: float) -> bool:
        return self.local.first_use(nonce, expires_s) and self.store.first_use(nonce, expires_s)


def open_state(config: ConductorConfig, secret: bytes) -> SharedState:
    """The state and its log, not started; ``ValueError`` naming a bad ``--index`` or password file."""
    # An expired worker is hidden at once and purged ten leases later (ClusterState).
    state = ClusterState(ttl_s=config.worker_ttl_s, reap_after_s=10 * config.worker_ttl_s)
    keys = StoreKeys.from_secret(secret)
    applier = EntryApplier(state, keys)
    replica_id = f"conductor-{uuid.uuid4().hex[:8]}"
    if config.index in ("", "memory"):
        return SharedState(state, LocalLog(applier, replica_id), applier, keys)
    address = parse_store_url(config.index)
    password = read_password(config.index_password_file)
    log_config = RedisLogConfig(namespace=config.index_namespace, max_lag_s=config.max_index_lag_s,
                                replicas_wait=1 if address.scheme == "redis+sentinel" else 0,
                                quiet_s=2 * config.heartbeat_interval_s)

    def client():
        return connect(address, password, config.index_tls_ca)

    return SharedState(state, RedisLog(client, applier, keys, replica_id, log_config), applier, keys)
