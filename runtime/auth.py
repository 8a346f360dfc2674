"""Who may call what: the cluster credential between Tidekv processes, grants, and TLS.

Every process of a cluster holds the **cluster secret** S (a file of at least 32 random
bytes, hex; ``tidekv secret`` makes one). Each internal gRPC call carries two metadata
entries, added by ``signed_channel``'s interceptor and checked by ``AuthInterceptor``:

    x-tidekv-principal: conductor | worker/<worker_id> | operator
    x-tidekv-auth:      <unix ms>.<nonce hex>.<hex HMAC-SHA256(key, principal, method, ms, nonce)>

The key is what the call must prove (``Need``):

- ``MEMBER``: S itself. Any member: a worker registering, an operator listing workers,
  a prefill worker pulling blocks from a peer (which also presents a grant, below).
- ``SESSION``: ``session_key(S, worker_id, instance_id)``, known only to the Conductor and to
  the one worker *instance* that registered with that secret ``instance_id`` (a random value
  each process draws at start and sends only in ``Register``). A worker's heartbeats and the
  Conductor's calls to a worker (Prefill, Reserve, Decode, Release) use it, so no other
  process, member or not, can take a worker's place or drive a worker.
- ``OPEN``: nothing (health, reflection, and the public ``Generate``, which checks API keys
  itself: ``runtime.apikeys``).

A signature is accepted within ``MAX_SKEW_S`` of the server's clock and once (a nonce
cache), so a recorded call cannot be replayed. A refused call ends with UNAUTHENTICATED
(no or bad credential) or PERMISSION_DENIED (a valid member asking for what its principal
may not do) and is logged at WARNING with the caller's address.

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
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from runtime.grpc_server import TlsFiles, channel
from runtime.logs import Throttled

log = logging.getLogger(__name__)
_REFUSALS = Throttled(log)

PRINCIPAL_HEADER = "x-tidekv-principal"
AUTH_HEADER = "x-tidekv-auth"
CONDUCTOR = "conductor"
OPERATOR = "operator"
MAX_SKEW_S = 60.0
MIN_SECRET_BYTES = 32
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


class AuthError(Exception):
    """A credential that does not hold; ``code`` is the gRPC status to end the call with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


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


def _mac(key: bytes, principal: str, method: str, ms: int, nonce: str) -> str:
    return hmac.new(key, f"{principal}\n{method}\n{ms}\n{nonce}".encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, principal: str, method: str, now_s: float | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata proving ``principal`` holds ``key`` for one call of ``method``."""
    ms = int((time.time() if now_s is None else now_s) * 1000)
    nonce = secrets.token_hex(12)
    return ((PRINCIPAL_HEADER, principal), (AUTH_HEADER, f"{ms}.{nonce}.{_mac(key, principal, method, ms, nonce)}"))


class Nonces:
    """Nonces seen within the skew window (a signature is good once). Thread-safe."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._next_prune = 0.0

    def first_use(self, nonce: str, now_s: float) -> bool:
        with self._lock:
            if now_s >= self._next_prune:
                self._seen = {n: t for n, t in self._seen.items() if t > now_s}
                self._next_prune = now_s + 5.0
            if nonce in self._seen:
                return False
            self._seen[nonce] = now_s + 2 * MAX_SKEW_S
            return True


def verify(metadata: Mapping[str, str], method: str, key_for: Callable[[str], bytes | None],
           nonces: Nonces, now_s: float | None = None) -> str:
    """The principal the call's metadata proves, or AuthError. ``key_for(principal)`` is the
    key that principal must hold for this method (None: it may not call it)."""
    principal, token = metadata.get(PRINCIPAL_HEADER, ""), metadata.get(AUTH_HEADER, "")
    if not principal or not token:
        raise AuthError(grpc.StatusCode.UNAUTHENTICATED, f"{method} needs a cluster credential "
                        f"({PRINCIPAL_HEADER} and {AUTH_HEADER} metadata)")
    parts = token.split(".")
    if len(parts) != 3 or not parts[0].isdigit():
        raise AuthError(grpc.StatusCode.UNAUTHENTICATED, f"malformed {AUTH_HEADER}")
    ms, nonce, mac = int(parts[0]), parts[1], parts[2]
    now = time.time() if now_s is None else now_s
    if abs(now - ms / 1000) > MAX_SKEW_S:
        raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                        f"credential of {principal} is {now - ms / 1000:+.0f} s off this server's clock "
                        f"(limit {MAX_SKEW_S:.0f} s)")
    key = key_for(principal)
    if key is None:
        raise AuthError(grpc.StatusCode.PERMISSION_DENIED, f"{principal} may not call {method}")
    if not hmac.compare_digest(mac, _mac(key, principal, method, ms, nonce)):
        raise AuthError(grpc.StatusCode.UNAUTHENTICATED, f"bad credential for {principal} on {method}")
    if not nonces.first_use(nonce, now):
        raise AuthError(grpc.StatusCode.UNAUTHENTICATED, f"replayed credential of {principal} on {method}")
    return principal


# ---- server side -------------------------------------------------------------------------------
class Need(enum.Enum):
    OPEN = "open"
    MEMBER = "member"
    SESSION = "session"


@dataclass(frozen=True)
class Rules:
    """Per full method name (``/tidekv.v1.Registry/Heartbeat``), what a caller must prove; a
    method not named is refused (fail closed), except the open health and reflection services.
    ``session_key_for(principal)``: the SESSION key of that principal here, or None."""

    needs: Mapping[str, Need]
    secret: bytes
    session_key_for: Callable[[str], bytes | None]

    def key_for(self, method: str) -> Callable[[str], bytes | None]:
        need = self.needs[method]
        if need is Need.MEMBER:
            return lambda principal: self.secret
        return self.session_key_for


def current_principal(context: grpc.ServicerContext) -> str:
    """The principal a verified call came from (the interceptor checked the metadata)."""
    return dict(context.invocation_metadata()).get(PRINCIPAL_HEADER, "")


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks every call against ``Rules`` before the servicer sees it."""

    def __init__(self, rules: Rules):
        self.rules = rules
        self._nonces = Nonces()

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        method = details.method
        handler = continuation(details)
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        need = self.rules.needs.get(method)
        if need is Need.OPEN:
            return handler
        try:
            if need is None:
                raise AuthError(grpc.StatusCode.PERMISSION_DENIED, f"{method} is not served to anyone")
            verify(dict(details.invocation_metadata), method, self.rules.key_for(method), self._nonces)
        except AuthError as e:
            return _refusing(handler, e, method)
        return handler


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

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(lambda it, ctx: unary(None, ctx), **kw)
    return grpc.stream_stream_rpc_method_handler(lambda it, ctx: stream(None, ctx), **kw)


# ---- client side -------------------------------------------------------------------------------
class _Signer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, key: bytes, principal: str):
        self._key, self._principal = key, principal

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = (*(details.metadata or ()), *sign(self._key, self._principal, method))
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def signed(ch: grpc.Channel, key: bytes, principal: str) -> grpc.Channel:
    """``ch`` with every call signed as ``principal`` with ``key``."""
    return grpc.intercept_channel(ch, _Signer(key, principal))


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

    def channel(self, address: str, key: bytes | None = None) -> grpc.Channel:
        """A channel to ``address`` whose calls are signed with ``key`` (default: the secret)."""
        return signed(channel(address, self.tls), self.secret if key is None else key, self.principal)

    def interceptor(self, needs: Mapping[str, Need],
                    session_key_for: Callable[[str], bytes | None]) -> AuthInterceptor:
        return AuthInterceptor(Rules(needs, self.secret, session_key_for))


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

    def interceptor(self, needs: Mapping[str, Need]) -> AuthInterceptor:
        """SESSION calls to this worker are the Conductor's, signed with this instance's key."""
        return self.member.interceptor(needs, lambda p: self.session_key if p == CONDUCTOR else None)
