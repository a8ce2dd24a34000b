"""One-time tickets for memory that travels as file descriptors, never as names.

A ticket is 32 random bytes; the registry keeps only its SHA-256, so no secret sits in memory
dumps or logs. Every ticket is single-use, bound to the tenant it was issued to, and expires after
``ttl`` seconds. Thread-safe (gRPC worker threads issue and take, the session socket redeems).

Contract:
    * ``issue(tenant, pool_id, fd) -> ticket``: Attach/Register's lease ticket. ``fd`` (CPU mode:
      the pool's memfd, or -1) is duplicated; the registry owns the copy until it is redeemed.
    * ``redeem(ticket, tenant) -> (pool_id, fd) | None``: the pool and its descriptor (-1 for a
      CUDA pool), which the caller now owns; ``None`` for an unknown, used, expired or other
      tenant's ticket (nothing changes then).
    * ``renewable(ticket, tenant) -> pool_id | None``: a redeemed ticket keeps proving that its
      holder leased the pool (no memory comes with it), until ``forget_pool(pool_id)``.
    * ``forget_pool(pool_id)``: the pool is gone (detached): its ticket, redeemed or not, is
      dropped and the descriptor an unredeemed one held is closed (it would otherwise keep the
      pool's memory for the rest of the ticket's ``ttl``: a client attaching and detaching
      without redeeming piled up one descriptor per pool).
    * ``deposit(tenant, fd, conn) -> ticket | None``: a client's memfd (the registry owns ``fd``
      from here on, even on ``None``: at most ``MAX_DEPOSITS`` per connection and
      ``max_total`` in all, each holding a daemon descriptor until taken or expired). With
      ``max_total`` held, a deposit takes the place of the oldest one of the connection holding
      the most, if that one holds more than this connection would: one client's many
      connections can't keep every other client's Register out (tenant names in a deposit are
      the client's say-so; connections are what it can't forge).
    * ``take_deposit(ticket, tenant) -> (fd, conn) | None``: as ``redeem``, for deposits.
    * ``drop_conn(conn)``: a closed connection's deposits are closed.
    * ``expire(now) -> list[pool_id]``: drops expired tickets; returns the pools of expired memfd
      tickets (nobody can ever map them: the caller detaches them).
    * ``close()``: every descriptor held is closed.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass

from .handed import close_handed

TICKET_BYTES = 32
MAX_DEPOSITS = 64  # unredeemed deposits per connection (each holds a daemon descriptor)


@dataclass(slots=True)
class _Entry:
    tenant: str
    fd: int
    expires: float
    pool_id: int = -1  # pool tickets
    conn: int = -1  # deposits: the connection that brought the descriptor


def _key(ticket: bytes) -> bytes:
    return hashlib.sha256(ticket).digest()


class Tickets:
    def __init__(self, ttl: float = 30.0, max_total: int = 4096) -> None:
        self.ttl, self.max_total = ttl, max_total
        self._lock = threading.Lock()
        self._pools: dict[bytes, _Entry] = {}
        self._deposits: dict[bytes, _Entry] = {}
        self._renewals: dict[bytes, tuple[str, int]] = {}  # redeemed: key -> (tenant, pool)
        self._pool_keys: dict[int, bytes] = {}  # redeemed: pool -> key
        self._issued: dict[int, bytes] = {}  # unredeemed: pool -> key

    def issue(self, tenant: str, pool_id: int, fd: int) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        entry = _Entry(tenant, os.dup(fd) if fd >= 0 else -1, time.monotonic() + self.ttl, pool_id)
        with self._lock:
            self._pools[_key(ticket)] = entry
            self._issued[pool_id] = _key(ticket)
        return ticket

    def redeem(self, ticket: bytes, tenant: str) -> tuple[int, int] | None:
        entry = self._take(self._pools, ticket, tenant)
        if entry is None:
            return None
        with self._lock:
            self._issued.pop(entry.pool_id, None)
            self._renewals[_key(ticket)] = (tenant, entry.pool_id)
            self._pool_keys[entry.pool_id] = _key(ticket)
        return entry.pool_id, entry.fd

    def redeemable(self, ticket: bytes, tenant: str) -> bool:
        """Whether ``redeem`` would take ``ticket`` now (nothing is taken)."""
        if len(ticket) != TICKET_BYTES:
            return False
        with self._lock:
            entry = self._pools.get(_key(ticket))
            return entry is not None and entry.tenant == tenant and (
                entry.expires >= time.monotonic())

    def renewable(self, ticket: bytes, tenant: str) -> int | None:
        with self._lock:
            got = self._renewals.get(_key(ticket)) if len(ticket) == TICKET_BYTES else None
        return got[1] if got is not None and got[0] == tenant else None

    def forget_pool(self, pool_id: int) -> None:
        with self._lock:
            key = self._pool_keys.pop(pool_id, None)
            if key is not None:
                self._renewals.pop(key, None)
            key = self._issued.pop(pool_id, None)
            entry = self._pools.pop(key, None) if key is not None else None
        if entry is not None and entry.fd >= 0:
            os.close(entry.fd)

    def deposit(self, tenant: str, fd: int, conn: int) -> bytes | None:
        ticket = secrets.token_bytes(TICKET_BYTES)
        evicted = -1
        with self._lock:
            held = sum(1 for e in self._deposits.values() if e.conn == conn)
            if held < MAX_DEPOSITS and len(self._deposits) >= self.max_total:
                evicted = self._make_room(held + 1)
            if held < MAX_DEPOSITS and len(self._deposits) < self.max_total:
                self._deposits[_key(ticket)] = _Entry(
                    tenant, fd, time.monotonic() + self.ttl, conn=conn)
                fd = -1
        if evicted >= 0:
            close_handed([evicted])
        if fd < 0:
            return ticket
        close_handed([fd])
        return None

    def _make_room(self, would_hold: int) -> int:
        """Lock held: drop the oldest deposit of the connection holding the most, if it holds
        more than ``would_hold``; its descriptor (to close after the lock), or -1."""
        counts = Counter(e.conn for e in self._deposits.values())
        conn, most = counts.most_common(1)[0]
        if most <= would_hold:
            return -1
        key = next(k for k, e in self._deposits.items() if e.conn == conn)  # oldest: first in
        return self._deposits.pop(key).fd

    def take_deposit(self, ticket: bytes, tenant: str) -> tuple[int, int] | None:
        entry = self._take(self._deposits, ticket, tenant)
        return None if entry is None else (entry.fd, entry.conn)

    def _take(self, table: dict[bytes, _Entry], ticket: bytes, tenant: str) -> _Entry | None:
        if len(ticket) != TICKET_BYTES:
            return None
        key = _key(ticket)
        with self._lock:
            entry = table.get(key)
            if entry is None or entry.tenant != tenant or entry.expires < time.monotonic():
                return None
            del table[key]
        return entry

    def drop_conn(self, conn: int) -> None:
        with self._lock:
            gone = [k for k, e in self._deposits.items() if e.conn == conn]
            fds = [self._deposits.pop(k).fd for k in gone]
        close_handed(fds)

    def expire(self, now: float | None = None) -> list[int]:
        now = time.monotonic() if now is None else now
        with self._lock:
            old_pools = [k for k, e in self._pools.items() if e.expires < now]
            old_deps = [k for k, e in self._deposits.items() if e.expires < now]
            pools = [self._pools.pop(k) for k in old_pools]
            for k, e in zip(old_pools, pools, strict=True):
                if self._issued.get(e.pool_id) == k:
                    del self._issued[e.pool_id]
            deps = [self._deposits.pop(k) for k in old_deps]
        close_handed(e.fd for e in pools + deps if e.fd >= 0)
        return [e.pool_id for e in pools if e.fd >= 0]

    def close(self) -> None:
        with self._lock:
            entries = [*self._pools.values(), *self._deposits.values()]
            self._pools.clear()
            self._deposits.clear()
            self._issued.clear()
        close_handed(e.fd for e in entries if e.fd >= 0)
