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
from kvtier.transfer.base import Moves
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
            pending = _Copies(pool, Direction.GPU_TO_CPU)
            started: list[Moves] = []  # submitted early while waiting for room
            stored = 0
            seen: set[bytes] = set()
            for key, slot in zip(keys, slots, strict=True):
                salted = salt_key(pool.tenant, key)
                if salted in seen or core.table.keyed(salted) is not None:
                    stored += 1  # already stored: its bytes are not rewritten
                    continue
                seen.add(salted)
                got = self._cpu_slot(pool.page_size, pending, started)
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
                pending.add(page, slot, got[0])
            started += pending.submit(core)
            self._wait(started)
            return stored + sum(r is True for b in started for r in b.results or ())

    def _cpu_slot(self, page_size: int, pending: _Copies, started: list[Moves]) -> list[int]:
        """A CPU slot for a stored block, waiting (bounded) while the cascade frees one.

        A full CPU tier sends its victims to disk asynchronously: rather than storing fewer
        blocks than asked, wait for those writes while any transfer is still under way.
        """
        core = self._core
        deadline = time.monotonic() + core.config.restore_timeout_s
        while True:
            got = core.cascade.cpu_slots(page_size, 1)
            if got or time.monotonic() > deadline:
                return got
            # let the copies prepared so far start, so they can cascade
            started += pending.submit(core)
            restores, offloads = core.scheduler.depth()
            busy = restores or offloads or core.scheduler.inflight_bytes
            if not busy and all(_done(b) for b in started):
                return got  # nothing under way will free a slot
            core.cond.wait(0.01)

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
            # A window the CPU tier can hold at once: a prefix longer than the CPU tier is
            # brought up from disk and copied in a window at a time.
            window = max(1, core.host.capacity_bytes // pool.page_size // 2)
            loaded = 0
            while loaded < len(keys):
                part = keys[loaded : loaded + window]
                pages = self._resident_prefix(pool, part)
                try:
                    n = self._copy_in(pool, pages, slots[loaded : loaded + len(pages)])
                finally:
                    core.unprotect(p.page_id for p in pages)
                loaded += n
                if n < len(part):
                    break
            return loaded

    def _copy_in(self, pool: Pool, pages: list[Page], slots: list[int]) -> int:
        """Copy CPU-resident keyed pages into pool slots; the number of leading successes."""
        core = self._core
        copies = _Copies(pool, Direction.CPU_TO_GPU)
        for page, slot in zip(pages, slots, strict=True):
            copies.add(page, page.slot, slot)
        batches = copies.submit(core, urgent=True)
        self._wait(batches)
        for page in pages:
            core.policy_of(page).touch(page.page_id)
            page.hits += 1
        results = [r for b in batches for r in b.results or ()]
        return results.index(False) if False in results else len(results)

    def _resident_prefix(self, pool: Pool, keys: list[bytes]) -> list[Page]:
        """Pages of the longest stored prefix, brought to the CPU tier and returned protected.

        Pages already in CPU are protected as soon as they are seen, so bringing the rest up
        from disk can't push them back down.
        """
        core = self._core
        deadline = time.monotonic() + core.config.restore_timeout_s
        held: set = set()
        try:
            while True:
                pages = self._prefix(pool, keys)
                for page in pages:
                    if page.state is PageState.CPU and page.page_id not in held:
                        core.protect([page.page_id])
                        held.add(page.page_id)
                waiting = [p for p in pages if p.state is not PageState.CPU]
                if not waiting:
                    core.unprotect(held - {p.page_id for p in pages})
                    return pages
                for page in waiting:
                    if page.state is PageState.DISK:
                        core.restore_disk([page])
                    elif page.state is PageState.MOVING_DOWN:
                        core.cancel(page)
                if time.monotonic() > deadline:
                    raise DeadlineExceeded("load: restoring stored blocks from disk timed out")
                core.cond.wait(0.05)
        except BaseException:
            core.unprotect(held)
            raise

    def _prefix(self, pool: Pool, keys: list[bytes]) -> list[Page]:
        pages: list[Page] = []
        for key in keys:
            page = self._core.table.keyed(salt_key(pool.tenant, key))
            if page is None or page.state is PageState.DROPPED or page.page_size != pool.page_size:
                break
            pages.append(page)
        return pages

    def _wait(self, batches: list[Moves]) -> None:
        deadline = time.monotonic() + self._core.config.restore_timeout_s
        while not all(_done(b) for b in batches):
            if time.monotonic() > deadline:
                raise DeadlineExceeded("copy of stored blocks timed out")
            self._core.cond.wait(0.05)


def _done(batch: Moves) -> bool:
    return batch.results is not None and None not in batch.results


class _Copies:
    """Copy columns of stored blocks, gathered until submitted as one batch."""

    def __init__(self, pool: Pool, direction: Direction) -> None:
        self.pool, self.direction = pool, direction
        self.pages: list[Page] = []
        self.srcs: list[int] = []
        self.dsts: list[int] = []

    def add(self, page: Page, src: int, dst: int) -> None:
        self.pages.append(page)
        self.srcs.append(src)
        self.dsts.append(dst)

    def submit(self, core: EngineCore, urgent: bool = False) -> list[Moves]:
        """The gathered copies as one submitted batch (none when empty); starts a new one."""
        if not self.pages:
            return []
        n, pool = len(self.pages), self.pool
        batch = Moves(self.direction, pool.page_size, self.srcs, self.dsts, self.pages, pool.dev)
        batch.copy, batch.urgent, batch.results = True, urgent, [None] * n
        self.pages, self.srcs, self.dsts = [], [], []
        core.scheduler.submit([batch])
        return [batch]
