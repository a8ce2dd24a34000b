"""Placement: where each settled page lives, and the bookkeeping that goes with it.

The layer the move machinery stands on (``bulk``, ``cascade``, ``starts``, ``completion``
receive it; ``EngineCore`` is one, extended with the lock, the lanes and those pieces).

Contract (every method runs with the engine lock held):
    * It holds the page table, the pools, the open levels of the tier chain (``chain``: 0 the
      GPU, 1 the CPU, then the slot media below it in order, ``media`` by level), a row policy
      per level (per pool on the GPU, per page size below), the tenant ledger, counters and
      events. ``wire[level]`` is the ``Tier`` a level reports (every slot medium declares its
      own; the ledger's quotas and the counters are per wire tier, ``level_counts`` per level).
    * ``settle(rows, tier, slots, pool)`` makes ``tier``/``slots`` the pages' home and puts
      them in that tier's policy; ``unsettle`` takes them out before their bytes leave;
      ``free_slots`` gives slots back to their tier; ``release`` forgets settled or dropped pages
      (freeing their slots); ``drop`` loses settled pages' bytes (counted and published).
    * ``settle``/``unsettle``/``release``/``drop`` take rows of one tier, pool and page size
      (``groups`` splits any rows so).
    * ``pin``/``unpin``/``land``/``protect``/``unprotect`` keep the pools' pinned counts in step
      with the table's pins.
    * Copies: a keyed page read up from the record level (the first medium whose records survive
      a restart, when it is the one right under the CPU) into the CPU tier keeps its slot and
      record there (``keep_copies``), so a crash still finds it (it was the hottest keys a
      kill -9 lost). Going back down it settles on that slot without a write
      (``settle_on_copies``); leaving the CPU tier any other way (``release``, ``drop``) frees
      it; a full record level takes its room from copies first (``reclaim_copies``): losing
      one costs a crash's durability, never a hit. A copy is not in the tenant ledger (its
      disk quota): copies are bounded by the tenant's CPU-tier pages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.config import OffloadConfig
from kvtier.errors import NotFound, Unavailable
from kvtier.policy.admission import create_admission
from kvtier.policy.base import NO_META, RowMeta, RowPolicy
from kvtier.policy.registry import create_row_policy
from kvtier.state.events import Event, EventHub
from kvtier.state.pool import Pool
from kvtier.state.table import PageTable, by_value
from kvtier.stats import EngineCounters, MediumStats
from kvtier.tenancy.quotas import TenantLedger, parse_quotas
from kvtier.tiers.base import MediumSlot, SlotRecord
from kvtier.tiers.pinned import HostArena
from kvtier.types import BELOW_CPU, PoolId, Tier

if TYPE_CHECKING:
    from kvtier.tiers.medium import SlotMedium
    from kvtier.tiers.registry import ChainMedium

_KEY_TIER, _KEY_POOL = 58, 28  # ``groups`` packs (tier, pool, page size) into one int64


class Placement:
    """Settled pages, their tiers' slots and policies, pins (see the module docstring)."""

    def __init__(
        self, config: OffloadConfig, host: HostArena, below: Sequence[ChainMedium] = ()
    ) -> None:
        """``below``: the open slot media of the tier chain under the CPU, top down (levels
        ``BELOW_CPU``, ...; none when the chain ends at the CPU)."""
        self.config = config
        self.table = PageTable()
        self.pools: dict[PoolId, Pool] = {}
        self.counters = EngineCounters()
        self.ledger = TenantLedger(parse_quotas(config.tenant_quotas))  # bytes per tenant
        self.events = EventHub()
        self.host = host
        # The open levels of the chain, top down; the slot media below the CPU by level.
        self.media: dict[int, SlotMedium] = {
            BELOW_CPU + i: m.store for i, m in enumerate(below)}
        self.chain: tuple[int, ...] = tuple(range(BELOW_CPU + len(below)))
        self.names = ("gpu", "cpu", *(m.name for m in below))
        self.wire = (Tier.GPU, Tier.CPU, *(m.tier for m in below))
        # The first level whose records survive a restart (the shutdown flush writes there).
        self.record_level = next(
            (BELOW_CPU + i for i, m in enumerate(below) if m.keeps_records), None)
        self.level_evictions = [0] * len(self.chain)
        # page size -> keyed CPU row -> its slot at ``record_level`` (oldest first).
        self.copies: dict[int, OrderedDict[int, int]] = {}
        # (level, page size) -> pages moving down out of a medium: room on its way there.
        self.leaving: dict[tuple[int, int], int] = {}
        create_row_policy(config.policy)  # fail at start on an unknown name
        # Below the GPU (whose policies are its pools'): a policy per level and page size.
        self.policies: dict[int, dict[int, RowPolicy]] = {t: {} for t in self.chain[1:]}
        self.admission = create_admission(config.disk_admission)
        self.closed = False

    def pool_of(self, pool_id: PoolId) -> Pool:
        """The pool, or ``NotFound`` (the same answer for another tenant's ids, and for a pool
        being detached: nothing new is handed out of it, and a second detach is refused)."""
        pool = self.pools.get(pool_id)
        if pool is None or pool.detaching:
            raise NotFound(f"pool {pool_id} not found")
        return pool

    def check_open(self) -> None:
        if self.closed:
            raise Unavailable("the engine is shut down")

    # -- policies per tier ----------------------------------------------------------------------
    def new_policy(self) -> RowPolicy:
        return create_row_policy(self.config.policy)

    def policy_of(self, tier: int, pool: Pool | None, page_size: int) -> RowPolicy:
        if tier == Tier.GPU:
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

    def groups(self, rows: np.ndarray) -> list[tuple[int, Pool | None, int, np.ndarray]]:
        """``rows`` split by (level, pool, page size), one part each, in first-seen order."""
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
            out.append((k >> _KEY_TIER, pool, k & ((1 << _KEY_POOL) - 1), part))
        return out

    # -- settled pages -----------------------------------------------------------------------
    def settle(self, rows: np.ndarray, tier: int, slots: np.ndarray, pool: Pool | None) -> None:
        """Make level ``tier``/``slots`` the pages' home and let its policy track them."""
        t = self.table
        t.settle(rows, tier, slots)
        if tier == Tier.GPU:
            assert pool is not None
            pool.slot_rows[slots] = rows
        size = int(t.size[rows[0]])
        self.ledger.settled[self.wire[tier]] += self.ledger.per_owner(t.owner[rows], size)
        policy = self.policy_of(tier, pool, size)
        policy.insert(rows, self.meta(rows) if policy.uses_meta else NO_META)

    def unsettle(self, rows: np.ndarray, tier: int, pool: Pool | None, page_size: int) -> None:
        """The pages' bytes are about to leave (or be freed from) their current level."""
        self.policy_of(tier, pool, page_size).remove(rows)
        owners = self.table.owner[rows]
        self.ledger.settled[self.wire[tier]] -= self.ledger.per_owner(owners, page_size)
        if tier == Tier.GPU:
            assert pool is not None
            pool.slot_rows[self.table.slot[rows]] = -1

    def free_slots(self, tier: int, page_size: int, slots: np.ndarray, pool: Pool | None) -> None:
        if not len(slots):
            return
        if tier == Tier.GPU:
            assert pool is not None
            pool.dev.give(slots)
        elif tier == Tier.CPU:
            self.host.free_array(page_size, slots)
        else:
            medium = self.media[tier]
            listed = slots.tolist()
            for slot in listed:
                medium.clear_record(page_size, MediumSlot(slot))
            medium.free(page_size, listed)

    def release(self, rows: np.ndarray) -> None:
        """Forget settled or dropped pages (never moving ones) and free their slots."""
        t = self.table
        self.free_copies(rows)
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
        self.free_copies(rows)
        tiers, pools = t.tier[rows].tolist(), t.pool[rows].tolist()
        for tier, pool, size, part in self.groups(rows):
            self.unsettle(part, tier, pool, size)
            self.free_slots(tier, size, t.slot[part], pool)
        t.mark_dropped(rows)
        self.counters.drop(reason, len(rows))
        self.ledger.drop(reason, t.owner[rows])
        if self.events.active:
            for page_id, tier, pool_id in zip(t.ids(rows).tolist(), tiers, pools, strict=True):
                self.events.publish(Event("dropped", pool_id or None, page_id, self.wire[tier],
                                          None))
        t.remove(rows[t.pool[rows] == 0])

    def set_records(self, rows: np.ndarray, page_size: int, tier: int) -> None:
        """Keyed pages that reached the slot medium at level ``tier``: their records make them
        findable after a restart (a medium that keeps none ignores them)."""
        medium = self.media.get(tier)
        if medium is None:
            return
        t = self.table
        for row, slot in zip(rows.tolist(), t.slot[rows].tolist(), strict=True):
            key = t.key_of.get(row)
            if key is not None:
                record = SlotRecord(key=key, tenant=t.tenant_of[row])
                medium.set_record(page_size, MediumSlot(slot), record)
        medium.write_records()  # before any lookup can answer DISK for these keys

    # -- copies at the record level (see the module docstring) --------------------------------
    def keeps_copies(self, src: int, dst: int) -> bool:
        """Whether a move ``src`` -> ``dst`` keeps keyed pages' source slots as copies."""
        return dst == Tier.CPU and src == self.record_level == BELOW_CPU

    def keep_copies(self, rows: np.ndarray, slots: np.ndarray, page_size: int) -> None:
        """Keyed ``rows`` just settled in the CPU tier from ``slots`` of the record level."""
        copies = self.copies.setdefault(page_size, OrderedDict())
        copies.update(zip(rows.tolist(), slots.tolist(), strict=True))

    def has_copy(self, rows: np.ndarray, page_size: int) -> np.ndarray:
        copies = self.copies.get(page_size)
        if not copies:
            return np.zeros(len(rows), dtype=bool)
        return np.fromiter((r in copies for r in rows.tolist()), dtype=bool, count=len(rows))

    def settle_on_copies(self, rows: np.ndarray, page_size: int) -> None:
        """Settled CPU ``rows`` with copies go back to them: no bytes move."""
        if not len(rows):
            return
        level, copies = self.record_level, self.copies[page_size]
        assert level is not None
        slots = np.array([copies.pop(r) for r in rows.tolist()], dtype=np.int64)
        self.unsettle(rows, Tier.CPU, None, page_size)
        self.free_slots(Tier.CPU, page_size, self.table.slot[rows], None)
        self.settle(rows, level, slots, None)
        if self.events.active:
            for page_id in self.table.ids(rows).tolist():
                self.events.publish(Event("moved", None, page_id, Tier.CPU, self.wire[level]))

    def free_copies(self, rows: np.ndarray) -> None:
        """Give back the copies of ``rows`` (pages leaving the CPU tier other than down)."""
        if not len(rows) or not any(self.copies.values()):
            return
        rows = rows[self.table.pool[rows] == 0]  # only keyed pages have copies
        level = self.record_level
        assert level is not None
        for size, copies in self.copies.items():
            slots = [copies.pop(r) for r in rows.tolist() if r in copies]
            self.free_slots(level, size, np.array(slots, dtype=np.int64), None)

    def reclaim_copies(self, page_size: int, n: int) -> int:
        """Free up to ``n`` of the oldest copies of ``page_size``; how many were freed."""
        copies = self.copies.get(page_size)
        if not copies or self.record_level is None:
            return 0
        slots = [copies.popitem(last=False)[1] for _ in range(min(n, len(copies)))]
        self.free_slots(self.record_level, page_size, np.array(slots, dtype=np.int64), None)
        return len(slots)

    def leave(self, tier: int, page_size: int, n: int) -> None:
        """``n`` more (or, negative, fewer) pages moving down out of the medium at ``tier``."""
        key = (tier, page_size)
        self.leaving[key] = self.leaving.get(key, 0) + n

    def media_stats(self) -> tuple[MediumStats, ...]:
        """Each medium below the CPU, top down: bytes, pages settled there, evictions."""
        counts = self.table.tier_counts(tiers=len(self.chain)).tolist()
        return tuple(
            MediumStats(self.names[level], level, self.wire[level], m.used_bytes,
                        m.capacity_bytes, counts[level], self.level_evictions[level])
            for level, m in self.media.items()
        )

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
