"""Least-recently-used eviction.

``insert`` and ``touch`` make a page the most recently used; ``evict`` names the least recently
used unprotected pages, oldest first. Every operation is O(1) apart from ``evict``, which walks
past protected pages at the cold end (O(n + protected pages skipped)). The batch forms run their
per-page loop in C (``map`` over the ordered dict's own methods).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Sequence
from itertools import repeat
from typing import ClassVar

from kvtier.policy._common import already_tracked, check_n
from kvtier.policy.base import EvictionPolicy
from kvtier.types import PageId, PageMeta


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted or touched page first; metadata is ignored."""

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        # Cold end first: iteration order is eviction order.
        self._order: OrderedDict[PageId, None] = OrderedDict()

    def insert(self, meta: PageMeta) -> None:
        if meta.page_id in self._order:
            raise already_tracked(meta.page_id)
        self._order[meta.page_id] = None

    def touch(self, page_id: PageId) -> None:
        if page_id in self._order:
            self._order.move_to_end(page_id)

    def update(self, meta: PageMeta) -> None:
        """LRU ignores priority and position; an update is not an access."""

    def remove(self, page_id: PageId) -> None:
        self._order.pop(page_id, None)

    def insert_many(self, metas: Sequence[PageMeta]) -> None:
        ids = [m.page_id for m in metas]
        fresh = dict.fromkeys(ids)
        if len(fresh) != len(ids) or not self._order.keys().isdisjoint(fresh):
            seen: set[PageId] = set()
            for pid in ids:  # name the first offender, as per-page inserts would
                if pid in self._order or pid in seen:
                    raise already_tracked(pid)
                seen.add(pid)
        self._order.update(fresh)

    def remove_many(self, page_ids: Iterable[PageId]) -> None:
        _consume(map(self._order.pop, page_ids, repeat(None)))

    def touch_many(self, page_ids: Iterable[PageId]) -> None:
        order = self._order
        _consume(map(order.move_to_end, [p for p in page_ids if p in order]))

    def evict(self, n: int, protected: Container[PageId]) -> list[PageId] | None:
        check_n(n)
        victims: list[PageId] = []
        if n == 0:
            return victims
        for page_id in self._order:
            if page_id not in protected:
                victims.append(page_id)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for page_id in victims:
            del self._order[page_id]
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._order


def _consume(calls: Iterable[object]) -> None:
    """Run a lazy ``map`` of calls to the end, keeping nothing."""
    deque(calls, maxlen=0)
