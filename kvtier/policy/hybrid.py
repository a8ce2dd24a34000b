"""Hybrid eviction: priority classes, LRU within a class, a second chance for reused pages.

Exact order of ``evict(n, protected)``:

1. Unprotected pages are grouped into classes by ``PageMeta.priority``; the class with the
   lowest priority is drained first, and a higher class is only entered once every unprotected
   page of all lower classes has been evicted.
2. Within a class, pages are visited in LRU order (oldest ``insert``/``touch`` first), CLOCK
   style: a page touched at least ``SECOND_CHANCE_HITS`` (2) times since it was inserted (or since
   its last second chance) is *not* evicted; instead its touch count is reset and it moves to
   the most-recently-used end of its class, as if just touched. Any other page is a victim.
   The walk wraps around, so a class always empties if ``n`` demands it.

So priority decides between classes, recency within one, and frequency lets a page that is
reused often outlive a one-off page that happened to be touched after it. A logical clock that
ticks on ``insert``, ``touch`` and second chances keeps the order deterministic. ``update``
moves a page to its new class at its existing recency (not an access). ``evict`` sorts the
unprotected pages on each call (O(N log N)); state changes only if ``n`` victims exist.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass
from itertools import groupby
from typing import ClassVar

from kvtier.policy._common import already_tracked, check_n, enough_evictable
from kvtier.policy.base import EvictionPolicy
from kvtier.types import PageId, PageMeta


@dataclass(slots=True)
class _Entry:
    priority: float
    last_access: int
    hits: int = 0


class HybridPolicy(EvictionPolicy):
    """Lowest priority class first; LRU with a second chance for reused pages within a class."""

    name: ClassVar[str] = "hybrid"
    SECOND_CHANCE_HITS: ClassVar[int] = 2

    def __init__(self) -> None:
        self._pages: dict[PageId, _Entry] = {}
        self._clock = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def insert(self, meta: PageMeta) -> None:
        if meta.page_id in self._pages:
            raise already_tracked(meta.page_id)
        self._pages[meta.page_id] = _Entry(meta.priority, self._tick())

    def touch(self, page_id: PageId) -> None:
        entry = self._pages.get(page_id)
        if entry is not None:
            entry.last_access = self._tick()
            entry.hits += 1

    def update(self, meta: PageMeta) -> None:
        entry = self._pages.get(meta.page_id)
        if entry is not None:
            entry.priority = meta.priority

    def remove(self, page_id: PageId) -> None:
        self._pages.pop(page_id, None)

    def evict(self, n: int, protected: Container[PageId]) -> list[PageId] | None:
        check_n(n)
        if n == 0:
            return []
        if not enough_evictable(self._pages, len(self._pages), n, protected):
            return None
        pages = self._pages
        candidates = sorted(
            (pid for pid in pages if pid not in protected),
            key=lambda pid: (pages[pid].priority, pages[pid].last_access, pid),
        )
        victims: list[PageId] = []
        for _, members in groupby(candidates, key=lambda pid: pages[pid].priority):
            self._drain_class(deque(members), n - len(victims), victims)
            if len(victims) == n:
                break
        for pid in victims:
            del pages[pid]
        return victims

    def _drain_class(self, queue: deque[PageId], want: int, victims: list[PageId]) -> None:
        """Appends up to ``want`` victims from one class's LRU-ordered queue (CLOCK walk)."""
        taken = 0
        while queue and taken < want:
            pid = queue.popleft()
            entry = self._pages[pid]
            if entry.hits >= self.SECOND_CHANCE_HITS:
                entry.hits = 0
                entry.last_access = self._tick()
                queue.append(pid)
            else:
                victims.append(pid)
                taken += 1

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._pages
