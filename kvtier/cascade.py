"""The cascade: making room in the CPU and disk tiers.

Contract: ``cpu_slots`` returns up to ``n`` CPU slots, evicting CPU victims (never protected
pages) down the cascade when the tier is full: to disk when the admission rule agrees and the
disk has (or can make) room, otherwise dropped and counted. A full disk drops its own victims,
never a page a restore is waiting for. Drops are published as events. Runs under the engine lock.

The cascade stands on the placement (tiers, policies, ledger) and queues its CPU -> disk moves
through a ``MoveStarter`` (``kvtier.starts.Starts``, which builds the cascade it uses).

With tenant quotas (``kvtier.quotas``) the slots are asked for on behalf of one tenant
(``owner``): a tenant at its quota makes room from its own pages first and gets no more than its
quota allows; room in a full tier comes only from the requester's own pages and from tenants
over their quota (or without one), never from a tenant within its quota. Without quotas every
tracked page may be a victim, as the policy orders them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvtier.pagetable import EMPTY, by_value
from kvtier.placement import Placement
from kvtier.policy.base import RowFilter
from kvtier.types import Direction, PageId, PageMeta, Tier


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

    def _victims_of(self, tier: Tier, owners: np.ndarray | None) -> RowFilter:
        """``protected`` for a tier's policy: the usual pages, and with quotas every page whose
        tenant may not be displaced (within its quota) unless its owner is in ``owners``."""
        place = self._place
        if not place.ledger.active:
            return self._protected
        allowed = place.ledger.evictable(tier)
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

    def _evict(self, tier: Tier, page_size: int, n: int, protected: RowFilter) -> np.ndarray:
        """Up to ``n`` victims of the tier's policy, counted (the caller moves or drops them)."""
        place = self._place
        policy = (place.cpu_policy if tier is Tier.CPU else place.disk_policy).get(page_size)
        if policy is None or not len(policy) or n <= 0:
            return EMPTY
        victims = policy.evict(n, protected, partial=True)
        if victims is None or not len(victims):
            return EMPTY
        place.counters.evictions[tier] += len(victims)
        place.ledger.evictions[tier] += place.ledger.per_owner(place.table.owner[victims])
        policy.insert(victims, place.meta(victims))  # back in, so ``unsettle`` is uniform
        return victims

    def fit_quota(self, tier: Tier, owner: int, page_size: int, n: int) -> int:
        """How many of ``n`` pages ``owner`` may bring into ``tier``, after pushing its own
        pages out of the tier (down the cascade) to stay within its quota."""
        room = self._place.ledger.room(tier, owner) if owner else None
        if room is None or room // page_size >= n:
            return n
        allowed = room // page_size
        victims = self._evict(tier, page_size, n - allowed, self._own_only(owner))
        if len(victims):
            if tier is Tier.CPU:
                self.demote_cpu(victims, page_size)
            else:
                self._place.drop(victims, "tenant_quota")
        return allowed + len(victims)

    def cpu_slots(self, page_size: int, n: int, owner: int = 0) -> np.ndarray:
        """Up to ``n`` CPU slots (contiguous when possible), evicting down the cascade for room;
        ``owner``: the tenant the slots are for (its quota applies)."""
        host = self._place.host
        if self._place.ledger.active:
            n = self.fit_quota(Tier.CPU, owner, page_size, n)
            if not n:
                return EMPTY
        got = host.alloc_array(page_size, n)
        if got is None:
            self.make_cpu_room(page_size, n, owner)
            got = host.alloc_array(page_size, n)
        if got is None:  # as many as there are, a run at a time
            parts, left = [], n
            while left:
                one = host.alloc_array(page_size, 1)
                if one is None:
                    break
                parts.append(one)
                left -= 1
            got = np.concatenate(parts) if parts else EMPTY
        return got

    def make_cpu_room(self, page_size: int, n: int, owner: int = 0) -> None:
        owners = np.array([owner], dtype=np.int64) if owner else None
        victims = self._evict(Tier.CPU, page_size, n, self._victims_of(Tier.CPU, owners))
        if len(victims):
            self.demote_cpu(victims, page_size)

    def demote_cpu(self, rows: np.ndarray, page_size: int) -> None:
        """CPU victims go to disk if admitted and there is room, else they are dropped."""
        place, t = self._place, self._place.table
        if place.disk is None:
            place.drop(rows, "cpu_full")
            return
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
        rows = rows[admit]
        if place.ledger.active:
            rows = self.fit_disk_quotas(rows, page_size)
        if not len(rows):
            return
        slots = place.disk.alloc(page_size, len(rows))
        if slots is None:
            self.make_disk_room(page_size, len(rows), np.unique(t.owner[rows]))
            slots = place.disk.alloc(page_size, len(rows))
        if slots is None:  # as many as there are
            slots = []
            while len(slots) < len(rows) and (one := place.disk.alloc(page_size, 1)):
                slots += one
        if len(slots) < len(rows):
            place.drop(rows[len(slots) :], "disk_full")
        dsts = np.array(slots, dtype=np.int64)
        self._starter.start_many(rows[: len(slots)], Direction.CPU_TO_DISK, dsts, urgent=False)

    def fit_disk_quotas(self, rows: np.ndarray, page_size: int) -> np.ndarray:
        """The rows each tenant's disk quota lets in (after dropping its own disk pages for
        room); the others are dropped."""
        owners = self._place.table.owner[rows]
        keep: list[np.ndarray] = []
        for owner, pos in by_value(owners):
            part = rows if len(pos) == len(rows) else rows[pos]
            n = self.fit_quota(Tier.DISK, owner, page_size, len(part))
            if n < len(part):
                self._place.drop(part[n:], "tenant_quota")
            keep.append(part[:n])
        return np.concatenate(keep) if keep else EMPTY

    def make_disk_room(self, page_size: int, n: int, owners: np.ndarray | None = None) -> None:
        # never a page a restore is waiting for
        victims = self._evict(Tier.DISK, page_size, n, self._victims_of(Tier.DISK, owners))
        if len(victims):
            self._place.drop(victims, "disk_full")
