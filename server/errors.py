"""The one place that maps kvtier errors to gRPC status codes.

The table itself is ``kvtier.errors.STATUS_CODES``, shared with the client, which maps the codes
back (``kvtier.client.errors``). Anything outside the kvtier hierarchy is an internal bug: it
becomes INTERNAL with a generic message (details go to the log only).
"""

from __future__ import annotations

import grpc

from kvtier.errors import STATUS_CODES, CapacityError

# The table lives in kvtier.errors (the client reads it too); here its names become grpc codes.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = tuple(
    (cls, grpc.StatusCode[name]) for cls, name in STATUS_CODES)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message) for an exception raised while serving a call."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc) or cls.__name__
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
    return grpc.StatusCode.INTERNAL, "internal error (see the daemon log)"


def is_internal(exc: BaseException) -> bool:
    return status_for(exc)[0] == grpc.StatusCode.INTERNAL


def shortfall(what: str) -> CapacityError:
    """A capacity shortfall (the engine returned None), reported as RESOURCE_EXHAUSTED."""
    return CapacityError(what)
