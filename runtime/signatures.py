"""The signature of one internal gRPC call: what it binds, its metadata, and its verification.

A signature binds the whole call (metadata scheme **v2**)::

    x-tidekv-principal: conductor | worker/<worker_id> | operator     (who signs)
    x-tidekv-audience:  conductor | worker/<worker_id>                (whom the call is for)
    x-tidekv-auth:      v2.<unix ms>.<nonce hex>.<body sha256 hex>.<hex HMAC-SHA256(key, fields)>

    fields = "tidekv/v2", principal, audience, method, ms, nonce, SHA-256 of the request body

The body is the exact serialized request message (the client hashes
``request.SerializeToString()``, the server the bytes it received), so a relay that edits
the message breaks the signature. The audience is the target's principal: ``worker/<id>``
for a worker (the caller knows the id it dials), ``conductor`` for the Conductor, which is
one role-wide audience because Conductor replicas are interchangeable behind one address. A
server verifies against its own audience (never the header's), so a call signed for one
worker is refused by every other.

``verify`` refuses, with UNAUTHENTICATED naming what did not match: another format, another
audience, a timestamp more than ``MAX_SKEW_S`` behind or ``MAX_LEAD_S`` ahead of the
server's clock, one older than the server's ``floor_s`` (its start: see
``runtime.auth.AuthInterceptor``), a body other than the signed one, a bad MAC, or a nonce
seen before (``NonceStore``); PERMISSION_DENIED when the principal may not call the method.

``NonceStore`` is pluggable: ``Nonces`` keeps them in this process's memory (the default);
replicas that share one audience plug in a store they share.

``signed(channel, key, principal, audience)`` is the caller's side: a channel that
serializes each unary or server-streaming request once and signs exactly the bytes it sends.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import grpc

PRINCIPAL_HEADER = "x-tidekv-principal"
AUDIENCE_HEADER = "x-tidekv-audience"
AUTH_HEADER = "x-tidekv-auth"
VERSION = "v2"
MAX_SKEW_S = 60.0  # how far behind the server's clock a signature may be (delivery, queueing, skew)
MAX_LEAD_S = 1.0  # how far ahead: a server's floor is its start plus this (runtime.auth.AuthInterceptor)
_DIGEST_HEX = 64


class AuthError(Exception):
    """A credential that does not hold; ``code`` is the gRPC status to end the call with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class NonceStore(Protocol):
    """Which signatures have been used. ``first_use(nonce, expires_s)``: True the first time
    ``nonce`` is offered, False every later time until ``expires_s`` (unix seconds; after it
    the signature's timestamp is refused anyway, so the record may be dropped). Must be
    atomic across every server that shares the store (thread-safe, and for replicas one
    check-and-set, such as Redis ``SET nonce 1 NX PXAT expires``)."""

    def first_use(self, nonce: str, expires_s: float) -> bool: ...


class Nonces:
    """A ``NonceStore`` in this process's memory: protects one server process; it is empty
    after a restart (the floor covers that) and not shared by replicas. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.time, prune_every_s: float = 5.0) -> None:
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._clock, self._prune_every_s = clock, prune_every_s
        self._next_prune_s = 0.0

    def first_use(self, nonce: str, expires_s: float) -> bool:
        now = self._clock()
        with self._lock:
            if now >= self._next_prune_s:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                self._next_prune_s = now + self._prune_every_s
            if nonce in self._seen:
                return False
            self._seen[nonce] = expires_s
            return True

    @property
    def num_nonces(self) -> int:
        """How many nonces are remembered now (expired ones go at the next prune)."""
        with self._lock:
            return len(self._seen)


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(key: bytes, principal: str, audience: str, method: str, ms: int, nonce: str, digest: str) -> str:
    text = f"tidekv/{VERSION}\n{principal}\n{audience}\n{method}\n{ms}\n{nonce}\n{digest}"
    return hmac.digest(key, text.encode(), "sha256").hex()


def sign(key: bytes, principal: str, method: str, audience: str, body: bytes,
         now_s: float | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata proving ``principal`` holds ``key`` for one call of ``method`` carrying
    exactly ``body`` (the serialized request) to the server whose principal is ``audience``."""
    ms = int((time.time() if now_s is None else now_s) * 1000)
    nonce, digest = secrets.token_hex(12), body_digest(body)
    token = f"{VERSION}.{ms}.{nonce}.{digest}.{_mac(key, principal, audience, method, ms, nonce, digest)}"
    return ((PRINCIPAL_HEADER, principal), (AUDIENCE_HEADER, audience), (AUTH_HEADER, token))


def _unauthenticated(message: str) -> AuthError:
    return AuthError(grpc.StatusCode.UNAUTHENTICATED, message)


def _parse(token: str) -> tuple[int, str, str, str]:
    parts = token.split(".")
    if parts[0] != VERSION:
        found = parts[0] if len(parts) == 5 else "v1 (unversioned)" if len(parts) == 3 else "unknown"
        raise _unauthenticated(f"{AUTH_HEADER} has format {found}; this server accepts {VERSION} only "
                               f"(signatures bound to the body and the audience): upgrade the caller")
    if len(parts) != 5 or not parts[1].isdigit() or len(parts[3]) != _DIGEST_HEX:
        raise _unauthenticated(f"malformed {AUTH_HEADER}")
    return int(parts[1]), parts[2], parts[3], parts[4]


def verify(metadata: Mapping[str, str], method: str, body: bytes, audience: str,
           key_for: Callable[[str], bytes | None], nonces: NonceStore, floor_s: float = 0.0,
           now_s: float | None = None) -> str:
    """The principal the call's metadata proves, or AuthError naming what did not match.
    ``body``: the request bytes as received; ``audience``: this server's own principal;
    ``key_for(principal)``: the key that principal must hold for this method (None: it may
    not call it); ``floor_s``: signatures made before it are refused (this server's start).
    The nonce is spent only by a call that passes every other check."""
    principal, token = metadata.get(PRINCIPAL_HEADER, ""), metadata.get(AUTH_HEADER, "")
    if not principal or not token:
        raise _unauthenticated(f"{method} needs a cluster credential ({PRINCIPAL_HEADER} and {AUTH_HEADER} metadata)")
    ms, nonce, digest, mac = _parse(token)
    claimed = metadata.get(AUDIENCE_HEADER, "")
    if claimed != audience:
        raise _unauthenticated(f"audience: the credential of {principal} is for {claimed or '(none)'!r}, and this "
                               f"server is {audience!r}: a call signed for one server is refused by every other")
    now = time.time() if now_s is None else now_s
    off_s = ms / 1000 - now
    if off_s < -MAX_SKEW_S or off_s > MAX_LEAD_S:
        raise _unauthenticated(f"skew: the credential of {principal} is {off_s:+.1f} s off this server's clock "
                               f"(limits: {MAX_SKEW_S:.0f} s behind, {MAX_LEAD_S:.0f} s ahead)")
    if ms < floor_s * 1000:
        raise _unauthenticated(f"floor: the credential of {principal} was signed {floor_s - ms / 1000:.1f} s before "
                               f"this server's start; a call recorded before a restart is refused")
    key = key_for(principal)
    if key is None:
        raise AuthError(grpc.StatusCode.PERMISSION_DENIED, f"{principal} may not call {method}")
    if not hmac.compare_digest(digest, body_digest(body)):
        raise _unauthenticated(f"body: this {method} request is not the one {principal} signed (its SHA-256 "
                               f"differs): it was altered on the way")
    if not hmac.compare_digest(mac, _mac(key, principal, audience, method, ms, nonce, digest)):
        raise _unauthenticated(f"bad credential for {principal} on {method} (another key, method or field)")
    if not nonces.first_use(nonce, ms / 1000 + MAX_SKEW_S):
        raise _unauthenticated(f"replay: the credential of {principal} on {method} was used before")
    return principal


# ---- the signing channel -----------------------------------------------------------------------
class _Signing:
    """Serializes a request once and signs exactly the bytes that will be sent."""

    def __init__(self, key: bytes, principal: str, audience: str):
        self.key, self.principal, self.audience = key, principal, audience

    def __call__(self, method: str, serialize, request, metadata) -> tuple[bytes, tuple[tuple[str, str], ...]]:
        body = serialize(request) if serialize is not None else request
        return body, (*(metadata or ()), *sign(self.key, self.principal, method, self.audience, body))


class _SignedCall:
    """A multicallable over ``raw`` (which sends bytes) that signs each request's body."""

    def __init__(self, raw, method: str, serialize, signing: _Signing):
        self._raw, self._method, self._serialize, self._signing = raw, method, serialize, signing

    def __call__(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        body, md = self._signing(self._method, self._serialize, request, metadata)
        return self._raw(body, timeout, md, credentials, wait_for_ready, compression)


class _SignedUnaryUnary(_SignedCall, grpc.UnaryUnaryMultiCallable):
    def with_call(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                  compression=None):
        body, md = self._signing(self._method, self._serialize, request, metadata)
        return self._raw.with_call(body, timeout, md, credentials, wait_for_ready, compression)

    def future(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
               compression=None):
        body, md = self._signing(self._method, self._serialize, request, metadata)
        return self._raw.future(body, timeout, md, credentials, wait_for_ready, compression)


class _SignedUnaryStream(_SignedCall, grpc.UnaryStreamMultiCallable):
    pass


class _SignedChannel(grpc.Channel):
    """A channel whose unary and server-streaming calls carry a signature of the bytes they
    send; client-streaming calls go unsigned (a server that needs a credential refuses them)."""

    def __init__(self, inner: grpc.Channel, signing: _Signing):
        self._inner, self._signing = inner, signing

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        raw = self._inner.unary_unary(method, None, response_deserializer, **kwargs)
        return _SignedUnaryUnary(raw, _text(method), request_serializer, self._signing)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        raw = self._inner.unary_stream(method, None, response_deserializer, **kwargs)
        return _SignedUnaryStream(raw, _text(method), request_serializer, self._signing)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        return self._inner.stream_unary(method, request_serializer, response_deserializer, **kwargs)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        return self._inner.stream_stream(method, request_serializer, response_deserializer, **kwargs)

    def subscribe(self, callback, try_to_connect=False):
        self._inner.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        self._inner.unsubscribe(callback)

    def close(self):
        self._inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._inner.close()
        return False


def _text(method) -> str:
    return method.decode() if isinstance(method, bytes) else method


def signed(ch: grpc.Channel, key: bytes, principal: str, audience: str) -> grpc.Channel:
    """``ch`` with every unary and server-streaming call signed as ``principal`` with ``key``
    for the server whose principal is ``audience`` (``worker/<id>`` or ``conductor``). Each
    request is serialized once; the signature covers exactly the bytes sent."""
    return _SignedChannel(ch, _Signing(key, principal, audience))
