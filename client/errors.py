"""gRPC status codes back to ``kvtier.errors`` classes (client side).

The table is ``kvtier.errors.STATUS_CODES``, the one the daemon maps errors with; here only the
INVALID_ARGUMENT text is split back into its field and message.
"""

from __future__ import annotations

import grpc

from kvtier.errors import (
    STATUS_CODES,
    InvalidArgument,
    KVTierError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)

# The daemon refused the call's token: TCP listeners need ``token=``; a daemon that checks
# tenants needs ``tenant_token=`` (PermissionDenied: a valid token of someone else).
# Unavailable: re-exported for the clients' retry paths (sync.py, aio.py).
__all__ = ["PermissionDenied", "Unauthenticated", "Unavailable", "from_rpc_error"]



def _classes_by_code() -> dict[grpc.StatusCode, type[KVTierError]]:
    """``kvtier.errors.STATUS_CODES`` read from the client's side: each code's first row wins."""
    classes: dict[grpc.StatusCode, type[KVTierError]] = {}
    for cls, name in STATUS_CODES:
        classes.setdefault(grpc.StatusCode[name], cls)
    return classes


_CLASSES = _classes_by_code()


def from_rpc_error(err: grpc.RpcError) -> KVTierError:
    """A kvtier exception for a failed call; the RpcError stays as ``__cause__``."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    text = (err.details() if hasattr(err, "details") else "") or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, sep, msg = text.partition(": ")
        return InvalidArgument(field, msg) if sep else InvalidArgument("request", text)
    cls = _CLASSES.get(code, KVTierError)
    return cls(f"{text} [{code.name}]" if cls is KVTierError else text)
