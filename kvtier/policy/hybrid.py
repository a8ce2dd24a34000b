"""Hybrid eviction: priority classes, LRU within a class, a second chance for reused pages.

Exact order of ``evict(n, protected)``:

1. Pages are grouped into classes by ``PageMeta.priority``; the class with the lowest priority
   is drained first, and a higher class is only entered once every unprotected page of all
   lower classes has been evicted.
2. Within a class, pages are visited in LRU order (oldest ``insert``/``touch`` first), CLOCK
   style: a page touched at least ``SECOND_CHANCE_HITS`` (2) times since it was inserted (or since
   its last second chance) is *not* evicted; instead its touch count is reset and it moves to
   the most-recently-used end of its class, as if just touched. Any other page is a victim.
   The walk wraps around, so a class always empties if ``n`` demands it. Protected pages are
   skipped and keep their place.

So priority decides between classes, recency within one, and frequency lets a page that is
reused often outlive a one-off page that happened to be touched after it. A logical clock that
ticks on ``insert``, ``touch`` and second chances keeps the order deterministic. ``update``
moves a page to its new class at its existing recency (not an access). ``insert``, ``touch``
and ``remove`` are O(1); ``evict`` is O(victims + second chances + protected pages skipped)
after checking that ``n`` victims exist, and changes nothing if they don't.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass
from typing import ClassVar

from kvtier.policy._common import already_tracked, check_n, enough_evictable
from kvtier.policy.base import EvictionPolicy
from kvtier.types import PageId, PageMeta

_Lru = OrderedDict[PageId, None]


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
        # priority -> its pages, LRU first; a class is dropped when it empties.
        self._classes: dict[float, _Lru] = {}
        self._clock = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def insert(self, meta: PageMeta) -> None:
        if meta.page_id in self._pages:
            raise already_tracked(meta.page_id)
        self._pages[meta.page_id] = _Entry(meta.priority, self._tick())
        self._classes.setdefault(meta.priority, OrderedDict())[meta.page_id] = None

    def touch(self, page_id: PageId) -> None:
        entry = self._pages.get(page_id)
        if entry is not None:
            entry.last_access = self._tick()
            entry.hits += 1
            self._classes[entry.priority].move_to_end(page_id)

    def update(self, meta: PageMeta) -> None:
        entry = self._pages.get(meta.page_id)
        if entry is None or entry.priority == meta.priority:
            return
        self._leave_class(meta.page_id, entry.priority)
        entry.priority = meta.priority
        members = self._classes.setdefault(meta.priority, OrderedDict())
        newest = next(reversed(members), None)
        members[meta.page_id] = None
        if newest is not None and self._pages[newest].last_access > entry.last_access:
            # Rare: the page is older than the class's newest page; restore LRU order.
            ordered = sorted(members, key=lambda pid: self._pages[pid].last_access)
            self._classes[meta.priority] = OrderedDict.fromkeys(ordered)

    def remove(self, page_id: PageId) -> None:
        entry = self._pages.pop(page_id, None)
        if entry is not None:
            self._leave_class(page_id, entry.priority)

    def _leave_class(self, page_id: PageId, priority: float) -> None:
        members = self._classes[priority]
        del members[page_id]
        if not members:
            del self._classes[priority]

    def evict(self, n: int, protected: Container[PageId]) -> list[PageId] | None:
        check_n(n)
        if n == 0:
            return []
        if not enough_evictable(self._pages, len(self._pages), n, protected):
            return None
        victims: list[PageId] = []
        for priority in sorted(self._classes):
            self._drain_class(self._classes[priority], n - len(victims), protected, victims)
            if len(victims) == n:
                break
        for pid in victims:
            del self._pages[pid]
        self._classes = {prio: members for prio, members in self._classes.items() if members}
        return victims

    def _drain_class(
        self, members: _Lru, want: int, protected: Container[PageId], victims: list[PageId]
    ) -> None:
        """Appends up to ``want`` victims from one class (CLOCK walk from its LRU end)."""
        held: list[PageId] = []
        taken = 0
        while members and taken < want:
            pid, _ = members.popitem(last=False)
            entry = self._pages[pid]
            if pid in protected:
                held.append(pid)
            elif entry.hits >= self.SECOND_CHANCE_HITS:
                entry.hits = 0
                entry.last_access = self._tick()
                members[pid] = None
            else:
                victims.append(pid)
                taken += 1
        # Held pages came off the LRU end, so they go back there in their original order.
        for pid in reversed(held):
            members[pid] = None
            members.move_to_end(pid, last=False)

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._pages
