"""Which client session holds each pool (the lease), and whose pools are orphaned.

A session is one connection to the session socket (``server/fdpass.py``). Pure state, no timing:
the session socket decides when an orphaned pool is detached. Thread-safe.

Contract:
    * ``open() -> session``: a new live session id.
    * ``bind(pool_id, session) -> bool``: the pool now belongs to ``session``; ``False`` when that
      session has already closed (the pool is then orphaned at once: the caller reaps it later).
    * ``close(session) -> list[pool_id]``: the session is gone; its pools are now orphaned.
    * ``rebind(pool_id, session) -> bool``: a live ``session`` takes over a pool whose session
      closed and that was not reaped yet (a client that reconnected within the grace).
    * ``reap(pools) -> list[pool_id]``: of ``pools``, those still orphaned, which stop being
      tracked (the caller detaches them).
    * ``forget(pool_id)``: the pool was detached by its client; nothing more to do for it.
    * ``holders()``: the sessions that hold a pool now.
    * Unbound pools (a ticket never redeemed: a TCP client in CUDA mode) are never reaped.
"""

from __future__ import annotations

import itertools
import threading


class Leases:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._live: set[int] = set()
        self._holder: dict[int, int] = {}  # pool_id -> session (live or closed)

    def open(self) -> int:
        with self._lock:
            session = next(self._ids)
            self._live.add(session)
            return session

    def bind(self, pool_id: int, session: int) -> bool:
        with self._lock:
            self._holder[pool_id] = session
            return session in self._live

    def rebind(self, pool_id: int, session: int) -> bool:
        with self._lock:
            holder = self._holder.get(pool_id)
            if holder is None or session not in self._live:
                return False
            if holder != session and holder in self._live:
                return False  # held by another live session
            self._holder[pool_id] = session
            return True

    def close(self, session: int) -> list[int]:
        with self._lock:
            self._live.discard(session)
            return [p for p, s in self._holder.items() if s == session]

    def reap(self, pools: list[int]) -> list[int]:
        with self._lock:
            gone = [p for p in pools if p in self._holder and self._holder[p] not in self._live]
            for p in gone:
                del self._holder[p]
            return gone

    def forget(self, pool_id: int) -> None:
        with self._lock:
            self._holder.pop(pool_id, None)

    def holders(self) -> set[int]:
        """The sessions holding at least one pool."""
        with self._lock:
            return set(self._holder.values())

    def held(self, session: int) -> list[int]:
        """The pools a session holds (live or not), for tests and status."""
        with self._lock:
            return [p for p, s in self._holder.items() if s == session]
