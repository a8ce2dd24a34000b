"""Placement: where each settled page lives, and the bookkeeping that goes with it.

The layer the move machinery stands on (``bulk``, ``cascade``, ``starts``, ``completion``
receive it; ``EngineCore`` is one, extended with the lock, the lanes and those pieces).

Contract (every method runs with the engine lock held):
    * It holds the page table, the pools, the CPU and disk tiers, a row policy per tier (per
      pool on the GPU, per page size below), the tenant ledger, counters and events.
    * ``settle(rows, tier, slots, pool)`` makes ``tier``/``slots`` the pages' home and puts
      them in that tier's policy; ``unsettle`` takes them out before their bytes leave;
      ``free_slots`` gives slots back to their tier; ``release`` forgets settled or dropped pages
      (freeing their slots); ``drop`` loses settled pages' bytes (counted and published).
    * ``settle``/``unsettle``/``release``/``drop`` take rows of one tier, pool and page size
      (``groups`` splits any rows so).
    * ``pin``/``unpin``/``land``/``protect``/``unprotect`` keep the pools' pinned counts in step
      with the table's pins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvtier.config import OffloadConfig
from kvtier.errors import NotFound, Unavailable
from kvtier.events import Event, EventHub
from kvtier.pagetable import PageTable, by_value
from kvtier.policy.admission import create_admission
from kvtier.policy.base import NO_META, RowMeta, RowPolicy
from kvtier.policy.registry import create_row_policy
from kvtier.pool import Pool
from kvtier.quotas import TenantLedger, parse_quotas
from kvtier.stats import EngineCounters
from kvtier.tiers.base import DiskRecord, DiskSlot
from kvtier.tiers.pinned import HostArena
from kvtier.types import PoolId, Tier

if TYPE_CHECKING:
    from kvtier.tiers.medium import SlotMedium

_KEY_TIER, _KEY_POOL = 58, 28  # ``groups`` packs (tier, pool, page size) into one int64


class Placement:
    """Settled pages, their tiers' slots and policies, pins (see the module docstring)."""

    def __init__(self, config: OffloadConfig, host: HostArena, disk: SlotMedium | None) -> None:
        """``disk``: the tier chain's medium below the CPU (``Tier.DISK``; the disk store
        unless the chain names another), None when the chain has none or it is off."""
        self.config = config
        self.table = PageTable()
        self.pools: dict[PoolId, Pool] = {}
        self.counters = EngineCounters()
        self.ledger = TenantLedger(parse_quotas(config.tenant_quotas))  # bytes per tenant
        self.events = EventHub()
        self.host = host
        self.disk = disk
        # The open tiers of the chain, top down, and the slot media below the CPU by tier.
        self.media: dict[Tier, SlotMedium] = {} if disk is None else {Tier.DISK: disk}
        self.chain = (Tier.GPU, Tier.CPU, *self.media)
        create_row_policy(config.policy)  # fail at start on an unknown name
        # Below the GPU (whose policies are its pools'): a policy per tier and page size.
        self.policies: dict[Tier, dict[int, RowPolicy]] = {t: {} for t in self.chain[1:]}
        self.admission = create_admission(config.disk_admission)
        self.closed = False

    def pool_of(self, pool_id: PoolId) -> Pool:
        """The pool, or ``NotFound`` (the same answer for another tenant's ids)."""
        pool = self.pools.get(pool_id)
        if pool is None:
            raise NotFound(f"pool {pool_id} not found")
        return pool

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
        table = self.policies[tier]
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
        t.settle(rows, tier, slots)
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
            medium = self.media[tier]
            listed = slots.tolist()
            for slot in listed:
                medium.clear_record(page_size, DiskSlot(slot))
            medium.free(page_size, listed)

    def release(self, rows: np.ndarray) -> None:
        """Forget settled or dropped pages (never moving ones) and free their slots."""
        t = self.table
        settled = rows[t.settled(rows)]
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
        t.mark_dropped(rows)
        self.counters.drop(reason, len(rows))
        self.ledger.drop(reason, t.owner[rows])
        if self.events.active:
            for page_id, tier, pool_id in zip(t.ids(rows).tolist(), tiers, pools, strict=True):
                self.events.publish(Event("dropped", pool_id or None, page_id, Tier(tier), None))
        t.remove(rows[t.pool[rows] == 0])

    def set_disk_records(self, rows: np.ndarray, page_size: int, tier: Tier = Tier.DISK) -> None:
        """Keyed pages that reached a slot medium: their records make them findable after a
        restart."""
        medium = self.media.get(tier)
        if medium is None:
            return
        t = self.table
        for row, slot in zip(rows.tolist(), t.slot[rows].tolist(), strict=True):
            key = t.key_of.get(row)
            if key is not None:
                record = DiskRecord(key=key, tenant=t.tenant_of[row])
                medium.set_record(page_size, DiskSlot(slot), record)
        medium.write_records()  # before any lookup can answer DISK for these keys

    # -- pins --------------------------------------------------------------------------------
    def pin(self, pool: Pool, rows: np.ndarray, times: np.ndarray | int = 1) -> None:
        pool.pinned += self.table.pin(rows, times)

    def unpin(self, pool: Pool, rows: np.ndarray) -> None:
        pool.pinned -= self.table.unpin(rows)

    def land(self, pool: Pool, rows: np.ndarray) -> None:
        """Pages that just reached the GPU (``settle`` has just put them in the pool's policy):
        each waiting acquire's pin is taken at once, before anything can evict them, and its
        access counted (a hit each, one policy touch), here on the lane rather than in the
        acquire's tail after its last page landed."""
        rows = self.table.land(rows)
        if not len(rows):
            return
        pool.pinned += len(rows)
        if pool.policy.touch_after_insert:  # ``settle`` inserted them just now
            pool.policy.touch(rows)

    def protect(self, rows: np.ndarray) -> None:
        self.table.guard(rows)

    def unprotect(self, rows: np.ndarray) -> None:
        """Distinct rows; a row removed meanwhile has ``protect`` 0 and stays so."""
        self.table.unguard(rows)
