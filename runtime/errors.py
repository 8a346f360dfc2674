"""The refusals a server gives a caller, as typed errors: each one names the gRPC status it
ends the call with, in one place, so a server maps exactly these to statuses and lets anything
else (an internal bug) end the call as UNKNOWN, never as the caller's fault.

    InvalidRequest   INVALID_ARGUMENT      the call itself is malformed (the numbers in the message)
    Conflict         ALREADY_EXISTS        the id is in use here
    NoReservation    FAILED_PRECONDITION   what the call builds on is not here (expired, released)
    NoRoom           RESOURCE_EXHAUSTED    no room now; another worker may have some
    Unavailable      UNAVAILABLE           this process cannot serve it now (draining)
"""

from __future__ import annotations

import grpc


class Refusal(Exception):
    """A caller's call refused with ``code``; ``abort(context)`` ends it so."""

    code = grpc.StatusCode.UNKNOWN

    def abort(self, context: grpc.ServicerContext) -> None:
        context.abort(self.code, str(self))


class InvalidRequest(Refusal):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Conflict(Refusal):
    code = grpc.StatusCode.ALREADY_EXISTS


class NoReservation(Refusal):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NoRoom(Refusal):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(Refusal):
    code = grpc.StatusCode.UNAVAILABLE
