"""The one place mapping gRPC status codes back to ``kvtier.errors`` classes (client side)."""

from __future__ import annotations

import grpc

from kvtier.errors import (
    CapacityError,
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

# The daemon refused the call's token: TCP listeners need ``token=``; a daemon that checks
# tenants needs ``tenant_token=`` (PermissionDenied: a valid token of someone else).
__all__ = ["PermissionDenied", "Unauthenticated", "from_rpc_error"]


def from_rpc_error(err: grpc.RpcError) -> KVTierError:
    """A kvtier exception for a failed call; the RpcError stays as ``__cause__``."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    text = (err.details() if hasattr(err, "details") else "") or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, sep, msg = text.partition(": ")
        return InvalidArgument(field, msg) if sep else InvalidArgument("request", text)
    simple: dict[grpc.StatusCode, type[KVTierError]] = {
        grpc.StatusCode.NOT_FOUND: NotFound,
        grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
        grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
        grpc.StatusCode.UNAVAILABLE: Unavailable,
        grpc.StatusCode.CANCELLED: Unavailable,
        grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
        grpc.StatusCode.DATA_LOSS: PageLost,
        grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
        grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    }
    cls = simple.get(code, KVTierError)
    return cls(f"{text} [{code.name}]" if cls is KVTierError else text)
