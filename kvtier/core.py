"""Engine core: tiers, policies and two-phase moves over the page table's rows.

Contract (every method here runs with ``self.cond`` held, except ``complete`` which takes it):
    * Pages are page-table rows (int64 arrays of distinct rows); every step is one numpy pass
      or one policy call per batch, never Python work per page on the transfer paths.
    * ``starts`` (``kvtier.starts``: ``offload`` / ``restore_cpu`` / ``restore_disk``) queues
      moves, prepared by ``bulk`` (``kvtier.bulk``): destination slots allocated, pages marked
      moving and out of their tier's policy. A page that gets no destination slot stays where
      it was.
    * ``complete(batch, results)`` finishes them: success frees the source slot and makes the
      destination the page's home; failure frees the destination and puts the page back (a failed
      disk read drops the page: its stored bytes are not trustworthy).
    * Room is made by cascades (``kvtier.cascade``): CPU full -> CPU victims go to disk through
      the admission rule, or are dropped; disk full -> disk victims are dropped. Drops are
      counted and published.
    * ``settle``/``unsettle``/``release``/``drop`` take rows of one tier, pool and page size
      (``groups`` splits any rows so).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.batches import Frees
from kvtier.bulk import BulkMoves
from kvtier.cascade import Cascade
from kvtier.config import MIB, OffloadConfig
from kvtier.errors import NotFound, Unavailable
from kvtier.events import Event, EventHub
from kvtier.landings import Landings
from kvtier.pagetable import (
    S_DISK,
    S_DROPPED,
    S_GPU,
    STATE_OF_TIER,
    PageTable,
    by_value,
)
from kvtier.policy.admission import create_admission
from kvtier.policy.base import NO_META, RowMeta, RowPolicy
from kvtier.policy.registry import create_row_policy
from kvtier.pool import Pool
from kvtier.quotas import TenantLedger, parse_quotas
from kvtier.readiness import ReadyEvents
from kvtier.scheduler import TransferScheduler
from kvtier.starts import INLINE_RESTORE_BYTES, Starts
from kvtier.stats import EngineCounters
from kvtier.tiers.base import DiskRecord, DiskSlot
from kvtier.tiers.pinned import HostArena
from kvtier.transfer import build_handlers, build_inline_restore
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.types import Direction, PoolId, Tier

if TYPE_CHECKING:
    from kvtier.remote import RemoteTier
    from kvtier.tiers.disk import DiskStore

COMPLETE_CHUNK = 4096  # pages finished per engine-lock hold (a restore arriving waits one)
YIELD_CHUNK = 1024  # ... while a restore is waiting, for offload batches
YIELD_S = 0.0001  # and the pause between those chunks that lets the restore's thread in
_KEY_TIER, _KEY_POOL = 58, 28  # ``groups`` packs (tier, pool, page size) into one int64


class EngineCore:
    """State and mechanism shared by the public engine, prefix store and watermark thread."""

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        # Every GPU the daemon serves, the default (first) one as ``device``: per GPU its pools,
        # copy handlers, lanes and inline restore; the CPU and disk tiers are shared.
        self.devices = tuple(torch.device(d) for d in config.resolved_devices())
        self.device = self.devices[0]
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        self.landings = Landings(lock)  # CPU->GPU moves ended; acquires wait for theirs
        self.table = PageTable()
        self.pools: dict[PoolId, Pool] = {}
        self.counters = EngineCounters()
        self.ledger = TenantLedger(parse_quotas(config.tenant_quotas))  # bytes per tenant
        self.events = EventHub()
        cuda = self.device.type == "cuda"
        chunk = max(4096, min(config.pinned_chunk_mb * MIB, config.cpu_budget_bytes) // 4096 * 4096)
        self.host = HostArena(config.cpu_budget_bytes, chunk, pin=cuda)
        self.disk: DiskStore | None = None
        self.remote: RemoteTier | None = None  # set by the engine (``kvtier.remote.open_remote``)
        if config.disk_budget_bytes:
            from kvtier.tiers.disk import DiskStore

            self.disk = DiskStore(
                config.disk_path,
                config.disk_budget_bytes,
                direct_io=config.disk_direct_io,
                io_threads=config.disk_io_threads,
            )
        create_row_policy(config.policy)  # fail at start on an unknown name
        self.cpu_policy: dict[int, RowPolicy] = {}
        self.disk_policy: dict[int, RowPolicy] = {}
        self.ready = ReadyEvents(self.device)
        self.restore_waiters = 0  # acquires waiting on a restore (offload completions yield)
        self.admission = create_admission(config.disk_admission)
        self.closed = False
        handlers = build_handlers(self.device, self.host, self.disk, config.batch_bytes)
        gpus = {str(d): build_handlers(d, self.host, None, config.batch_bytes)
                for d in self.devices[1:]}
        self.inline_restores = {
            str(d): build_inline_restore(d, self.host, INLINE_RESTORE_BYTES) for d in self.devices
        }
        self.scheduler = TransferScheduler(
            handlers,
            batch_bytes=config.batch_bytes,
            max_inflight_bytes=config.max_inflight_mb * MIB,
            on_complete=self.complete,
            try_complete=functools.partial(self.complete, wait=False),
            device=str(self.device),
            gpus=gpus,
        )
        self.cascade = Cascade(self)
        self.bulk = BulkMoves(self)
        self.starts = Starts(self)
        self._reload_disk()

    def _reload_disk(self) -> None:
        """Keyed pages persisted by an earlier process come back as DISK pages."""
        if self.disk is None:
            return
        t = self.table
        for page_size, slot, record in self.disk.records():
            if t.keyed(record.key) is not None:
                continue
            rows = t.new_rows(1)
            t.size[rows], t.prio[rows], t.length[rows] = page_size, 1.0, 1
            t.add_key(int(rows[0]), record.key, record.tenant)
            t.owner[rows] = self.ledger.owner(record.tenant)
            self.settle(rows, Tier.DISK, np.array([slot], dtype=np.int64), None)

    def pool_of(self, pool_id: PoolId) -> Pool:
        """The pool, or ``NotFound`` (the same answer for another tenant's ids)."""
        pool = self.pools.get(pool_id)
        if pool is None:
            raise NotFound(f"pool {pool_id} not found")
        return pool

    def inline_restore(self, device: str) -> TransferHandler:
        """The inline CPU->GPU handler of a pool's ``device`` (the default one's otherwise)."""
        return self.inline_restores.get(device) or self.inline_restores[str(self.device)]

    def device_of(self, pool_id: PoolId) -> str | None:
        """A pool's device, read without the lock (None: no such pool; the caller's checks
        under the lock report it)."""
        pool = self.pools.get(pool_id)
        return pool.dev.device if pool is not None else None

    def check_open(self) -> None:
        if self.closed:
            raise Unavailable("the engine is shut down")

    # -- policies per tier ----------------------------------------------------------------------
    def new_policy(self) -> RowPolicy:
        return create_row_policy(self.config.policy)

    def policy_of(self, tier: Tier, pool: Pool | None, page_size: int) -> RowPolicy:
        if tier is Tier.GPU:
            assert pool is not None
            return pool.policy
        table = self.cpu_policy if tier is Tier.CPU else self.disk_policy
        policy = table.get(page_size)
        if policy is None:
            policy = table[page_size] = self.new_policy()
        return policy

    def meta(self, rows: np.ndarray) -> RowMeta:
        t = self.table
        return RowMeta(t.prio[rows], t.pos[rows], t.length[rows])

    def groups(self, rows: np.ndarray) -> list[tuple[Tier, Pool | None, int, np.ndarray]]:
        """``rows`` split by (tier, pool, page size), one part each, in first-seen order."""
        if not len(rows):
            return []
        t = self.table
        key = (t.tier[rows].astype(np.int64) << _KEY_TIER) | (t.pool[rows] << _KEY_POOL)
        key |= t.size[rows]
        out = []
        for k, pos in by_value(key):
            pool_id = (k >> _KEY_POOL) & ((1 << (_KEY_TIER - _KEY_POOL)) - 1)
            pool = self.pools.get(PoolId(pool_id)) if pool_id else None
            part = rows if len(pos) == len(rows) else rows[pos]
            out.append((Tier(k >> _KEY_TIER), pool, k & ((1 << _KEY_POOL) - 1), part))
        return out

    # -- settled pages -----------------------------------------------------------------------
    def settle(self, rows: np.ndarray, tier: Tier, slots: np.ndarray, pool: Pool | None) -> None:
        """Make ``tier``/``slots`` the pages' home and let the tier's policy track them."""
        t = self.table
        t.state[rows], t.tier[rows], t.slot[rows] = STATE_OF_TIER[tier], tier, slots
        if tier is Tier.GPU:
            assert pool is not None
            pool.slot_rows[slots] = rows
        size = int(t.size[rows[0]])
        self.ledger.settled[tier] += self.ledger.per_owner(t.owner[rows], size)
        policy = self.policy_of(tier, pool, size)
        policy.insert(rows, self.meta(rows) if policy.uses_meta else NO_META)

    def unsettle(self, rows: np.ndarray, tier: Tier, pool: Pool | None, page_size: int) -> None:
        """The pages' bytes are about to leave (or be freed from) their current tier."""
        self.policy_of(tier, pool, page_size).remove(rows)
        self.ledger.settled[tier] -= self.ledger.per_owner(self.table.owner[rows], page_size)
        if tier is Tier.GPU:
            assert pool is not None
            pool.slot_rows[self.table.slot[rows]] = -1

    def free_slots(self, tier: Tier, page_size: int, slots: np.ndarray, pool: Pool | None) -> None:
        if not len(slots):
            return
        if tier is Tier.GPU:
            assert pool is not None
            pool.dev.give(slots)
        elif tier is Tier.CPU:
            self.host.free_array(page_size, slots)
        else:
            assert self.disk is not None
            listed = slots.tolist()
            for slot in listed:
                self.disk.clear_record(page_size, DiskSlot(slot))
            self.disk.free(page_size, listed)

    def release(self, rows: np.ndarray) -> None:
        """Forget settled or dropped pages (never moving ones) and free their slots."""
        t = self.table
        states = t.state[rows]
        settled = rows[(states >= S_GPU) & (states <= S_DISK)]
        for tier, pool, size, part in self.groups(settled):
            self.unsettle(part, tier, pool, size)
            self.free_slots(tier, size, t.slot[part], pool)
        pinned = rows[t.pins[rows] > 0]
        for pool_id, pos in by_value(t.pool[pinned]):
            owner = self.pools.get(PoolId(pool_id))
            if owner is not None:
                owner.pinned -= len(pos)
        t.remove(rows)

    def drop(self, rows: np.ndarray, reason: str) -> None:
        """The pages' bytes are gone (settled rows): pool pages stay in the table as DROPPED
        until freed, keyed pages are forgotten."""
        t = self.table
        tiers, pools = t.tier[rows].tolist(), t.pool[rows].tolist()
        for tier, pool, size, part in self.groups(rows):
            self.unsettle(part, tier, pool, size)
            self.free_slots(tier, size, t.slot[part], pool)
        t.state[rows], t.slot[rows] = S_DROPPED, -1
        self.counters.drop(reason, len(rows))
        self.ledger.drop(reason, t.owner[rows])
        if self.events.active:
            for page_id, tier, pool_id in zip(t.ids(rows).tolist(), tiers, pools, strict=True):
                self.events.publish(Event("dropped", pool_id or None, page_id, Tier(tier), None))
        t.remove(rows[t.pool[rows] == 0])

    # -- pins --------------------------------------------------------------------------------
    def pin(self, pool: Pool, rows: np.ndarray, times: np.ndarray | int = 1) -> None:
        pins = self.table.pins
        pool.pinned += int(np.count_nonzero(pins[rows] == 0))
        pins[rows] += times

    def unpin(self, pool: Pool, rows: np.ndarray) -> None:
        pins = self.table.pins
        pins[rows] -= 1
        pool.pinned -= int(np.count_nonzero(pins[rows] == 0))

    def land(self, pool: Pool, rows: np.ndarray) -> None:
        """Pages that just reached the GPU (``settle`` has just put them in the pool's policy):
        each waiting acquire's pin is taken at once, before anything can evict them, and its
        access counted (a hit each, one policy touch), here on the lane rather than in the
        acquire's tail after its last page landed."""
        t = self.table
        waiting = t.waiting[rows]
        if not waiting.all():  # counts are >= 0: all() is "every page is waited for"
            some = np.flatnonzero(waiting)
            if not len(some):
                return
            rows, waiting = rows[some], waiting[some]
        # A page off the GPU carries no pins (only resident pages are pinned; a pinned page
        # never moves), so the waits simply become its pins.
        t.pins[rows] = waiting
        pool.pinned += len(rows)
        t.waiting[rows] = 0
        t.hits[rows] += waiting
        if pool.policy.touch_after_insert:  # ``settle`` inserted them just now
            pool.policy.touch(rows)

    def protect(self, rows: np.ndarray) -> None:
        self.table.protect[rows] += 1

    def unprotect(self, rows: np.ndarray) -> None:
        """Distinct rows; a row removed meanwhile has ``protect`` 0 and stays so."""
        protect = self.table.protect
        protect[rows] = np.maximum(protect[rows] - 1, 0)

    # -- complete --------------------------------------------------------------------------------
    def complete(
        self, batch: Moves, results: list[bool], seconds: float, *, wait: bool = True
    ) -> bool:
        """Finish a batch, a chunk of pages per lock hold; slots go back to their tiers in bulk.
        ``wait=False``: only if the engine lock is free now, else False with nothing done (a
        lane then keeps launching copies while a caller holds the lock).

        Restores first, here too: while an acquire waits for a restore, an offload batch is
        finished in smaller chunks and yields between them, so the restore's own steps
        (start, completion, pin) never queue behind a whole offload batch.
        """
        if not self.cond.acquire(blocking=wait):
            return False
        try:
            start = self._complete_chunk(batch, results, seconds, 0)
        finally:
            self.cond.release()
        while start < len(batch):
            if self.restore_waiters and not batch.direction.is_restore:
                time.sleep(YIELD_S)
            with self.cond:
                start = self._complete_chunk(batch, results, seconds, start)
        return True

    def _complete_chunk(self, batch: Moves, results: list[bool], seconds: float, start: int) -> int:
        """Columns from ``start`` on, one chunk (lock held); returns where the next one starts."""
        n = len(batch)
        restoring = batch.direction.is_restore
        step = COMPLETE_CHUNK if restoring or not self.restore_waiters else YIELD_CHUNK
        end = min(n, start + step)
        frees = Frees()
        self.bulk.finish(batch, start, end, results, frees)
        if batch.direction is Direction.CPU_TO_GPU:
            self.landings.end(end - start)
        frees.apply(self)
        if end >= n:  # the last chunk also counts the batch
            self._count(batch, results, seconds)
            self._count_tenants(batch, results)
            if batch.copy:
                batch.report(results)
        self.cond.notify_all()
        return end

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
        c.observe(ok_pages * batch.page_size, seconds)

    def _count_tenants(self, batch: Moves, results: list[bool]) -> None:
        """The batch's successful pages, per tenant (one bincount)."""
        rows = batch.rows
        if len(rows) and results.count(True) != len(rows):
            rows = rows[np.array(results, dtype=bool)]
        self.ledger.count_moved(batch.direction, self.table.owner[rows], batch.page_size)

    def wake_all(self) -> None:
        """Wake every waiter (lock held): the engine is closing."""
        self.cond.notify_all()
        self.landings.wake()

    def cancel(self, rows: np.ndarray) -> np.ndarray:
        """Take back the queued (not started) moves of ``rows``: those pages stay where they
        were. Returns the rows cancelled; the others' moves are under way (or there are none).
        One pass per distinct batch, whatever the number of rows."""
        numbers = self.table.move[rows]
        live = np.flatnonzero(numbers)
        if not len(live):
            return rows[:0]
        done: list[np.ndarray] = []
        for number, pos in by_value(numbers[live]):
            batch = self.bulk.batch(number)
            if batch is None:  # every column already taken by a lane
                continue
            got, srcs, dsts = self.scheduler.cancel(batch, rows[live[pos]])
            if not len(got):
                continue
            self.counters.cancelled_offloads += 0 if batch.direction.is_restore else len(got)
            if batch.direction is Direction.CPU_TO_GPU:
                self.landings.end(len(got))
            frees = Frees()
            failed = np.zeros(len(got), dtype=bool)
            self.bulk.finish_cols(batch.direction, got, srcs, dsts, failed, frees, corrupt=False)
            frees.apply(self)
            done.append(got)
        return np.concatenate(done) if done else rows[:0]

    def set_disk_records(self, rows: np.ndarray, page_size: int) -> None:
        """Keyed pages that reached the disk: their records make them findable after a restart."""
        if self.disk is None:
            return
        t = self.table
        for row, slot in zip(rows.tolist(), t.slot[rows].tolist(), strict=True):
            key = t.key_of.get(row)
            if key is not None:
                record = DiskRecord(key=key, tenant=t.tenant_of[row])
                self.disk.set_record(page_size, DiskSlot(slot), record)
        self.disk.write_records()  # before any lookup can answer DISK for these keys
