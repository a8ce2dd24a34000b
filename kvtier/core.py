"""Engine core: tiers, policies and two-phase moves over the page table.

Contract (every method here runs with ``self.cond`` held, except ``complete`` which takes it):
    * ``offload(pages)`` / ``restore_cpu(pool, pages)`` / ``restore_disk(pages)`` *prepare* moves:
      allocate the destination slot, mark the page moving, take it out of its tier's policy, and
      queue the move. A page that gets no destination slot stays where it was.
    * ``complete(batch, results)`` finishes them: success frees the source slot and makes the
      destination the page's home; failure frees the destination and puts the page back (a failed
      disk read drops the page: its stored bytes are not trustworthy).
    * Room is made by cascades: CPU full -> CPU victims go to disk through the admission rule, or
      are dropped; disk full -> disk victims are dropped. Drops are counted and published.
    * Batches of moves are prepared and finished in bulk by ``kvtier.bulk`` (same steps, a call
      per batch instead of per page); ``finish_column`` is the one-page form it falls back to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from itertools import repeat
from typing import TYPE_CHECKING

import torch

from kvtier.batches import Frees, split_by
from kvtier.bulk import BulkMoves
from kvtier.cascade import Cascade
from kvtier.config import MIB, OffloadConfig
from kvtier.errors import NotFound, Unavailable
from kvtier.events import Event, EventHub
from kvtier.pagetable import Page, PageTable, advance_waits
from kvtier.policy.admission import create_admission
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.registry import create_policy
from kvtier.pool import Pool
from kvtier.scheduler import TransferScheduler
from kvtier.stats import EngineCounters
from kvtier.tiers.base import DiskRecord, DiskSlot
from kvtier.tiers.pinned import HostArena
from kvtier.transfer import build_handlers, build_inline_restore
from kvtier.transfer.base import Moves
from kvtier.types import Direction, PageId, PageState, PoolId, Tier

if TYPE_CHECKING:
    from kvtier.tiers.disk import DiskStore

log = logging.getLogger(__name__)
_GPU_SIDE = (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU)
COMPLETE_CHUNK = 256  # pages finished per engine-lock hold (a restore arriving waits one)
YIELD_CHUNK = 16  # ... while a restore is waiting, for offload batches
YIELD_S = 0.0001  # and the pause between those chunks that lets the restore's thread in
INLINE_RESTORE_BYTES = 8 << 20  # urgent restores up to this size run on the caller's thread
_STATE_OF = {Tier.GPU: PageState.GPU, Tier.CPU: PageState.CPU, Tier.DISK: PageState.DISK}


class EngineCore:
    """State and mechanism shared by the public engine, prefix store and watermark thread."""

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.cond = threading.Condition(threading.RLock())
        self.table = PageTable()
        self.pools: dict[PoolId, Pool] = {}
        self.counters = EngineCounters()
        self.events = EventHub()
        cuda = self.device.type == "cuda"
        chunk = max(4096, min(config.pinned_chunk_mb * MIB, config.cpu_budget_bytes) // 4096 * 4096)
        self.host = HostArena(config.cpu_budget_bytes, chunk, pin=cuda)
        self.disk: DiskStore | None = None
        if config.disk_budget_bytes:
            from kvtier.tiers.disk import DiskStore

            self.disk = DiskStore(
                config.disk_path,
                config.disk_budget_bytes,
                direct_io=config.disk_direct_io,
                io_threads=config.disk_io_threads,
            )
        create_policy(config.policy)  # fail at start on an unknown name
        self.cpu_policy: dict[int, EvictionPolicy] = {}
        self.disk_policy: dict[int, EvictionPolicy] = {}
        self.restore_waiters = 0  # acquires waiting on a restore (offload completions yield)
        self.cpu_protected: dict[PageId, int] = {}  # pages a restore or load needs kept in CPU
        self.admission = create_admission(config.disk_admission)
        self.closed = False
        handlers = build_handlers(self.device, self.host, self.disk, config.batch_bytes)
        self.inline_restore = build_inline_restore(self.device, self.host, INLINE_RESTORE_BYTES)
        self.scheduler = TransferScheduler(
            handlers,
            batch_bytes=config.batch_bytes,
            max_inflight_bytes=config.max_inflight_mb * MIB,
            on_complete=self.complete,
        )
        self.cascade = Cascade(self)
        self.bulk = BulkMoves(self)
        self._reload_disk()

    def _reload_disk(self) -> None:
        """Keyed pages persisted by an earlier process come back as DISK pages."""
        if self.disk is None:
            return
        for page_size, slot, record in self.disk.records():
            if self.table.keyed(record.key) is not None:
                continue
            page = Page(
                self.table.new_id(),
                None,
                record.tenant,
                page_size,
                PageState.DISK,
                Tier.DISK,
                slot,
                key=record.key,
            )
            self.table.add(page)
            self.settle(page, Tier.DISK, slot)

    def pool_of(self, pool_id: PoolId) -> Pool:
        """The pool, or ``NotFound`` (the same answer for another tenant's ids)."""
        pool = self.pools.get(pool_id)
        if pool is None:
            raise NotFound(f"pool {pool_id} not found")
        return pool

    def check_open(self) -> None:
        if self.closed:
            raise Unavailable("the engine is shut down")

    def protect(self, ids: Iterable[PageId]) -> None:
        counts = self.cpu_protected
        if isinstance(ids, set) and counts.keys().isdisjoint(ids):
            counts.update(dict.fromkeys(ids, 1))  # distinct ids, none protected yet
            return
        for pid in ids:
            self.cpu_protected[pid] = self.cpu_protected.get(pid, 0) + 1

    def unprotect(self, ids: Iterable[PageId]) -> None:
        counts = self.cpu_protected
        if isinstance(ids, set):  # distinct ids: take them all out, put back what others hold
            order = list(ids)
            held = list(map(counts.pop, order, repeat(0)))
            if held and max(held) > 1:
                counts.update((p, n - 1) for p, n in zip(order, held, strict=True) if n > 1)
            return
        for pid in ids:
            left = self.cpu_protected.get(pid, 0) - 1
            if left > 0:
                self.cpu_protected[pid] = left
            else:
                self.cpu_protected.pop(pid, None)

    # -- policies per tier ----------------------------------------------------------------------
    def new_policy(self) -> EvictionPolicy:
        return create_policy(self.config.policy)

    def policy_of(self, page: Page) -> EvictionPolicy:
        if page.tier is Tier.GPU:
            assert page.pool_id is not None
            return self.pools[page.pool_id].policy
        return self.tier_policy(page.tier, page.page_size)

    def tier_policy(self, tier: Tier, page_size: int) -> EvictionPolicy:
        """The CPU or disk tier's policy for pages of ``page_size`` (created on first use)."""
        table = self.cpu_policy if tier is Tier.CPU else self.disk_policy
        policy = table.get(page_size)
        if policy is None:
            policy = table[page_size] = self.new_policy()
        return policy

    def settle(self, page: Page, tier: Tier, slot: int) -> None:
        """Make ``tier``/``slot`` the page's home and let its policy track it."""
        page.tier, page.slot, page.state = tier, slot, _STATE_OF[tier]
        if tier is Tier.GPU:
            assert page.pool_id is not None
            self.pools[page.pool_id].slot_pages[slot] = page
        self.policy_of(page).insert(page.meta())

    def unsettle(self, page: Page) -> None:
        """The page's bytes are about to leave (or be freed from) its current tier."""
        self.policy_of(page).remove(page.page_id)
        if page.tier is Tier.GPU and page.pool_id is not None:
            self.pools[page.pool_id].slot_pages.pop(page.slot, None)

    def free_slot(self, page_size: int, tier: Tier, slot: int, pool: Pool | None = None) -> None:
        if tier is Tier.GPU:
            assert pool is not None
            pool.dev.free([slot])
        elif tier is Tier.CPU:
            self.host.free(page_size, [slot])
        else:
            assert self.disk is not None
            self.disk.clear_record(page_size, DiskSlot(slot))
            self.disk.free(page_size, [slot])

    def release_page(self, page: Page) -> None:
        """Forget a settled page and free its slot (free / detach / drop)."""
        if not page.moving and page.state is not PageState.DROPPED:
            self.unsettle(page)
            pool = self.pools.get(page.pool_id) if page.pool_id is not None else None
            self.free_slot(page.page_size, page.tier, page.slot, pool)
        if page.pool_id is not None and page.pool_id in self.pools:
            self.pools[page.pool_id].pinned.discard(page.page_id)
        self.table.remove(page)

    def drop(self, page: Page, reason: str) -> None:
        """The page's bytes are gone: it stays in the table as DROPPED until freed."""
        src = page.tier
        pool = self.pools.get(page.pool_id) if page.pool_id is not None else None
        self.unsettle(page)
        self.free_slot(page.page_size, page.tier, page.slot, pool)
        page.state, page.slot = PageState.DROPPED, -1
        self.counters.drop(reason)
        if page.waits:
            self.notify_waits(page)
        if page.pool_id is None:  # a keyed page nobody holds: forget it entirely
            self.table.remove(page)
        self.events.publish(Event("dropped", page.pool_id, page.page_id, src, None))

    # -- prepare ---------------------------------------------------------------------------------
    def start(self, page: Page, direction: Direction, dst: int) -> None:
        """Queue one page's move (a cascade's spill to disk)."""
        self.scheduler.submit(self.bulk.prepare([page], direction, [dst], False))

    def start_many(
        self,
        pages: list[Page],
        direction: Direction,
        dsts: list[int],
        *,
        urgent: bool,
        out: list[Moves] | None = None,
    ) -> int:
        """``start`` for pages of one direction (as many as there are ``dsts``).

        A batch's worth of pages at a time leaves its policies and is submitted at once, so
        copies start while the rest is prepared. With ``out`` the batches are collected there
        instead (the caller runs them).
        """
        pages = pages[: len(dsts)]
        if pages:
            step = max(1, self.config.batch_bytes // pages[0].page_size)
            for i in range(0, len(pages), step):
                chunk = pages[i : i + step], direction, dsts[i : i + step], urgent
                batches = self.bulk.prepare(*chunk)
                if out is None:
                    self.scheduler.submit(batches)
                else:
                    out += batches
        return len(pages)

    def offload(self, pages: Iterable[Page], *, urgent: bool = False) -> int:
        """Queue GPU->CPU for unpinned GPU pages; returns how many were queued."""
        todo = [p for p in pages if p.state is PageState.GPU and p.pins == 0]
        if not todo or not self.config.enabled:
            return 0
        queued = 0
        for size, (group,) in split_by([p.page_size for p in todo], todo):
            # CPU slots a batch at a time: the first copies start before the rest is prepared.
            step = max(1, self.config.batch_bytes // size)
            for i in range(0, len(group), step):
                part = group[i : i + step]
                slots = self.cascade.cpu_slots(size, len(part))
                queued += self.start_many(part, Direction.GPU_TO_CPU, slots, urgent=urgent)
                if len(slots) < len(part):
                    return queued
        return queued

    def restore_cpu(self, pool: Pool, pages: list[Page], *, urgent: bool = True) -> int:
        """CPU->GPU for as many pages as the pool has free slots.

        A small urgent restore (at most ``INLINE_RESTORE_BYTES``) runs right here on the caller's
        thread with its own stream and staging: no hand-off to a lane and back, which under an
        offload backlog costs more than the copy. Larger ones are queued on the up lane.
        """
        slots = pool.dev.alloc(len(pages)) if pages else []
        if slots is None:
            slots = pool.dev.alloc(min(pool.dev.num_free, len(pages))) or []
        nbytes = len(slots) * pool.page_size
        if not urgent or not slots or nbytes > INLINE_RESTORE_BYTES or self.closed:
            return self.start_many(pages, Direction.CPU_TO_GPU, list(slots), urgent=urgent)
        batches: list[Moves] = []
        up = Direction.CPU_TO_GPU
        started = self.start_many(pages, up, list(slots), urgent=True, out=batches)
        for batch in batches:
            begin = time.perf_counter()
            try:
                results = self.inline_restore.run(batch)
            except Exception:
                log.exception("inline restore of %d pages failed", len(batch))
                results = [False] * len(batch)
            self.complete(batch, results, time.perf_counter() - begin)
        return started

    def restore_disk(self, pages: list[Page]) -> int:
        """Queue disk->CPU (the first leg of a disk restore), one CPU allocation per page size."""
        by_size: dict[int, list[Page]] = {}
        for page in pages:
            by_size.setdefault(page.page_size, []).append(page)
        started = 0
        for size, group in by_size.items():
            slots = self.cascade.cpu_slots(size, len(group))
            started += self.start_many(group, Direction.DISK_TO_CPU, slots, urgent=True)
        return started

    # -- complete --------------------------------------------------------------------------------
    def complete(self, batch: Moves, results: list[bool], seconds: float) -> None:
        """Finish a batch, a chunk of pages per lock hold; slots go back to their tiers in bulk.

        Restores first, here too: while an acquire waits for a restore, an offload batch is
        finished a few pages at a time and yields between chunks, so the restore's own steps
        (start, completion, pin) never queue behind a whole offload batch.
        """
        restoring = batch.direction.is_restore
        n, start = len(batch), 0
        while start < n:
            step = COMPLETE_CHUNK if restoring or not self.restore_waiters else YIELD_CHUNK
            with self.cond:
                frees = Frees()
                self.bulk.finish(batch, start, min(n, start + step), results, frees)
                frees.apply(self)
                self.cond.notify_all()
            start += step
            if self.restore_waiters and not restoring and start < n:
                time.sleep(YIELD_S)
        with self.cond:
            self._count(batch, results, seconds)
            if batch.copy:
                batch.report(results)
            self.cond.notify_all()

    def _count(self, batch: Moves, results: list[bool], seconds: float) -> None:
        if not len(batch):
            return
        c = self.counters.moved[batch.direction]
        ok_pages = results.count(True)
        c.bytes += ok_pages * batch.page_size
        c.pages += ok_pages
        c.failures += len(batch) - ok_pages
        c.batches += 1
        c.seconds += seconds

    def finish_column(self, batch: Moves, i: int, ok: bool, frees: Frees | None = None) -> None:
        """Complete column ``i`` of a batch (see the module docstring); ``frees`` collects
        source slots."""
        page = batch.pages[i] if batch.pages else None
        if batch.copy or page is None:
            if page is not None and batch.direction is Direction.GPU_TO_CPU:  # a stored block
                if ok:
                    self.settle(page, Tier.CPU, batch.dsts[i])
                else:
                    self.host.free(page.page_size, [batch.dsts[i]])
                    self.table.remove(page)
            return
        self.finish_page(page, batch.direction, batch.srcs[i], batch.dsts[i], ok, frees)

    def finish_page(
        self,
        page: Page,
        direction: Direction,
        src_slot: int,
        dst_slot: int,
        ok: bool,
        frees: Frees | None = None,
    ) -> None:
        """Complete one page's move from ``src_slot`` to ``dst_slot``."""
        page.move = None
        src, dst = direction._value_
        pool = self.pools.get(page.pool_id) if page.pool_id is not None else None
        if pool is not None and direction is Direction.GPU_TO_CPU:
            pool.moving_down -= 1
        if ok:
            if frees is None:
                self.free_slot(page.page_size, src, src_slot, pool)
            else:
                frees.add(src, pool, page.page_size, src_slot)
            self.settle(page, dst, dst_slot)
            if dst is Tier.DISK and page.key is not None and self.disk is not None:
                record = DiskRecord(key=page.key, tenant=page.tenant)
                self.disk.set_record(page.page_size, DiskSlot(dst_slot), record)
            if self.events.active:
                self.events.publish(Event("moved", page.pool_id, page.page_id, src, dst))
        else:
            self.free_slot(page.page_size, dst, dst_slot, pool)
            self.settle(page, src, src_slot)
            if direction is Direction.DISK_TO_CPU and not self.closed:
                self.counters.checksum_failures += 1
                self.drop(page, "corrupt")
        if page.waits:
            self.notify_waits(page)
        if page.doomed:
            if frees is not None:
                frees.apply(self)  # the page's own slots must be settled before it goes
            self.release_page(page)
            self.events.publish(Event("freed", page.pool_id, page.page_id, None, None))

    def cancel(self, page: Page) -> bool:
        """Take back a queued (not started) move: the page stays where it was."""
        batch = page.move
        cols = self.scheduler.cancel(batch, page) if batch is not None else None
        if batch is None or cols is None:
            return False
        src_slot, dst_slot = cols
        direction = batch.direction
        self.counters.cancelled_offloads += int(not direction.is_restore)
        if direction is Direction.DISK_TO_CPU:
            self._undo(page, direction, src_slot, dst_slot)
        else:
            self.finish_page(page, direction, src_slot, dst_slot, False)
        return True

    def _undo(self, page: Page, direction: Direction, src_slot: int, dst_slot: int) -> None:
        page.move = None
        self.free_slot(page.page_size, direction.dst, dst_slot)
        self.settle(page, direction.src, src_slot)
        if page.waits:
            self.notify_waits(page)

    def notify_waits(self, page: Page) -> None:
        """Advance the acquires waiting on ``page`` after it settled somewhere."""
        pool = self.pools.get(page.pool_id) if page.pool_id is not None else None
        advance_waits(page, pool.pinned if pool is not None else set())
