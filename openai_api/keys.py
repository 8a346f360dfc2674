"""The caller's credentials: checked at the front before its body is read, forwarded to the Conductor.

The Conductor decides a request's tenant from its API key (``conductor.apikeys``), for gRPC
and HTTP alike; the front forwards ``Authorization: Bearer ...`` as gRPC metadata. Given the
same keys file (``--api-keys``, SHA-256 digests only, re-read when it changes), the front also
refuses a missing, malformed, unknown or revoked key itself, from the headers alone, so a
client without a key cannot make it read, buffer or parse a body (401, and the connection is
closed when a body was announced). Without the file the front checks only that the header is
printable ASCII and leaves the decision to the Conductor.
"""

from __future__ import annotations

from starlette.requests import Request

from conductor.apikeys import ApiKeys
from openai_api.body import CLOSE, has_body
from openai_api.errors import ApiError
from runtime.auth import AuthError

Metadata = tuple[tuple[str, str], ...]


def _unauthenticated(message: str, request: Request) -> ApiError:
    return ApiError(401, message, "authentication_error", code="invalid_api_key",
                    headers=dict(CLOSE) if has_body(request) else {})


class FrontKeys:
    """Thread-safe (``ApiKeys`` locks its reloads)."""

    def __init__(self, path: str = ""):
        self.path = path
        self._keys = ApiKeys(path) if path else None

    def credentials(self, request: Request) -> Metadata:
        """The gRPC metadata for this request's Generate call; ApiError 401 when the front
        holds the keys and the request's is missing or unknown."""
        auth = request.headers.get("authorization", "")
        if auth and not (auth.isascii() and auth.isprintable()):
            raise _unauthenticated("the Authorization header must be printable ASCII", request)
        if self._keys is not None:
            try:
                self._keys.authenticate((("authorization", auth),))
            except AuthError as e:
                raise _unauthenticated(str(e), request) from None
        return (("authorization", auth),) if auth else ()
