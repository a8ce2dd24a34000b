"""The cascade: making room in the CPU and disk tiers.

Contract: ``cpu_slots`` returns up to ``n`` CPU slots, evicting CPU victims (never protected
pages) down the cascade when the tier is full: to disk when the admission rule agrees and the
disk has (or can make) room, otherwise dropped and counted. A full disk drops its own victims,
never a page a restore is waiting for. Drops are published as events. Runs under the engine lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.pagetable import Page
from kvtier.types import Direction, Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore


class Cascade:
    def __init__(self, core: EngineCore) -> None:
        self._core = core

    def cpu_slots(self, page_size: int, n: int) -> list[int]:
        """Up to ``n`` CPU slots (contiguous when possible), evicting down the cascade for room."""
        core = self._core
        got = core.host.alloc(page_size, n)
        if got is None:
            self.make_cpu_room(page_size, n)
            got = core.host.alloc(page_size, n)
        if got is None:
            got = []
            for _ in range(n):
                one = core.host.alloc(page_size, 1)
                if one is None:
                    break
                got.extend(one)
        return list(got)

    def make_cpu_room(self, page_size: int, n: int) -> None:
        core = self._core
        policy = core.cpu_policy.get(page_size)
        if policy is None or not len(policy):
            return
        k = min(n, len(policy) - sum(1 for p in core.cpu_protected if p in policy))
        victims = policy.evict(k, core.cpu_protected) if k > 0 else None
        for pid in victims or []:
            core.counters.evictions[Tier.CPU] += 1
            self.demote_cpu(core.table.pages[pid])

    def demote_cpu(self, page: Page) -> None:
        """A CPU victim goes to disk if admitted and there is room, else it is dropped."""
        core = self._core
        core.policy_of(page).insert(page.meta())  # back in, so ``unsettle`` is uniform
        if core.disk is None or not core.admission.admit(page.meta(), page.hits):
            core.drop(page, "no_admission" if core.disk is not None else "cpu_full")
            return
        slots = core.disk.alloc(page.page_size, 1)
        if slots is None:
            self.make_disk_room(page.page_size)
            slots = core.disk.alloc(page.page_size, 1)
        if slots is None:
            core.drop(page, "disk_full")
            return
        core.start(page, Direction.CPU_TO_DISK, slots[0])

    def make_disk_room(self, page_size: int) -> None:
        core = self._core
        policy = core.disk_policy.get(page_size)
        if policy is None or not len(policy):
            return
        victims = policy.evict(1, core.cpu_protected)  # never a page a restore is waiting for
        for pid in victims or []:
            page = core.table.pages[pid]
            core.counters.evictions[Tier.DISK] += 1
            policy.insert(page.meta())
            core.drop(page, "disk_full")
