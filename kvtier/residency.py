"""Residency: pages in and out of a pool's GPU slots, restores first.

Contract (see ``ENGINE_API.md``): ``allocate`` creates pinned GPU pages, ``acquire`` makes pages
resident and pins them, ``release`` unpins; ``try_acquire``/``try_release`` are their
non-blocking forms for event loops. An acquire never rescans its pages: it registers an
``AcquireWait`` that move completions advance (pinning each page as it lands), so its cost is
per page once, not per page per batch. Capacity shortfall returns ``None``; bad input raises
before any state changes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from operator import attrgetter
from typing import cast

import torch

from kvtier.batches import split_by
from kvtier.core import EngineCore
from kvtier.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, PageLost
from kvtier.pagetable import AcquireWait, Page
from kvtier.pool import Pool, Protected
from kvtier.types import PageId, PageState, PoolId, SlotIndex, Tier
from kvtier.validate import check_ids, check_priority

_STATE, _TIER = attrgetter("state"), attrgetter("tier")


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
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgument("n", f"must be a positive integer, got {n}")
        if priority is not None:
            check_priority("priority", priority)
        if sequence_length is not None and (
            not isinstance(sequence_length, int) or sequence_length < n
        ):
            raise InvalidArgument("sequence_length", f"must be an integer >= n ({n})")
        deadline = time.monotonic() + self._core.config.restore_timeout_s
        core = self._core
        with core.cond:
            self._core.check_open()
            pool = self._core.pool_of(pool_id)
            if pool.external:
                raise FailedPrecondition(
                    f"pool {pool_id} is engine-managed (registered); allocate there"
                )
            if n > pool.num_slots - len(pool.pinned):
                return None
            while pool.dev.num_free < n:
                self._make_room(pool, n - pool.dev.num_free, set())
                if not self._wait(deadline):
                    return None
            slots = pool.dev.alloc(n)
            assert slots is not None
            ids = core.table.new_ids(n)
            prio = pool.default_priority if priority is None else priority
            length, size, tenant, gpu = sequence_length or n, pool.page_size, pool.tenant, Tier.GPU
            pages = [
                Page(pid, pool_id, tenant, size, PageState.GPU, gpu, slot, prio, i, length, 1)
                for i, (pid, slot) in enumerate(zip(ids, slots, strict=True))
            ]
            core.table.add_pool_pages(pool_id, pages)
            core.bulk.settle_new(pool, pages)
            pool.pinned.update(ids)
            return list(zip(ids, slots, strict=True))

    def acquire(
        self, pool_id: PoolId, page_ids: Sequence[PageId], *, timeout: float | None = None
    ) -> list[SlotIndex] | None:
        """Resident + pinned, restores first. See ENGINE_API.md."""
        core = self._core
        start = time.monotonic()
        deadline = start + (self._core.config.restore_timeout_s if timeout is None else timeout)
        with core.cond:
            self._core.check_open()
            pool = self._core.pool_of(pool_id)
            pages = core.table.get_many(pool_id, check_ids("page_ids", page_ids))
            unique = list(dict.fromkeys(pages))
            wanted = {p.page_id for p in unique}
            others = len(pool.pinned) - len(pool.pinned & wanted)
            if len(unique) > pool.num_slots - others:
                return None
            wait = AcquireWait()
            counted = False
            core.protect(wanted)  # neither cascade may push these down meanwhile
            try:
                keys = list(map(_STATE, unique))
                by_state = {state: group for state, (group,) in split_by(keys, unique)}
                self._check_lost(by_state)
                self._watch(pool, unique, by_state, wait)
                restored = wait.left > 0
                on_cpu = list(by_state.get(PageState.CPU, ()))
                on_disk = list(by_state.get(PageState.DISK, ()))
                for page in by_state.get(PageState.MOVING_DOWN, ()):
                    core.cancel(page)  # back on the GPU: its wait pins it
                if wait.left:
                    core.restore_waiters += 1
                    counted = True
                while wait.left:
                    if wait.lost:
                        raise PageLost(f"pages {wait.lost} were dropped and must be recomputed")
                    on_cpu += wait.on_cpu
                    on_disk += wait.on_disk
                    wait.on_cpu, wait.on_disk = [], []
                    if on_cpu or on_disk:
                        on_cpu, on_disk = self._start_up(pool, on_cpu, on_disk, wanted)
                    if not wait.left:  # a small restore runs inline and may be done already
                        break
                    if not self._wait(deadline):
                        raise DeadlineExceeded(f"acquire of {len(unique)} pages timed out")
            except BaseException:
                for page in wait.pinned:
                    self._unpin(pool, page)
                raise
            finally:
                if counted:
                    core.restore_waiters -= 1
                for page in [p for p in unique if p.waits]:
                    page.waits = tuple(w for w in page.waits or () if w is not wait) or None
                core.unprotect(wanted)
            for page in unique:
                page.hits += 1
            pool.policy.touch_many([p.page_id for p in unique])
            if restored:
                core.counters.restore_latencies.append(time.monotonic() - start)
                del core.counters.restore_latencies[:-4096]
            return cast("list[SlotIndex]", [p.slot for p in pages])

    def try_acquire(
        self, tenant: str, pool_id: PoolId, page_ids: Sequence[PageId]
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
            if core.closed or pool is None or pool.tenant != tenant:
                return None
            pages = []
            for pid in page_ids:
                page = core.table.pages.get(pid)
                if page is None or page.pool_id != pool_id or page.state is not PageState.GPU:
                    return None
                pages.append(page)
            for page in dict.fromkeys(pages):
                self._pin(pool, page)
                page.hits += 1
                pool.policy.touch(page.page_id)
            core.counters.hits[Tier.GPU] += 1
            return [SlotIndex(p.slot) for p in pages]
        finally:
            core.cond.release()

    def try_release(self, tenant: str, pool_id: PoolId, page_ids: Sequence[PageId]) -> bool:
        """Non-blocking :meth:`release`: True if done; False (nothing changed) if the lock was
        busy or any id is not an acquired page of ``tenant``'s pool."""
        core = self._core
        if not core.cond.acquire(blocking=False):
            return False
        try:
            pool = core.pools.get(pool_id)
            if pool is None or pool.tenant != tenant:
                return False
            pages = []
            for pid in dict.fromkeys(page_ids):
                page = core.table.pages.get(pid)
                if page is None or page.pool_id != pool_id or page.pins == 0:
                    return False
                pages.append(page)
            ready = self._record_ready()
            for page in pages:
                self._unpin(pool, page)
                page.ready = ready
            core.cond.notify_all()
            return True
        finally:
            core.cond.release()

    def _watch(
        self,
        pool: Pool,
        pages: list[Page],
        by_state: dict[PageState, list[Page]],
        wait: AcquireWait,
    ) -> None:
        """Pin the resident pages now; register ``wait`` on the others."""
        gpu = PageState.GPU
        resident = by_state.get(gpu, [])
        for page in resident:
            page.pins += 1
        pool.pinned.update([p.page_id for p in resident])
        wait.pinned += resident
        if len(resident) < len(pages):
            alone = (wait,)  # shared by every page no other acquire waits on
            away = [p for p in pages if p.state is not gpu] if resident else pages
            for page in away:
                page.waits = alone if page.waits is None else (*page.waits, wait)
            wait.left += len(away)
        hits = self._core.counters.hits
        for tier, n in Counter(map(_TIER, pages)).items():
            hits[tier] += n

    def _start_up(
        self, pool: Pool, on_cpu: list[Page], on_disk: list[Page], wanted: set[PageId]
    ) -> tuple[list[Page], list[Page]]:
        """Start the next leg toward the GPU; returns the pages still waiting for room."""
        core = self._core
        on_cpu = [p for p in on_cpu if p.state is PageState.CPU]
        on_disk = [p for p in on_disk if p.state is PageState.DISK]
        # GPU room first: the victims need CPU slots that disk restores would otherwise take.
        short = len(on_cpu) + len(on_disk) - pool.dev.num_free
        if short > 0:
            self._make_room(pool, short, wanted)
        started = core.restore_cpu(pool, on_cpu)
        if short <= 0:
            core.restore_disk(on_disk)
        return on_cpu[started:], [p for p in on_disk if p.state is PageState.DISK]

    def _make_room(self, pool: Pool, n: int, keep: set[PageId]) -> None:
        """Evict ``n`` GPU victims (urgently) unless enough slots are already on their way."""
        n -= pool.moving_down
        if n <= 0:
            return
        victims = pool.policy.evict(n, Protected(pool.pinned, keep))
        if victims is None:
            evictable = len(pool.policy) - len(pool.pinned)
            victims = (
                pool.policy.evict(evictable, Protected(pool.pinned, keep))
                if evictable > 0
                else None
            )
        pages = [self._core.table.pages[v] for v in victims or []]
        for page in pages:  # evict() stopped tracking them; settle bookkeeping expects them
            pool.policy.insert(page.meta())
        self._core.counters.evictions[Tier.GPU] += self._core.offload(pages, urgent=True)

    def _check_lost(self, by_state: dict[PageState, list[Page]]) -> None:
        lost = [p.page_id for p in by_state.get(PageState.DROPPED, ())]
        if lost:
            raise PageLost(f"pages {lost} were dropped and must be recomputed")

    def _wait(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._core.cond.wait(min(remaining, 0.05))
        self._core.check_open()
        return True

    def _pin(self, pool: Pool, page: Page) -> None:
        page.pins += 1
        pool.pinned.add(page.page_id)

    def _unpin(self, pool: Pool, page: Page) -> None:
        page.pins -= 1
        if page.pins == 0:
            pool.pinned.discard(page.page_id)

    def release(self, pool_id: PoolId, page_ids: Sequence[PageId]) -> None:
        with self._core.cond:
            pool = self._core.pool_of(pool_id)
            ids = check_ids("page_ids", page_ids)
            pages = list(dict.fromkeys(self._core.table.get_many(pool_id, ids)))
            bad = [p.page_id for p in pages if p.pins == 0]
            if bad:
                raise FailedPrecondition(f"page_ids: pages {bad} are not acquired")
            ready = self._record_ready()
            for page in pages:
                page.pins -= 1
                page.ready = ready
            pool.pinned.difference_update([p.page_id for p in pages if p.pins == 0])
            self._core.cond.notify_all()

    def _record_ready(self) -> object:
        if self._core.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._core.device))
        return event
