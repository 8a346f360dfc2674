"""A request body read and parsed within the front's limits: size, time, JSON nesting.

``read_body`` refuses a body over ``max_body_bytes`` from its Content-Length before reading a
byte of it, and a chunked (or lying) one as soon as what arrived passes the limit, so a
request never holds more than the limit in memory; the whole body must arrive within
``body_timeout_s`` of the headers. Each refusal asks for the connection to be closed
(``Connection: close``): the rest of the body is never read.

``parse_json`` checks the nesting of ``[`` and ``{`` before ``json.loads`` runs, because the
parser recurses once per level (a 200k-deep body raised RecursionError). The check runs at C
speed on the bytes (``nesting_exceeds``): escapes and strings are removed, only the brackets
kept, and the deepest level is the running sum's maximum (numpy; about 20 ms and 20 MB for a
4 MiB body of nothing but brackets).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

import numpy as np
from starlette.requests import ClientDisconnect, Request

from openai_api.errors import ApiError, invalid

CLOSE = {"Connection": "close"}
_STRING = re.compile(rb'"[^"]*"')  # after escapes are neutralized, a string holds no quote
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(frozen=True)
class BodyLimits:
    max_body_bytes: int
    max_json_depth: int
    body_timeout_s: float


class Disconnected(Exception):
    """The client went away while its body was being read: nobody waits for an answer."""


def too_large(size: int | str, limits: BodyLimits) -> ApiError:
    return ApiError(413, f"the request body is {size} bytes; this server takes at most {limits.max_body_bytes} "
                         f"bytes (max_body_bytes)", code="request_too_large", headers=dict(CLOSE))


def has_body(request: Request) -> bool:
    """Whether the request announces a body (a non-zero Content-Length, or chunked)."""
    length = request.headers.get("content-length", "")
    return (length not in ("", "0")) or "chunked" in request.headers.get("transfer-encoding", "").lower()


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The whole body; ApiError 413 (too large), 408 (too slow) or 400 (a bad Content-Length),
    Disconnected when the client left."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise invalid(None, f"Content-Length must be a number of bytes, got {length[:32]!r}")
        if int(length) > limits.max_body_bytes:
            raise too_large(length, limits)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise too_large(f"more than {limits.max_body_bytes}", limits)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s "
                            f"(body_timeout_s); {size} bytes came", code="request_timeout",
                       headers=dict(CLOSE)) from None
    except ClientDisconnect:
        raise Disconnected() from None
    return b"".join(chunks)


def nesting_exceeds(body: bytes, max_depth: int) -> bool:
    """Whether the JSON text ``body`` nests ``[``/``{`` deeper than ``max_depth`` (strings and
    escapes do not count). On text that is not JSON the answer only bounds what the parser
    would do; the parser then refuses it."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")  # left to right, as escapes pair
    brackets = np.frombuffer(_STRING.sub(b"", text).translate(None, _NOT_BRACKETS), np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int8)
    return bool(steps.size) and int(np.cumsum(steps, dtype=np.int32).max()) > max_depth


def parse_json(body: bytes, limits: BodyLimits) -> object:
    """The body as a JSON value; ApiError 400 for text that is not JSON or nests too deep."""
    deep = ApiError(400, f"the request body nests deeper than {limits.max_json_depth} levels (max_json_depth)",
                    code="json_too_deep")
    if nesting_exceeds(body, limits.max_json_depth):
        raise deep
    try:
        return json.loads(body)
    except RecursionError:  # not reachable past the check above; kept as a guard
        raise deep from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise invalid(None, "the request body is not valid JSON") from None
