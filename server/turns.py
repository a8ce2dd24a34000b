"""Calls of one tenant at once, bounded: one tenant's many slow calls can't hold every worker.

The daemon runs calls on a fixed pool of worker threads. A tenant with more slow calls in
flight than there are workers (Loads read from disk, by the dozen) queued every other tenant's
calls behind its own: on a 2-core dev VM a neighbour's Stats took 410 ms instead of 3 with 40
such Loads in flight. Each tenant now runs at most ``per_tenant`` calls at once; the others
wait their turn on the event loop, holding no thread, in the order they came.

Contract (event-loop thread only, no locking):
    * ``Turns(per_tenant)``; ``async with turns.turn(tenant):`` runs the body once fewer than
      ``per_tenant`` calls of ``tenant`` are running. ``running(tenant)`` says how many are.
      A tenant with nothing running or waiting is forgotten (names are the client's say-so
      without a tenants file: no state grows with them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Turns:
    def __init__(self, per_tenant: int) -> None:
        self.per_tenant = per_tenant
        self._tenants: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    @asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        entry = self._tenants.get(tenant)
        if entry is None:
            entry = self._tenants[tenant] = (asyncio.Semaphore(self.per_tenant), [0, 0])
        gate, counts = entry
        counts[0] += 1  # running or waiting
        try:
            async with gate:
                counts[1] += 1
                try:
                    yield
                finally:
                    counts[1] -= 1
        finally:
            counts[0] -= 1
            if counts[0] == 0:
                del self._tenants[tenant]

    def running(self, tenant: str) -> int:
        entry = self._tenants.get(tenant)
        return entry[1][1] if entry is not None else 0
