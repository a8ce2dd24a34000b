"""Which pools a caller may use.

Every pool-scoped call names (tenant, pool_id, instance). A pool that is unknown, detached or owned
by another tenant is NOT_FOUND with one message for all three, so nothing about other tenants leaks.
A pool named with another daemon instance is FAILED_PRECONDITION: the daemon restarted and the
pool is gone (a new pool may even reuse the id).
"""

from __future__ import annotations

from typing import Any, Protocol

from kvtier.errors import FailedPrecondition, InvalidArgument, NotFound
from kvtier.types import PoolId

from . import validate


class _PoolRef(Protocol):
    tenant: str
    pool_id: int
    instance: str


class Tenancy:
    """Checks pool ownership against the engine's own record of each pool's tenant."""

    def __init__(self, engine: Any, instance: str) -> None:
        self._engine = engine
        self.instance = instance

    def owned(self, ref: _PoolRef, *, present: bool = True) -> PoolId:
        """The pool id of ``ref`` if its tenant owns it, else NotFound/FailedPrecondition."""
        if not present:
            raise InvalidArgument("pool", "must be set")
        tenant = validate.tenant(ref.tenant, "pool.tenant")
        pool_id = validate.non_negative(ref.pool_id, "pool.pool_id")
        if ref.instance and ref.instance != self.instance:
            raise FailedPrecondition(f"pool {pool_id} is not attached (daemon restarted?)")
        try:
            owner = self._engine.pool(PoolId(pool_id)).tenant
        except (NotFound, FailedPrecondition):
            owner = None
        if owner != tenant:
            raise NotFound(f"pool {pool_id} not found")
        return PoolId(pool_id)

    def owner(self, pool_id: int) -> str | None:
        """The tenant of a live pool, None if it is gone."""
        try:
            return str(self._engine.pool(PoolId(pool_id)).tenant)
        except (NotFound, FailedPrecondition):
            return None
