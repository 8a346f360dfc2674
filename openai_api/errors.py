"""Errors of the HTTP front in OpenAI's JSON shape, and the gRPC status -> HTTP status mapping.

Every error a client sees is ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status OpenAI uses for it. ``ApiError`` is raised anywhere in a handler and rendered once, by
the app's exception handler. ``from_rpc`` maps a refused ``Generate`` call:

    INVALID_ARGUMENT    400  the Conductor's message, its field renamed to the OpenAI one
    UNAUTHENTICATED     401  (API keys: the Conductor's decision, conductor.apikeys)
    PERMISSION_DENIED   403
    RESOURCE_EXHAUSTED  429  Retry-After from trailing metadata ``retry-after-s``
                        413  when gRPC refused the message's size (the Conductor's --max-request-bytes)
    UNAVAILABLE         503  (Conductor unreachable, no worker could take the request)
    DEADLINE_EXCEEDED   504
    anything else       500
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

_LEADING_FIELD = re.compile(r"^(?:sampling\.)?([a-z_]+)")


@dataclass(eq=False)
class ApiError(Exception):
    """An HTTP error answer; ``headers`` carry e.g. ``Retry-After``."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str) -> ApiError:
    """A 400 for a bad request field; the message must name the field."""
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def retry_after_s(metadata: object) -> int:
    """Whole seconds for ``Retry-After`` from the ``retry-after-s`` trailing metadata (>= 1)."""
    for key, value in metadata or ():
        if key == "retry-after-s":
            try:
                return max(1, math.ceil(float(value)))
            except ValueError:
                break
    return 1


def rename_field(message: str, names: Mapping[str, str]) -> tuple[str, str | None]:
    """The Conductor names its own fields (``sampling.max_tokens``, ``token_ids``); a client
    must see the OpenAI field it sent. Returns (message, param)."""
    m = _LEADING_FIELD.match(message)
    if m is None or m.group(1) not in names:
        return message, None
    param = names[m.group(1)]
    return param + message[m.end():], param


def from_rpc(code: grpc.StatusCode, details: str, trailing: object, names: Mapping[str, str]) -> ApiError:
    """The HTTP error for a ``Generate`` call that ended with a non-OK status."""
    details = details or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        message, param = rename_field(details, names)
        return invalid(param, message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return ApiError(413, f"the request is larger than the Conductor accepts: {details}",
                        code="request_too_large")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        headers = {"Retry-After": str(retry_after_s(trailing))}
        return ApiError(429, details, "rate_limit_error", code="rate_limit_exceeded", headers=headers)
    if code == grpc.StatusCode.UNAVAILABLE:  # also: no worker of a role has registered yet
        headers = {"Retry-After": str(retry_after_s(trailing))}
        return ApiError(503, details, "service_unavailable_error", code="service_unavailable", headers=headers)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, details, "timeout_error", code="timeout")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ApiError(401, details, "authentication_error", code="invalid_api_key")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return ApiError(403, details, "permission_error", code="permission_denied")
    if code == grpc.StatusCode.ALREADY_EXISTS:  # a request id (X-Request-Id) already in flight for the tenant
        return ApiError(409, details, "conflict_error", code="request_id_in_use")
    return ApiError(500, details, "server_error", code=code.name.lower())
