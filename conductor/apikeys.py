"""API keys for the public endpoint: who a client is, and which tenants (cache salts) it may use.

Clients send ``authorization: Bearer <key>`` (gRPC metadata, or the HTTP header the OpenAI
front forwards). The keys file holds only SHA-256 digests, one entry per key::

    {"keys": [{"name": "acme-prod", "sha256": "<hex>", "tenant": "acme", "sub_tenants": ["acme/eu"],
               "max_running": 8, "max_queued": 16, "weight": 2}]}

A key is bound to its ``tenant``: a request's tenant is that tenant unless the request names
one of the key's ``sub_tenants``; naming any other is PERMISSION_DENIED, and a missing or
unknown key UNAUTHENTICATED. So the cache salt always comes from the credential, and one
tenant can neither reuse nor probe (through ``cached_tokens`` or timing) another's cache.
The file is re-read when it changes (checked at most once a second), so keys are added and
revoked without a restart; a file that stops parsing keeps the last good keys and says so.
``tidekv apikey add`` appends a new key and prints it once.

The optional ``max_running``, ``max_queued`` and ``weight`` are the tenant's share of
admission (``conductor.admission.TenantLimits``; unset: the cluster's limits, weight 1). They
belong to the tenant, whichever of its keys (or sub-tenants) a request uses, so every key of
one tenant must give the same ones (a file where they differ is an error naming both entries).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from conductor.admission import TenantLimits
from runtime.auth import AuthError

log = logging.getLogger(__name__)
KEY_PREFIX = "tk-"
RELOAD_CHECK_S = 1.0


@dataclass(frozen=True)
class ApiKey:
    name: str
    tenant: str
    sub_tenants: tuple[str, ...] = ()
    limits: TenantLimits = TenantLimits()  # the tenant's share of admission

    def tenant_for(self, requested: str) -> str:
        """The tenant a request of this key runs as; AuthError when it may not use ``requested``."""
        if not requested or requested == self.tenant:
            return self.tenant
        if requested in self.sub_tenants:
            return requested
        raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                        f"tenant: key {self.name!r} may use tenant {self.tenant!r}"
                        + (f" or {', '.join(map(repr, self.sub_tenants))}" if self.sub_tenants else "")
                        + f", not {requested!r}")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


LIMIT_FIELDS = ("max_running", "max_queued", "weight")


def _limits(entry: dict, where: str) -> TenantLimits:
    """The entry's optional admission limits; ValueError naming the field."""
    for name in ("max_running", "max_queued"):
        value = entry.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{where}: \"{name}\" must be a whole number, got {value!r}")
    weight = entry.get("weight", 1.0)
    if not isinstance(weight, int | float) or isinstance(weight, bool):
        raise ValueError(f"{where}: \"weight\" must be a number, got {weight!r}")
    try:
        return TenantLimits(entry.get("max_running"), entry.get("max_queued"), float(weight))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def parse_keys(text: str, source: str) -> dict[str, ApiKey]:
    """digest -> key from a keys file's text; ValueError naming ``source`` and the entry."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"api keys file {source}: not JSON: {e}") from e
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"api keys file {source}: expected {{\"keys\": [...]}}")
    out: dict[str, ApiKey] = {}
    limits_of: dict[str, tuple[int, TenantLimits]] = {}  # tenant -> (first entry giving them, limits)
    for i, e in enumerate(entries):
        where = f"api keys file {source}, keys[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("sha256"), str) or len(e["sha256"]) != 64:
            raise ValueError(f"{where}: needs a 64-hex-digit \"sha256\"")
        tenant, subs = e.get("tenant", ""), e.get("sub_tenants", [])
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{where}: needs a non-empty \"tenant\"")
        if not isinstance(subs, list) or not all(isinstance(s, str) and s for s in subs):
            raise ValueError(f"{where}: \"sub_tenants\" must be a list of non-empty strings")
        limits = _limits(e, where)
        first, known = limits_of.setdefault(tenant, (i, limits))
        if known != limits:
            raise ValueError(f"{where}: tenant {tenant!r} has other limits in keys[{first}] ({known}); every key of "
                             f"one tenant must give the same max_running, max_queued and weight")
        out[e["sha256"].lower()] = ApiKey(str(e.get("name", f"key-{i}")), tenant, tuple(subs), limits)
    return out


class ApiKeys:
    """The keys of one file, reloaded when it changes. Thread-safe."""

    def __init__(self, path: str):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._mtime = self._stat()
        self._keys = parse_keys(self._read(), str(self.path))  # a bad file at start is an error
        self._next_check = time.monotonic() + RELOAD_CHECK_S
        log.info("%d API keys from %s", len(self._keys), self.path)

    def _read(self) -> str:
        try:
            return self.path.read_text()
        except OSError as e:
            raise ValueError(f"api keys file {self.path}: {e.strerror or e}") from e

    def _stat(self) -> tuple[int, int]:
        try:
            st = self.path.stat()
            return st.st_mtime_ns, st.st_size
        except OSError:
            return 0, 0

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + RELOAD_CHECK_S
        stamp = self._stat()
        if stamp == self._mtime:
            return
        self._mtime = stamp
        try:
            self._keys = parse_keys(self._read(), str(self.path))
            log.info("reloaded %d API keys from %s", len(self._keys), self.path)
        except ValueError as e:
            log.error("%s; keeping the %d keys loaded before", e, len(self._keys))

    def authenticate(self, metadata: Mapping[str, str] | Sequence[tuple[str, str]]) -> ApiKey:
        """The key the call's ``authorization`` metadata names; AuthError (UNAUTHENTICATED) otherwise."""
        md = dict(metadata)
        header = md.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                            "authorization: send 'Bearer <api key>' (a missing or malformed header)")
        with self._lock:
            self._maybe_reload()
            found = self._keys.get(digest(key.strip()))
        if found is None:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "authorization: unknown or revoked API key")
        return found


def add_key(path: str, tenant: str, name: str = "", sub_tenants: Sequence[str] = (),
            limits: TenantLimits | None = None) -> str:
    """Appends a new key for ``tenant`` to the keys file (made, mode 0600, when missing) and
    returns the key itself, which is stored nowhere. ``limits``: the tenant's admission share,
    written on every key of the tenant (None: the new key takes those its other keys have)."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    p = Path(path)
    doc = json.loads(p.read_text()) if p.exists() else {"keys": []}
    parse_keys(json.dumps(doc), path)
    entry = {"name": name or f"{tenant}-{len(doc['keys'])}", "sha256": digest(key), "tenant": tenant,
             "sub_tenants": list(sub_tenants)}
    if limits is None:  # the tenant's limits as its other keys give them
        same = [e for e in doc["keys"] if e.get("tenant") == tenant]
        entry.update({f: same[0][f] for f in LIMIT_FIELDS if same and f in same[0]})
    doc["keys"].append(entry)
    if limits is not None:
        for e in doc["keys"]:
            if e.get("tenant") == tenant:
                for f in LIMIT_FIELDS:
                    e.pop(f, None)
                e.update({f: v for f, v in (("max_running", limits.max_running), ("max_queued", limits.max_queued),
                                            ("weight", limits.weight)) if v is not None})
    parse_keys(json.dumps(doc), path)
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, p)
    return key
