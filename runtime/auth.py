"""Who may call what: the cluster credential between Tidekv processes, grants, and TLS.

Every process of a cluster holds the **cluster secret** S (a file of at least 32 random
bytes, hex; ``tidekv secret`` makes one). Each internal gRPC call is signed by the caller's
channel (``signed``, ``Member.channel``) and checked by the server's ``AuthInterceptor``;
the signature binds the principal, the method, the exact request body, the audience (the
principal of the server it is for: ``worker/<id>`` or ``conductor``), a timestamp and a
nonce (the scheme: ``runtime.signatures``).

The key is what the call must prove (``Need``):

- ``MEMBER``: S itself. Any member: a worker registering, an operator listing workers,
  a prefill worker pulling blocks from a peer (which also presents a grant, below).
- ``SESSION``: ``session_key(S, worker_id, instance_id)``, known only to the Conductor and to
  the one worker *instance* that registered with that secret ``instance_id`` (a random value
  each process draws at start and sends only in ``Register``). A worker's heartbeats and the
  Conductor's calls to a worker (Prefill, Reserve, Renew, Decode, Release) use it, so no other
  process, member or not, can take a worker's place or drive a worker.
- ``OPEN``: nothing (health, reflection, and the public ``Generate``, which checks API keys
  itself: ``conductor.apikeys``).

A server accepts a signature once (its ``NonceStore``), only for its own audience, within
the clock limits, and only if it was made after the server's start (its *floor*, so nothing
recorded before a restart is accepted by the new process; nothing is persisted). A refused
call ends with UNAUTHENTICATED (no or bad credential, naming what did not match) or
PERMISSION_DENIED (a valid member asking for what its principal may not do) and is logged at
WARNING with the caller's address.

**Grants.** A pull (``Prefill/PushBlocks``) is allowed only for what the Conductor routed:
the decision carries ``grant(K_holder, request_id, puller, destination, keys, expiry)``,
an HMAC under the holder's session key that the holder recomputes; it names the puller, the
transfer destination and the exact blocks, and expires with the request.

``Member`` is one process's credential (secret, principal, TLS files): the signed channels
it dials and the interceptor its server installs. TLS itself is ``runtime.grpc_server``'s
(``TlsFiles``); ``tidekv certs`` makes a local CA and a server certificate.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from runtime.grpc_server import channel
from runtime.logs import Throttled
from runtime.signatures import (  # noqa: F401 - re-exported: the scheme's names, as callers import them
    AUDIENCE_HEADER,
    AUTH_HEADER,
    MAX_LEAD_S,
    MAX_SKEW_S,
    PRINCIPAL_HEADER,
    AuthError,
    Nonces,
    NonceStore,
    sign,
    signed,
    verify,
)
from runtime.tls import TlsFiles

log = logging.getLogger(__name__)
_REFUSALS = Throttled(log)

CONDUCTOR = "conductor"
OPERATOR = "operator"
MIN_SECRET_BYTES = 32
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def worker_principal(worker_id: str) -> str:
    return f"worker/{worker_id}"


def worker_of(principal: str) -> str | None:
    """The worker id of a ``worker/<id>`` principal, else None."""
    return principal[len("worker/"):] if principal.startswith("worker/") else None


# ---- the secret --------------------------------------------------------------------------------
def new_secret() -> str:
    """A fresh cluster secret as written to its file (64 hex digits)."""
    return secrets.token_hex(MIN_SECRET_BYTES)


def load_secret(path: str) -> bytes:
    """The cluster secret in ``path``; ValueError naming the file when it is missing or short."""
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cluster secret file {path}: {e.strerror or e}") from e
    if len(text) < 2 * MIN_SECRET_BYTES:
        raise ValueError(f"cluster secret file {path}: needs at least {MIN_SECRET_BYTES} bytes as "
                         f"{2 * MIN_SECRET_BYTES} hex digits (make one with `tidekv secret --out FILE`)")
    return text.encode()


def derive(secret: bytes, purpose: str) -> bytes:
    """A key for one purpose (the transfer handshake, ...) derived from the cluster secret."""
    return hmac.new(secret, f"tidekv/{purpose}".encode(), hashlib.sha256).digest()


def session_key(secret: bytes, worker_id: str, instance_id: str) -> bytes:
    return hmac.new(secret, f"tidekv/session\n{worker_id}\n{instance_id}".encode(), hashlib.sha256).digest()


# ---- server side -------------------------------------------------------------------------------
class Need(enum.Enum):
    OPEN = "open"
    MEMBER = "member"
    SESSION = "session"


@dataclass(frozen=True)
class Rules:
    """Per full method name (``/tidekv.v1.Registry/Heartbeat``), what a caller must prove; a
    method not named is refused (fail closed), except the open health and reflection services.
    ``session_key_for(principal)``: the SESSION key of that principal here, or None.
    ``audience``: this server's own principal, the audience its callers must sign for."""

    needs: Mapping[str, Need]
    secret: bytes
    session_key_for: Callable[[str], bytes | None]
    audience: str

    def key_for(self, method: str) -> Callable[[str], bytes | None]:
        need = self.needs[method]
        if need is Need.MEMBER:
            return lambda principal: self.secret
        return self.session_key_for


def current_principal(context: grpc.ServicerContext) -> str:
    """The principal a verified call came from (the interceptor checked the metadata)."""
    return dict(context.invocation_metadata()).get(PRINCIPAL_HEADER, "")


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks every call against ``Rules`` before the servicer sees it: the metadata and the
    request bytes as received (it wraps the method's deserializer, so the servicer gets the
    message only once its body matched the signature). Unary and server-streaming methods can
    be signed; a client-streaming one that needs a credential is refused.

    ``nonces``: where used signatures are remembered (default: this process's memory;
    replicas sharing one audience pass a shared ``NonceStore``). The **floor** is the
    construction time plus ``MAX_LEAD_S`` (a client's clock may run that far ahead, so a
    call the previous process accepted carries an earlier timestamp); signatures made
    before it are refused, and construction blocks until the floor has passed, so a server
    that binds its port afterwards refuses no honest caller. Thread-safe."""

    def __init__(self, rules: Rules, nonces: NonceStore | None = None):
        self.rules = rules
        self.nonces: NonceStore = nonces if nonces is not None else Nonces()
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self.floor_s = time.time() + MAX_LEAD_S
        time.sleep(max(0.0, self.floor_s - time.time()))

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        method = details.method
        handler = continuation(details)
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        need = self.rules.needs.get(method)
        if need is Need.OPEN:
            return handler
        if need is None:
            return _refusing(handler, AuthError(grpc.StatusCode.PERMISSION_DENIED,
                                                f"{method} is not served to anyone"), method)
        if handler.request_streaming:
            return _refusing(handler, AuthError(grpc.StatusCode.PERMISSION_DENIED,
                                                f"{method}: a client-streaming call cannot carry a body-bound "
                                                f"signature"), method)
        wrapped = self._wrapped.get(method)
        if wrapped is None or wrapped[0] is not handler:  # one wrapper per method's handler
            wrapped = self._wrapped[method] = (handler, self._checking(handler, method))
        return wrapped[1]

    def check(self, metadata: Mapping[str, str], method: str, body: bytes) -> str:
        """The principal of one call to ``method`` with request bytes ``body``, or AuthError."""
        return verify(metadata, method, body, self.rules.audience, self.rules.key_for(method), self.nonces,
                      self.floor_s)

    def _checking(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """``handler`` taking raw bytes: verified against the call's signature, then deserialized."""
        deserialize = handler.request_deserializer

        def parse(raw: bytes, context: grpc.ServicerContext):
            try:
                self.check(dict(context.invocation_metadata()), method, raw)
            except AuthError as e:
                refuse(context, e, method)
            try:
                return deserialize(raw) if deserialize is not None else raw
            except DecodeError as e:  # a member's malformed message: what gRPC itself would refuse
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method} request: {e}")

        kw = {"request_deserializer": None, "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            behavior = handler.unary_unary
            return grpc.unary_unary_rpc_method_handler(lambda raw, ctx: behavior(parse(raw, ctx), ctx), **kw)
        stream = handler.unary_stream

        def streaming(raw: bytes, context: grpc.ServicerContext):
            yield from stream(parse(raw, context), context)

        return grpc.unary_stream_rpc_method_handler(streaming, **kw)


def refuse(context: grpc.ServicerContext, error: AuthError, what: str) -> None:
    """Logs a refused call with its peer (bounded under a flood) and ends it with the error's status."""
    _REFUSALS.log(logging.WARNING, f"refused:{error.code.name}", "refused %s from %s: %s", what, context.peer(), error)
    context.abort(error.code, str(error))


def _refusing(handler: grpc.RpcMethodHandler, error: AuthError, method: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that refuses the call."""

    def unary(request, context):
        refuse(context, error, method)

    def stream(request, context):
        refuse(context, error, method)
        yield  # pragma: no cover - abort raised

    kw = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(lambda it, ctx: unary(None, ctx), **kw)
    return grpc.stream_stream_rpc_method_handler(lambda it, ctx: stream(None, ctx), **kw)


# ---- grants ------------------------------------------------------------------------------------
def _grant_mac(key: bytes, request_id: str, puller: str, destination: str, keys: Sequence[bytes],
               expiry_ms: int) -> bytes:
    digest = hashlib.sha256(b"".join(len(k).to_bytes(2, "big") + k for k in keys)).hexdigest()
    text = f"tidekv/grant\n{request_id}\n{puller}\n{destination}\n{digest}\n{expiry_ms}"
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def grant(holder_key: bytes, request_id: str, puller: str, destination: str, keys: Sequence[bytes],
          ttl_s: float) -> tuple[bytes, int]:
    """The Conductor's permission for ``puller`` to have ``keys`` sent to ``destination`` by the
    holder whose session key is ``holder_key``: (mac, expiry in unix ms)."""
    expiry_ms = int((time.time() + ttl_s) * 1000)
    return _grant_mac(holder_key, request_id, puller, destination, keys, expiry_ms), expiry_ms


def check_grant(own_key: bytes, mac: bytes, expiry_ms: int, request_id: str, puller: str, destination: str,
                keys: Sequence[bytes]) -> None:
    """AuthError (PERMISSION_DENIED) unless ``mac`` is this worker's grant for exactly this pull."""
    if expiry_ms < time.time() * 1000:
        raise AuthError(grpc.StatusCode.PERMISSION_DENIED, f"the grant for {request_id} has expired")
    if not hmac.compare_digest(mac, _grant_mac(own_key, request_id, puller, destination, keys, expiry_ms)):
        raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                        f"no grant lets {puller} pull these {len(keys)} blocks for {request_id} to {destination}")


# ---- a process's credential --------------------------------------------------------------------
@dataclass(frozen=True)
class Member:
    """This process's cluster credential: the secret, who it is, and the TLS files it uses."""

    secret: bytes
    principal: str
    tls: TlsFiles = TlsFiles()

    @classmethod
    def from_config(cls, secret_file: str, principal: str, tls: TlsFiles) -> Member:
        """ValueError naming the flag when the secret file is not given or not usable."""
        if not secret_file:
            raise ValueError("--cluster-secret-file (TIDEKV_CLUSTER_SECRET_FILE) is required: every member of a "
                             "cluster proves it knows one shared secret (make one with `tidekv secret --out FILE`)")
        return cls(load_secret(secret_file), principal, tls)

    def channel(self, address: str, key: bytes | None = None, *, audience: str) -> grpc.Channel:
        """A channel to ``address`` whose calls are signed with ``key`` (default: the secret)
        for ``audience``, the principal of the server at ``address``: ``worker_principal(id)``
        of the worker dialled, or ``CONDUCTOR``."""
        return signed(channel(address, self.tls), self.secret if key is None else key, self.principal, audience)

    def interceptor(self, needs: Mapping[str, Need], session_key_for: Callable[[str], bytes | None],
                    nonces: NonceStore | None = None) -> AuthInterceptor:
        """The interceptor of a server that is this member: its audience is this member's
        principal. ``nonces``: see ``AuthInterceptor`` (blocks up to ``MAX_LEAD_S``)."""
        return AuthInterceptor(Rules(needs, self.secret, session_key_for, self.principal), nonces)


@dataclass(frozen=True)
class WorkerCredential:
    """A worker process's credential: the member's, plus the instance id it draws at start
    and the session key that id makes (shared with the Conductor once it registers)."""

    member: Member
    worker_id: str
    instance_id: str

    @classmethod
    def new(cls, secret_file: str, worker_id: str, tls: TlsFiles) -> WorkerCredential:
        return cls(Member.from_config(secret_file, worker_principal(worker_id), tls), worker_id, secrets.token_hex(16))

    @property
    def session_key(self) -> bytes:
        return session_key(self.member.secret, self.worker_id, self.instance_id)

    @property
    def transfer_key(self) -> bytes:
        """The key of the transfer engine's handshake (``TransferConfig.auth_key``), the same in every member."""
        return derive(self.member.secret, "transfer")

    def interceptor(self, needs: Mapping[str, Need], nonces: NonceStore | None = None) -> AuthInterceptor:
        """SESSION calls to this worker are the Conductor's, signed with this instance's key,
        for the audience ``worker/<worker_id>``."""
        return self.member.interceptor(needs, lambda p: self.session_key if p == CONDUCTOR else None, nonces)
