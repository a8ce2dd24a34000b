"""The cascade: making room in the tiers below the GPU by walking the tier chain down.

Contract: ``slots(tier, ...)`` (``cpu_slots`` for the CPU) returns up to ``n`` slots of a tier,
evicting that tier's victims (never protected pages) one step down the chain when it is full
(``demote``): into the next open tier (``Placement.chain``) when it has (or can make, the same
way) room, from the CPU only when the admission rule agrees; otherwise they are dropped and
counted (``<tier>_full``, ``no_admission``). The last tier drops its own victims, never a page
a restore is waiting for. Drops are published as events. Runs under the engine lock.

The cascade stands on the placement (tiers, policies, ledger) and queues its moves down
through a ``MoveStarter`` (``kvtier.moves.starter.Starter``, which builds the cascade it uses).

With tenant quotas (``kvtier.tenancy.quotas``) the slots are asked for on behalf of one tenant
(``owner``): a tenant at its quota makes room from its own pages first and gets no more than its
quota allows; room in a full tier comes only from the requester's own pages and from tenants
over their quota (or without one), never from a tenant within its quota. Without quotas every
tracked page may be a victim, as the policy orders them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvtier.policy.base import RowFilter
from kvtier.state.placement import Placement
from kvtier.state.table import EMPTY, by_value
from kvtier.types import BELOW_CPU, Direction, PageId, PageMeta, Tier, level_name


class MoveStarter(Protocol):
    """What the cascade needs to queue the moves it decides on."""

    def start_many(
        self, rows: np.ndarray, direction: Direction, dsts: np.ndarray, *, urgent: bool
    ) -> int: ...


class Cascade:
    def __init__(self, place: Placement, starter: MoveStarter) -> None:
        self._place = place
        self._starter = starter

    def _protected(self, rows: np.ndarray) -> np.ndarray:
        """Pages a load keeps (``protect``) or an acquire waits for (``waiting``)."""
        t = self._place.table
        return (t.protect[rows] > 0) | (t.waiting[rows] > 0)

    def _victims_of(self, tier: int, owners: np.ndarray | None) -> RowFilter:
        """``protected`` for a tier's policy: the usual pages, and with quotas every page whose
        tenant may not be displaced (within its quota) unless its owner is in ``owners``."""
        place = self._place
        if not place.ledger.active:
            return self._protected
        allowed = place.ledger.evictable(place.wire[tier])
        if owners is not None:
            allowed = allowed.copy()
            allowed[owners] = True
        owner = place.table.owner

        def protected(rows: np.ndarray) -> np.ndarray:
            return self._protected(rows) | ~allowed[owner[rows]]

        return protected

    def _own_only(self, owner: int) -> RowFilter:
        owners = self._place.table.owner
        return lambda rows: self._protected(rows) | (owners[rows] != owner)

    def _evict(self, tier: int, page_size: int, n: int, protected: RowFilter) -> np.ndarray:
        """Up to ``n`` victims of the tier's policy, counted (the caller moves or drops them)."""
        place = self._place
        policy = place.policies[tier].get(page_size)
        if policy is None or not len(policy) or n <= 0:
            return EMPTY
        victims = policy.evict(n, protected, partial=True)
        if victims is None or not len(victims):
            return EMPTY
        self._count_evictions(tier, victims)
        policy.insert(victims, place.meta(victims))  # back in, so ``unsettle`` is uniform
        return victims

    def _count_evictions(self, tier: int, victims: np.ndarray) -> None:
        place = self._place
        wire = place.wire[tier]
        place.counters.evictions[wire] += len(victims)
        place.level_evictions[tier] += len(victims)
        place.ledger.evictions[wire] += place.ledger.per_owner(place.table.owner[victims])

    def fit_quota(self, tier: int, owner: int, page_size: int, n: int) -> int:
        """How many of ``n`` pages ``owner`` may bring into level ``tier``, after pushing its
        own pages out of it (down the cascade from the CPU; dropped below it) to stay within
        its quota (quotas are per wire tier: every medium below the CPU counts as DISK)."""
        place = self._place
        room = place.ledger.room(place.wire[tier], owner) if owner else None
        if room is None or room // page_size >= n:
            return n
        allowed = room // page_size
        victims = self._evict(tier, page_size, n - allowed, self._own_only(owner))
        if len(victims):
            if tier == Tier.CPU:
                self.demote(tier, victims, page_size)
            else:
                place.drop(victims, "tenant_quota")
        return allowed + len(victims)

    def _below(self, tier: int) -> int | None:
        """The next open level of the chain under ``tier`` (None: ``tier`` is the last)."""
        return tier + 1 if tier + 1 < len(self._place.chain) else None

    def _alloc(self, tier: int, page_size: int, n: int) -> np.ndarray | None:
        """``n`` free slots of ``tier``, all or nothing (the CPU's contiguous when it can)."""
        if tier == Tier.CPU:
            return self._place.host.alloc_array(page_size, n)
        got = self._place.media[tier].alloc(page_size, n)
        return None if got is None else np.array(got, dtype=np.int64)

    def cpu_slots(self, page_size: int, n: int, owner: int = 0) -> np.ndarray:
        """Up to ``n`` CPU slots (contiguous when possible), evicting down the cascade for room;
        ``owner``: the tenant the slots are for (its quota applies)."""
        if self._place.ledger.active:
            n = self.fit_quota(Tier.CPU, owner, page_size, n)
            if not n:
                return EMPTY
        owners = np.array([owner], dtype=np.int64) if owner else None
        return self.slots(Tier.CPU, page_size, n, owners)

    def slots(self, tier: int, page_size: int, n: int, owners: np.ndarray | None) -> np.ndarray:
        """Up to ``n`` slots of ``tier``, making room (``make_room``) when it is full, then as
        many as there are, one at a time. ``owners``: tenants whose pages may make the room
        (with quotas)."""
        got = self._alloc(tier, page_size, n)
        if got is None and tier == self._place.record_level and (
                self._place.reclaim_copies(page_size, n)):  # copies give way first
            got = self._alloc(tier, page_size, n)
        if got is None:
            # Below the CPU, with a level under it: room already on its way (pages moving
            # down out of it) counts, or each retry would push yet more pages down the chain.
            middle = tier >= BELOW_CPU and self._below(tier) is not None
            need = n - self._place.leaving.get((tier, page_size), 0) if middle else n
            if need > 0:
                self.make_room(tier, page_size, need, owners)
            got = self._alloc(tier, page_size, n)
        if got is None and tier == Tier.CPU:  # the budget may be held by other page sizes
            self._vacate_chunk(page_size, owners, bool(self._place.policies[tier].get(page_size)))
        if got is None:  # as many as there are, one at a time
            parts: list[np.ndarray] = []
            while len(parts) < n and (one := self._alloc(tier, page_size, 1)) is not None:
                parts.append(one)
            got = np.concatenate(parts) if parts else EMPTY
        return got

    def _vacate_chunk(self, page_size: int, owners: np.ndarray | None, own: bool) -> None:
        """The CPU tier has no slot of ``page_size`` and its budget is taken by chunks (each
        page size has chunks of its own): send the pages of the other sizes' chunk with the
        fewest in use one step down, so it empties and its budget comes free. Otherwise a
        tenant storing a few blocks of many page sizes could keep every other size out of the
        CPU tier, or (``own``: ``page_size`` has pages of its own to push out) down to a chunk.
        With ``own``, only a chunk at most a quarter used is emptied. One chunk at a time
        (none while one's pages are still on their way out), and only one whose every page
        may be a victim; a tenant's quota does not keep a chunk at most a quarter used (it
        holds the whole chunk's budget for a few pages: with one block at each of four page
        sizes, a tenant within a 1 MiB quota held all 4 MiB of a CPU tier, and another tenant
        within its own quota stored nothing)."""
        place, t = self._place, self._place.table
        protected = self._victims_of(Tier.CPU, owners)
        for size, first, per, used in place.host.chunks_in_use(exclude=page_size):
            if own and used * 4 > per:
                return  # sorted: no sparser chunk follows
            rows = t.settled_in_slots(Tier.CPU, size, first, first + per)
            if len(rows) < used:  # some moving in or out: wait for them
                if not len(rows):
                    return  # a chunk being emptied (or filled): its end frees budget first
                continue
            keeps = self._protected if used * 4 <= per else protected
            if keeps(rows).any():
                continue
            self._count_evictions(Tier.CPU, rows)
            self.demote(Tier.CPU, rows, size)
            return

    def make_room(self, tier: int, page_size: int, n: int, owners: np.ndarray | None) -> None:
        """Push ``n`` of ``tier``'s victims one step down the chain (never a page a restore
        is waiting for)."""
        victims = self._evict(tier, page_size, n, self._victims_of(tier, owners))
        if len(victims):
            self.demote(tier, victims, page_size)

    def demote(self, tier: int, rows: np.ndarray, page_size: int) -> None:
        """Victims of ``tier`` go to the next tier of the chain (from the CPU: if admitted)
        when it has room, else they are dropped."""
        place = self._place
        below = self._below(tier)
        if below is None:
            place.drop(rows, _full(tier))
            return
        if tier == Tier.CPU:
            rows = self._back_on_copies(rows, below, page_size)
            rows = self._admitted(rows)
        if place.ledger.active:
            rows = self.fit_quotas(below, rows, page_size)
        if not len(rows):
            return
        owners = np.unique(place.table.owner[rows])
        dsts = self.slots(below, page_size, len(rows), owners)
        # The last level makes room at once (its victims are dropped): what still gets no slot
        # there is dropped. A level with one under it makes room by moves that free its slots
        # only when they end: victims it has no slot for yet stay where they are, for later.
        if len(dsts) < len(rows) and self._below(below) is None:
            place.drop(rows[len(dsts) :], _full(below))
        self._starter.start_many(rows[: len(dsts)], Direction((tier, below)), dsts, urgent=False)

    def _back_on_copies(self, rows: np.ndarray, below: int, page_size: int) -> np.ndarray:
        """CPU victims whose bytes are still at ``below`` (copies) settle there again, without
        a write or the admission rule's say; the others are returned."""
        place = self._place
        if below != place.record_level:
            return rows
        copied = place.has_copy(rows, page_size)
        if not copied.any():
            return rows
        back = rows[copied]
        if place.ledger.active:
            back = self.fit_quotas(below, back, page_size)
        place.settle_on_copies(back, page_size)
        return rows[~copied]

    def _admitted(self, rows: np.ndarray) -> np.ndarray:
        """The CPU victims the admission rule lets below the CPU; the others are dropped."""
        place, t = self._place, self._place.table
        admit = np.fromiter(
            (
                place.admission.admit(PageMeta(PageId(r), p, q, n), h)
                for r, p, q, n, h in zip(
                    rows.tolist(),
                    t.prio[rows].tolist(),
                    t.pos[rows].tolist(),
                    t.length[rows].tolist(),
                    t.hits[rows].tolist(),
                    strict=True,
                )
            ),
            dtype=bool,
            count=len(rows),
        )
        if not admit.all():
            place.drop(rows[~admit], "no_admission")
        return rows[admit]

    def fit_quotas(self, tier: int, rows: np.ndarray, page_size: int) -> np.ndarray:
        """The rows each tenant's quota in ``tier`` lets in (after dropping its own pages
        there for room); the others are dropped."""
        owners = self._place.table.owner[rows]
        keep: list[np.ndarray] = []
        for owner, pos in by_value(owners):
            part = rows if len(pos) == len(rows) else rows[pos]
            n = self.fit_quota(tier, owner, page_size, len(part))
            if n < len(part):
                self._place.drop(part[n:], "tenant_quota")
            keep.append(part[:n])
        return np.concatenate(keep) if keep else EMPTY


def _full(level: int) -> str:
    """The drop reason of a full level: ``cpu_full``, ``disk_full`` (every medium below the CPU:
    the reasons stay a fixed set, ``metrics.DROP_REASONS``)."""
    return f"{level_name(min(level, BELOW_CPU)).lower()}_full"
