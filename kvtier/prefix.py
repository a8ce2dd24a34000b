"""Prefix reuse: content-keyed blocks stored, looked up and loaded per tenant.

Contract:
    * Keys are the engine's chained block hashes; inside the engine each key is salted with its
      tenant (``blake2b(key, key=H(tenant))``), so one tenant can't even name another's blocks and
      nothing is shared across tenants.
    * ``store`` copies pool slots into *keyed pages* that live in the CPU tier (and may cascade to
      disk like any page); a key already stored is counted as stored and not rewritten.
    * ``lookup`` returns the tier of each block of the longest stored prefix (stops at the first
      miss); ``load`` copies that prefix into the given slots, restoring disk blocks through CPU
      first, and returns how many leading blocks it loaded. A block whose bytes fail their checksum
      ends the prefix: a hit is exactly the stored bytes, or a miss.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

from kvtier.core import EngineCore
from kvtier.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from kvtier.pagetable import Page
from kvtier.pool import Pool
from kvtier.transfer.base import Move
from kvtier.types import Direction, PageState, PoolId, Tier
from kvtier.validate import check_keys, check_name, check_slots


def salt_key(tenant: str, key: bytes) -> bytes:
    tenant_key = hashlib.blake2b(tenant.encode(), digest_size=32, person=b"kvtier-tenant").digest()
    return hashlib.blake2b(key, key=tenant_key, digest_size=16).digest()


class PrefixStore:
    def __init__(self, core: EngineCore) -> None:
        self._core = core

    def _pool(self, pool_id: PoolId) -> Pool:
        if self._core.closed:
            raise Unavailable("the engine is shut down")
        pool = self._core.pools.get(pool_id)
        if pool is None:
            raise NotFound(f"pool {pool_id} not found")
        return pool

    def _args(
        self, pool: Pool, keys: Sequence[bytes], slots: Sequence[int]
    ) -> tuple[list[bytes], list[int]]:
        keys = check_keys("keys", keys)
        slots = check_slots("slots", slots, pool.num_slots)
        if len(keys) != len(slots):
            raise InvalidArgument(
                "slots", f"need one slot per key ({len(keys)} keys, {len(slots)} slots)"
            )
        if not pool.external:
            for s in slots:
                page = pool.slot_pages.get(s)
                if page is None or page.pins == 0:
                    raise FailedPrecondition(
                        f"slots: slot {s} holds no acquired page of pool {pool.pool_id}"
                    )
        return keys, slots

    def store(self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        core = self._core
        with core.cond:
            pool = self._pool(pool_id)
            keys, slots = self._args(pool, keys, slots)
            moves: list[Move] = []
            stored = 0
            seen: set[bytes] = set()
            for key, slot in zip(keys, slots, strict=True):
                salted = salt_key(pool.tenant, key)
                if salted in seen or core.table.keyed(salted) is not None:
                    stored += 1  # already stored: its bytes are not rewritten
                    continue
                seen.add(salted)
                got = core.cpu_slots(pool.page_size, 1)
                if not got:
                    break
                page = Page(
                    core.table.new_id(),
                    None,
                    pool.tenant,
                    pool.page_size,
                    PageState.MOVING_DOWN,
                    Tier.CPU,
                    got[0],
                    key=salted,
                )
                core.table.add(page)
                moves.append(
                    Move(
                        Direction.GPU_TO_CPU,
                        pool.page_size,
                        slot,
                        got[0],
                        page=page,
                        pool=pool.dev,
                        copy=True,
                    )
                )
            core.scheduler.submit(moves)
            self._wait(moves)
            for move in moves:
                new = move.page
                assert new is not None
                if move.result:
                    core.settle(new, Tier.CPU, move.dst)
                    stored += 1
                else:
                    core.host.free(new.page_size, [move.dst])
                    core.table.remove(new)
            return stored

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> list[Tier]:
        check_name("tenant", tenant)
        keys = check_keys("keys", keys)
        core = self._core
        with core.cond:
            tiers: list[Tier] = []
            for key in keys:
                page = core.table.keyed(salt_key(tenant, key))
                if page is None or page.state is PageState.DROPPED:
                    core.counters.misses += 1
                    break
                tiers.append(page.tier)
                core.counters.hits[page.tier] += 1
            return tiers

    def load(self, pool_id: PoolId, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        core = self._core
        with core.cond:
            pool = self._pool(pool_id)
            keys, slots = self._args(pool, keys, slots)
            pages = self._resident_prefix(pool, keys)
            core.protect(p.page_id for p in pages)
            for page in pages:
                page.pins += 1
            try:
                moves = [
                    Move(
                        Direction.CPU_TO_GPU,
                        pool.page_size,
                        p.slot,
                        s,
                        page=p,
                        pool=pool.dev,
                        copy=True,
                        urgent=True,
                    )
                    for p, s in zip(pages, slots, strict=False)
                ]
                core.scheduler.submit(moves)
                self._wait(moves)
            finally:
                core.unprotect(p.page_id for p in pages)
                for page in pages:
                    page.pins -= 1
                    core.policy_of(page).touch(page.page_id)
                    page.hits += 1
            loaded = 0
            for move in moves:
                if not move.result:
                    break
                loaded += 1
            return loaded

    def _resident_prefix(self, pool: Pool, keys: list[bytes]) -> list[Page]:
        """Pages of the longest stored prefix, each brought to (and settled in) the CPU tier."""
        core = self._core
        deadline = time.monotonic() + core.config.restore_timeout_s
        while True:
            pages: list[Page] = []
            for key in keys:
                page = core.table.keyed(salt_key(pool.tenant, key))
                if (
                    page is None
                    or page.state is PageState.DROPPED
                    or page.page_size != pool.page_size
                ):
                    break
                pages.append(page)
            waiting = [p for p in pages if p.state is not PageState.CPU]
            if not waiting:
                return pages
            for page in waiting:
                if page.state is PageState.DISK:
                    core.restore_disk([page])
                elif page.state is PageState.MOVING_DOWN:
                    core.cancel(page)
            if time.monotonic() > deadline:
                raise DeadlineExceeded("load: restoring stored blocks from disk timed out")
            core.cond.wait(0.05)

    def _wait(self, moves: list[Move]) -> None:
        deadline = time.monotonic() + self._core.config.restore_timeout_s
        while any(m.result is None for m in moves):
            if time.monotonic() > deadline:
                raise DeadlineExceeded("copy of stored blocks timed out")
            self._core.cond.wait(0.05)
