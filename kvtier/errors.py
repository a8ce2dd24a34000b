"""The one error hierarchy of kvtier.

Every error a caller can see derives from :class:`KVTierError`. Capacity shortfall is *not* an
exception inside the engine (it is an ordinary return value); :class:`CapacityError` exists for the
edges (client, servicer) that must turn a shortfall into a status. Only the gRPC servicer maps these
classes to status codes (see ``kvtier.server.errors``); the client maps status codes back
(``kvtier.client.errors``). Both read the one table here, :data:`STATUS_CODES`.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every kvtier error."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is invalid. The message names the variable/flag and accepted values."""


class InvalidArgument(KVTierError, ValueError):
    """A request field is invalid. ``field`` names it; nothing was changed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(KVTierError, KeyError):
    """An id (pool, page, key) is unknown to the caller's tenant. Never reveals other tenants."""

    def __str__(self) -> str:  # KeyError quotes its message; we want plain text
        return str(self.args[0]) if self.args else "not found"


class FailedPrecondition(KVTierError):
    """The call is valid but the object is not in a state that allows it (e.g. not attached)."""


class CapacityError(KVTierError):
    """A budget is full and nothing could be evicted (pinned or in flight)."""


class Unauthenticated(KVTierError):
    """The call's credentials are missing or nobody's (a TCP bearer token, a tenant token)."""


class PermissionDenied(Unauthenticated):
    """Valid credentials, but not for what the call asks (another tenant's, the daemon-wide
    view without the admin's)."""


class PageLost(KVTierError):
    """A page's bytes were dropped (disk full, checksum failure); the caller must recompute them."""


class Unavailable(KVTierError):
    """The engine or daemon is shutting down; retry against a new instance."""


class DeadlineExceeded(KVTierError, TimeoutError):
    """A bounded wait ran out (a restore, a transfer, a drain)."""


class CorruptPage(KVTierError):
    """Stored bytes failed their checksum. Raised inside tiers; the engine turns it into a miss."""


# The one error <-> status table, by gRPC status code *name* (this module does not import grpc).
# Server (error -> code): the first row whose class the error is an instance of, so a subclass is
# listed before its base (PermissionDenied before Unauthenticated). Client (code -> error): the
# first row naming the code, so the class a caller should catch comes first (InvalidArgument before
# ConfigError, PageLost before CorruptPage). A row no error reaches first on the server side maps
# a code only the client sees (CANCELLED: the call was cancelled or the channel dropped).
STATUS_CODES: tuple[tuple[type[KVTierError], str], ...] = (
    (InvalidArgument, "INVALID_ARGUMENT"),
    (ConfigError, "INVALID_ARGUMENT"),
    (NotFound, "NOT_FOUND"),
    (FailedPrecondition, "FAILED_PRECONDITION"),
    (CapacityError, "RESOURCE_EXHAUSTED"),
    (Unavailable, "UNAVAILABLE"),
    (Unavailable, "CANCELLED"),
    (DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (PageLost, "DATA_LOSS"),
    (CorruptPage, "DATA_LOSS"),
    (PermissionDenied, "PERMISSION_DENIED"),
    (Unauthenticated, "UNAUTHENTICATED"),
)

