"""Request ids: the one a client chooses is its tenant's, the one the workers see is ours.

A client may name its request (``GenerateRequest.request_id``); that name is scoped to the
client's tenant: two tenants may use the same one at once and never meet. Inside the cluster
every request goes by an id this Conductor makes (``<replica tag>-<counter>``, unique across
replicas), so placements, transfer ids, decode reservations and worker logs never carry a
client's name, and no id of one tenant can touch another tenant's request. A second live
request with the same name *within* one tenant is refused (ALREADY_EXISTS, naming only that
name); the other replicas' live names come through the cluster's log as keyed hashes
(``conductor.replicas``), so a duplicate is caught on any replica once the first one's
routing has reached it. Thread-safe.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import threading
import uuid
from dataclasses import dataclass
from typing import Protocol


class RemoteIds(Protocol):
    def holds(self, live_key: bytes) -> bool: ...


@dataclass(frozen=True)
class Claim:
    request_id: str  # the cluster's id
    client_request_id: str  # the client's (or one made for it)
    live_key: bytes  # keyed hash of (tenant, client id); b"" when the client named nothing


class LiveRequests:
    """``key``: the keyed hash's key (from the cluster secret); ``replica_id``: this Conductor's."""

    def __init__(self, key: bytes, replica_id: str, remote: RemoteIds | None = None):
        self._key = key
        self._tag = hashlib.blake2b(replica_id.encode(), digest_size=4).hexdigest()
        self._remote = remote
        self._counter = itertools.count(1)
        self._live: set[bytes] = set()
        self._lock = threading.Lock()

    def live_key(self, tenant: str, client_request_id: str) -> bytes:
        return hmac.new(self._key, f"{tenant}\n{client_request_id}".encode(), hashlib.sha256).digest()[:16]

    def claim(self, tenant: str, client_request_id: str, failover: bool = False) -> Claim | None:
        """The ids of a new request, or None when ``client_request_id`` is live in ``tenant``.
        A request failed over from a replica that died (``GenerateRequest.failover``) may take a
        name that replica still holds."""
        request_id = f"{self._tag}-{next(self._counter):x}"
        if not client_request_id:
            return Claim(request_id, uuid.uuid4().hex, b"")
        live_key = self.live_key(tenant, client_request_id)
        with self._lock:
            if live_key in self._live or (not failover and self._remote is not None and self._remote.holds(live_key)):
                return None
            self._live.add(live_key)
        return Claim(request_id, client_request_id, live_key)

    def release(self, claim: Claim) -> None:
        if claim.live_key:
            with self._lock:
                self._live.discard(claim.live_key)
