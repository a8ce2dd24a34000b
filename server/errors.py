"""The one place that maps kvtier errors to gRPC status codes.

The client maps the codes back (``kvtier.client.errors``). Anything outside the kvtier hierarchy is
an internal bug: it becomes INTERNAL with a generic message (details go to the log only).
"""

from __future__ import annotations

import grpc

from kvtier.errors import (
    CapacityError,
    ConfigError,
    CorruptPage,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVTierError,
    NotFound,
    PageLost,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)

_CODES: tuple[tuple[type[KVTierError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PageLost, grpc.StatusCode.DATA_LOSS),
    (CorruptPage, grpc.StatusCode.DATA_LOSS),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),  # before its base class
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
)


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
