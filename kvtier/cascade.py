"""The cascade: making room in the CPU and disk tiers.

Contract: ``cpu_slots`` returns up to ``n`` CPU slots, evicting CPU victims (never protected
pages) down the cascade when the tier is full: to disk when the admission rule agrees and the
disk has (or can make) room, otherwise dropped and counted. A full disk drops its own victims,
never a page a restore is waiting for. Drops are published as events. Runs under the engine lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvtier.pagetable import EMPTY
from kvtier.types import Direction, PageId, PageMeta, Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore


class Cascade:
    def __init__(self, core: EngineCore) -> None:
        self._core = core

    def _protected(self, rows: np.ndarray) -> np.ndarray:
        """Pages a load keeps (``protect``) or an acquire waits for (``waiting``)."""
        t = self._core.table
        return (t.protect[rows] > 0) | (t.waiting[rows] > 0)

    def cpu_slots(self, page_size: int, n: int) -> np.ndarray:
        """Up to ``n`` CPU slots (contiguous when possible), evicting down the cascade for room."""
        host = self._core.host
        got = host.alloc_array(page_size, n)
        if got is None:
            self.make_cpu_room(page_size, n)
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

    def make_cpu_room(self, page_size: int, n: int) -> None:
        core = self._core
        policy = core.cpu_policy.get(page_size)
        if policy is None or not len(policy):
            return
        victims = policy.evict(n, self._protected, partial=True)
        if victims is not None and len(victims):
            core.counters.evictions[Tier.CPU] += len(victims)
            policy.insert(victims, core.meta(victims))  # back in, so ``unsettle`` is uniform
            self.demote_cpu(victims, page_size)

    def demote_cpu(self, rows: np.ndarray, page_size: int) -> None:
        """CPU victims go to disk if admitted and there is room, else they are dropped."""
        core, t = self._core, self._core.table
        if core.disk is None:
            core.drop(rows, "cpu_full")
            return
        admit = np.fromiter(
            (
                core.admission.admit(PageMeta(PageId(r), p, q, n), h)
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
            core.drop(rows[~admit], "no_admission")
        rows = rows[admit]
        if not len(rows):
            return
        slots = core.disk.alloc(page_size, len(rows))
        if slots is None:
            self.make_disk_room(page_size, len(rows))
            slots = core.disk.alloc(page_size, len(rows))
        if slots is None:  # as many as there are
            slots = []
            while len(slots) < len(rows) and (one := core.disk.alloc(page_size, 1)):
                slots += one
        if len(slots) < len(rows):
            core.drop(rows[len(slots) :], "disk_full")
        dsts = np.array(slots, dtype=np.int64)
        core.starts.start_many(rows[: len(slots)], Direction.CPU_TO_DISK, dsts, urgent=False)

    def make_disk_room(self, page_size: int, n: int) -> None:
        core = self._core
        policy = core.disk_policy.get(page_size)
        if policy is None or not len(policy):
            return
        # never a page a restore is waiting for
        victims = policy.evict(n, self._protected, partial=True)
        if victims is not None and len(victims):
            core.counters.evictions[Tier.DISK] += len(victims)
            policy.insert(victims, core.meta(victims))
            core.drop(victims, "disk_full")
