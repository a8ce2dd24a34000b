"""Residency: pages in and out of a pool's GPU slots, restores first.

Contract (see ``ENGINE_API.md``): ``allocate`` creates pinned GPU pages, ``acquire`` makes pages
resident and pins them, ``release`` unpins; ``try_acquire``/``try_release`` are their
non-blocking forms for event loops. An acquire counts itself in the ``waiting`` column of each
page it needs; the completion that lands a page on the GPU pins it for every waiting acquire at
once (nothing can evict it before the acquire wakes). The acquire itself only re-reads the state
of the pages it still waits for, one numpy pass per wake-up. Capacity shortfall returns ``None``;
bad input raises before any state changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import cast

import numpy as np

from kvtier.core import EngineCore
from kvtier.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PageLost,
)
from kvtier.state.pool import Pool
from kvtier.state.table import EMPTY, ROW_BITS
from kvtier.types import PageId, PoolId, SlotIndex, Tier
from kvtier.validate import check_ids, check_priority


class Residency:
    """The engine's page pinning and GPU-slot mechanics, over the shared core."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    def allocate(
        self,
        pool_id: PoolId,
        n: int,
        *,
        priority: float | None = None,
        sequence_length: int | None = None,
    ) -> list[tuple[PageId, SlotIndex]] | None:
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise InvalidArgument("n", f"must be a positive integer, got {n}")
        if priority is not None:
            check_priority("priority", priority)
        if sequence_length is not None and (
            not isinstance(sequence_length, int) or sequence_length < n
        ):
            raise InvalidArgument("sequence_length", f"must be an integer >= n ({n})")
        core = self._core
        deadline = time.monotonic() + core.config.restore_timeout_s
        with core.cond:
            core.check_open()
            pool = core.pool_of(pool_id)
            if pool.external:
                raise FailedPrecondition(
                    f"pool {pool_id} is engine-managed (registered); allocate there"
                )
            if n > pool.num_slots - pool.pinned:
                return None
            while pool.dev.num_free < n:
                make_room(core, pool, n - pool.dev.num_free)
                if not _wait(core, deadline):
                    return None
                if pool.detaching:  # a Detach came while this waited: nothing new out of it
                    raise NotFound(f"pool {pool_id} not found")
            slots = pool.dev.take(n)
            assert slots is not None
            prio = pool.default_priority if priority is None else priority
            rows = self._new_pages(pool, slots, prio, sequence_length or n)
            ids = core.table.ids(rows).tolist()
            return list(zip(ids, slots.tolist(), strict=True))

    def _new_pages(self, pool: Pool, slots: np.ndarray, prio: float, length: int) -> np.ndarray:
        """Pinned GPU pages in ``slots`` (positions 0.. of a sequence of ``length``)."""
        core, t = self._core, self._core.table
        owner = core.ledger.owner(pool.tenant)
        rows = t.add(len(slots), pool=pool.pool_id, size=pool.page_size, prio=prio,
                     length=length, owner=owner, positions=True)
        core.settle(rows, Tier.GPU, slots, pool)
        core.pin(pool, rows)
        return rows

    def acquire(
        self,
        pool_id: PoolId,
        page_ids: Sequence[PageId] | np.ndarray,
        *,
        timeout: float | None = None,
    ) -> list[SlotIndex] | np.ndarray | None:
        """Resident + pinned, restores first; slots as a list, or as an ``int64`` array when
        ``page_ids`` is an array (no Python int per page either way in). See ENGINE_API.md."""
        core = self._core
        start = time.monotonic()
        deadline = start + (core.config.restore_timeout_s if timeout is None else timeout)
        ids = check_ids("page_ids", page_ids)
        with core.scheduler.restore_first(core.device_of(pool_id)), core.cond:
            core.check_open()
            pool = core.pool_of(pool_id)
            rows = core.table.rows(pool_id, ids)
            unique = core.table.unique(rows)
            if not self._fits(pool, unique):
                return None
            # The generations the ids carry (``rows`` checked them): no gather when no repeats.
            gens = ids >> ROW_BITS if unique is rows else core.table.gen[unique]
            restored = _Acquire(core, pool, unique, gens).run(deadline)
            if restored:
                core.counters.restore_latency.observe(time.monotonic() - start)
            slots = core.table.slot[rows]
            return slots if isinstance(page_ids, np.ndarray) else slots.tolist()

    def _fits(self, pool: Pool, unique: np.ndarray) -> bool:
        """Whether the pool can hold ``unique`` pinned at once beside the other pinned pages
        (the pins of ``unique`` itself are read only when the answer depends on them)."""
        if len(unique) <= pool.num_slots - pool.pinned:
            return True
        mine = int(np.count_nonzero(self._core.table.pins[unique] > 0))
        return len(unique) <= pool.num_slots - (pool.pinned - mine)

    def try_acquire(
        self, tenant: str, pool_id: PoolId, page_ids: Sequence[PageId] | np.ndarray
    ) -> list[SlotIndex] | None:
        """Non-blocking fast path for callers on an event loop.

        Pins and returns the slots only when the engine lock is free at once, the pool belongs to
        ``tenant`` and every page is resident on the GPU; otherwise returns ``None`` having
        changed nothing (the caller then uses :meth:`acquire`, which also reports errors).
        """
        core = self._core
        if not core.cond.acquire(blocking=False):
            return None
        try:
            pool = core.pools.get(pool_id)
            if core.closed or pool is None or pool.detaching or pool.tenant != tenant:
                return None
            try:
                rows = core.table.rows(pool_id, check_ids("page_ids", page_ids))
            except (NotFound, InvalidArgument):
                return None
            if not core.table.at(rows, Tier.GPU).all():
                return None
            unique = core.table.unique(rows)
            core.pin(pool, unique)
            core.table.hit(unique)
            pool.policy.touch(unique)
            core.counters.acquired[Tier.GPU] += len(unique)
            return cast("list[SlotIndex]", core.table.slot[rows].tolist())
        finally:
            core.cond.release()

    def try_release(
        self, tenant: str, pool_id: PoolId, page_ids: Sequence[PageId] | np.ndarray
    ) -> bool:
        """Non-blocking :meth:`release`: True if done; False (nothing changed) if the lock was
        busy or any id is not an acquired page of ``tenant``'s pool."""
        core = self._core
        if not core.cond.acquire(blocking=False):
            return False
        try:
            pool = core.pools.get(pool_id)
            if pool is None or pool.tenant != tenant:
                return False
            try:
                rows = core.table.rows(pool_id, check_ids("page_ids", page_ids))
            except (NotFound, InvalidArgument):
                return False
            unique = core.table.unique(rows)
            if not (core.table.pins[unique] > 0).all():
                return False
            self._unpin(pool, unique)
            core.cond.notify_all()
            return True
        finally:
            core.cond.release()

    def release(self, pool_id: PoolId, page_ids: Sequence[PageId] | np.ndarray) -> None:
        core = self._core
        ids = check_ids("page_ids", page_ids)
        with core.cond:
            pool = core.pool_of(pool_id)
            unique = core.table.unique(core.table.rows(pool_id, ids))
            bad = unique[core.table.pins[unique] == 0]
            if len(bad):
                listed = core.table.ids_text(bad)
                raise FailedPrecondition(f"page_ids: pages {listed} are not acquired")
            self._unpin(pool, unique)
            core.cond.notify_all()

    def _unpin(self, pool: Pool, rows: np.ndarray) -> None:
        core = self._core
        core.unpin(pool, rows)
        core.table.set_ready(rows, core.ready.record(pool.dev.device))


def make_room(core: EngineCore, pool: Pool, n: int) -> None:
    """Evict ``n`` GPU victims (urgently) unless enough slots are already on their way; pinned
    pages and pages a restore needs are never victims."""
    n -= pool.moving_down
    if n <= 0:
        return
    t = core.table
    victims = pool.policy.evict(n, lambda r: (t.pins[r] > 0) | (t.protect[r] > 0), partial=True)
    if victims is None or not len(victims):
        return
    pool.policy.insert(victims, core.meta(victims))  # back in: ``offload`` takes them out
    core.counters.evictions[Tier.GPU] += core.starts.offload(victims, urgent=True)


class _Acquire:
    """One acquire's progress: pins what is resident, waits for the rest, drives their legs
    up (disk -> CPU -> GPU), and undoes its pins and waits if it fails."""

    def __init__(self, core: EngineCore, pool: Pool, rows: np.ndarray, gens: np.ndarray) -> None:
        """``gens``: the rows' generations; the states are read here under the lock this
        acquire still holds. Raises ``PageLost`` (nothing changed) for dropped pages."""
        self.core, self.pool, self.rows, self.gens = core, pool, rows, gens
        t = core.table
        self.removals = t.removals  # unchanged: no page was freed, no generation to compare
        dropped = t.dropped(rows)
        if dropped.any():
            raise PageLost(f"pages {t.ids_text(rows[dropped])} were dropped")
        away = np.logical_not(t.at(rows, Tier.GPU))
        self.pending, self.pending_gens = _where(rows, away), _where(gens, away)
        self.pinned = _where(rows, np.logical_not(away))  # pinned here; the rest by ``land``
        self._waits_counted = False
        self._count_acquired()

    def _count_acquired(self) -> None:
        """A page acquired, counted in the tier its bytes were found in (one comparison pass
        when all are in one tier, the common case)."""
        acquired, rows = self.core.counters.acquired, self.rows
        if not len(rows):
            return
        tiers, wire = self.core.table.tier[rows], self.core.wire
        first = int(tiers[0])
        if (tiers == first).all():
            acquired[wire[first]] += len(rows)
            return
        for level, count in enumerate(np.bincount(tiers)):
            acquired[wire[level]] += int(count)

    def run(self, deadline: float) -> bool:
        """Pin everything (True if anything had to be restored); raises with nothing held.

        Under the engine lock nothing lands but what this acquire itself completes (a
        cancelled offload, an inline restore), so the pending pages are re-read only after
        those and after each wait, not on every step."""
        core, t = self.core, self.core.table
        core.pin(self.pool, self.pinned)
        counted = False
        try:
            going = _where(self.pending, core.table.moving_down(self.pending))
            still = bool(len(self.pending))
            if len(going):
                self._count_waits()
                if len(core.cancel(going)):  # ``land`` pinned them
                    still = self._still_waiting()
            if still:
                core.landings.restore_waiters += 1
                counted = True
            while still:
                ended = core.landings.ended
                self._start_up()
                if core.landings.ended != ended and not self._still_waiting():
                    break  # a small restore ran inline
                if not self._wait_landings(deadline):
                    raise DeadlineExceeded(f"acquire of {len(self.rows)} pages timed out")
                still = self._still_waiting()
        except BaseException:
            self._undo()
            raise
        finally:
            if counted:
                core.landings.restore_waiters -= 1
        # A page that landed and was freed at once (no removal at all: none was).
        freed = t.gen[self.rows] != self.gens if t.removals != self.removals else EMPTY
        if freed.any():
            self._undo()
            listed = self.core.table.ids_text(self.rows[freed], gens=self.gens[freed])
            raise NotFound(f"pages {listed} were freed while being acquired")
        # Pages that landed had their hit and touch counted by ``land``: the resident ones here.
        t.hit(self.pinned)
        self.pool.policy.touch(self.pinned)
        return counted

    def _count_waits(self) -> None:
        """Count this acquire in ``waiting`` of every pending page (once): ``land`` pins them
        for it, and no cascade pushes them down. Due before anything can land, cascade or
        release the lock; an all-CPU restore does it while its first chunk copies."""
        if not self._waits_counted:
            self.core.table.await_landing(self.pending)
            self._waits_counted = True

    def _still_waiting(self) -> bool:
        """Drop pages that landed from ``pending``; raise for pages lost or freed meanwhile.
        One pass over the ``waiting`` column; the rest only over what still waits."""
        t = self.core.table
        rows, gens = self.pending, self.pending_gens
        if not len(rows):
            return False
        still = t.waiting[rows] > 0
        if not still.all():
            rows, gens = self.pending, self.pending_gens = rows[still], gens[still]
        if not len(rows):
            return False
        freed = t.gen[rows] != gens if t.removals != self.removals else EMPTY
        if freed.any():
            listed = t.ids_text(rows[freed], gens=gens[freed])
            raise NotFound(f"pages {listed} were freed while being acquired")
        lost = t.dropped(rows)
        if lost.any():
            raise PageLost(f"pages {t.ids_text(rows[lost])} were dropped and must be recomputed")
        return True

    def _wait_landings(self, deadline: float) -> bool:
        """Wait for progress (False: the deadline passed). While every pending page is on its
        way CPU -> GPU, nothing can change for them but the end of those moves, so the acquire
        sleeps until that many restore moves have ended: one wake-up, not one per batch (each
        would take the lock and the interpreter from the lane completing the next)."""
        core, t, pending = self.core, self.core.table, self.pending
        if not (t.moving_up(pending) & (t.tier[pending] == Tier.CPU)).all():
            return _wait(core, deadline)
        return core.landings.wait(core.landings.ended + len(pending), deadline, core.check_open)

    def _start_up(self) -> None:
        """Start the next leg toward the GPU for pending pages that wait in CPU or on disk."""
        core, pool, t = self.core, self.pool, self.core.table
        pending = self.pending
        on_cpu = _where(pending, t.at(pending, Tier.CPU))
        on_disk = _where(pending, t.below_cpu(pending)) if len(on_cpu) < len(pending) else EMPTY
        if not len(on_cpu) and not len(on_disk):
            self._count_waits()
            return
        # GPU room first: the victims need CPU slots that disk restores would otherwise take.
        short = len(on_cpu) + len(on_disk) - pool.dev.num_free
        if short > 0 or len(on_disk):
            self._count_waits()  # before a cascade could choose these pages
        if short > 0:
            make_room(core, pool, short)
        core.starts.restore_cpu(pool, on_cpu, then=self._count_waits)
        if short <= 0 and len(on_disk):
            core.starts.restore_below(on_disk)

    def _undo(self) -> None:
        """Unpin what this acquire pinned; withdraw its waits from pages not yet landed."""
        core, t = self.core, self.core.table
        if not self._waits_counted:
            # Still in the lock hold that pinned them (waits are counted before anything can
            # land, cascade or release the lock): nothing else happened to these pages.
            core.unpin(self.pool, self.pinned)
            return
        alive = self.rows[t.gen[self.rows] == self.gens]
        waiting = alive[t.waiting[alive] > 0]
        waiting = waiting[np.isin(waiting, self.pending)] if len(waiting) else EMPTY
        t.withdraw_wait(waiting)
        held = alive[~np.isin(alive, waiting)]
        held = held[t.pins[held] > 0]
        if len(held):
            core.unpin(self.pool, held)


def _where(values: np.ndarray, mask: np.ndarray | bool) -> np.ndarray:
    """``values[mask]``, without the copy when ``mask`` selects all or nothing (the common
    cases for a large acquire: two reductions instead of a compress; a plain bool selects
    all or nothing)."""
    if np.all(mask):
        return values
    return values[mask] if np.any(mask) else values[:0]


def _wait(core: EngineCore, deadline: float) -> bool:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    core.cond.wait(min(remaining, 0.05))
    core.check_open()
    return True
