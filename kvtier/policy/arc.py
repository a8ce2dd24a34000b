"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) as an eviction policy.

Resident pages live in two LRU lists: ``T1`` (seen once since they became resident) and ``T2``
(touched at least once more, or re-inserted right after their eviction). Two ghost lists
remember recently evicted ids without their pages: ``B1`` (evicted from ``T1``) and ``B2``
(evicted from ``T2``). ``p`` (``target``) is the adaptive target size of ``T1``:

* ``insert`` of an id in ``B1`` (recency would have kept it): ``p += max(|B2|/|B1|, 1)``,
  capped at the resident count; the page enters ``T2``.
* ``insert`` of an id in ``B2`` (frequency would have kept it): ``p -= max(|B1|/|B2|, 1)``,
  floored at 0; the page enters ``T2``.
* any other ``insert`` enters ``T1``; ``touch`` moves a resident page to the MRU end of ``T2``.
* ``evict`` applies ARC's REPLACE once per victim: take the LRU unprotected page of ``T1`` if
  ``|T1| > p``, else of ``T2``; if the chosen list has no unprotected page, take from the other.
  (ARC's tie rule for a pending ``B2`` hit is left out: the engine evicts *before* it inserts,
  so no request is pending.) Victims go to the MRU end of their ghost list.

The policy does not know the tier's capacity ``c``; it uses the resident count at the start of
the latest ``evict`` (the tier needed room then, so it was full) and keeps ARC's bounds
``|T1| + |B1| <= c`` and ``|B1| + |B2| <= c`` by dropping the oldest ghosts. ``remove`` forgets a
page without leaving a ghost (it was freed or moved up, not evicted). A failed move that the
engine re-inserts counts as a ghost hit, which is harmless: the page was just wanted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator
from typing import ClassVar

from kvtier.policy._common import already_tracked, check_n
from kvtier.policy.base import EvictionPolicy
from kvtier.types import PageId, PageMeta

_Lru = OrderedDict[PageId, None]


class ARCPolicy(EvictionPolicy):
    """ARC: balances a recency list and a frequency list, adapting to ghost hits."""

    name: ClassVar[str] = "arc"

    def __init__(self) -> None:
        # Every list is LRU first: iteration order is eviction order.
        self._t1: _Lru = OrderedDict()
        self._t2: _Lru = OrderedDict()
        self._b1: _Lru = OrderedDict()
        self._b2: _Lru = OrderedDict()
        self._p = 0.0

    @property
    def target(self) -> float:
        """ARC's ``p``: the adaptive target size of ``T1``."""
        return self._p

    def lists(self) -> tuple[list[PageId], list[PageId], list[PageId], list[PageId]]:
        """``(T1, T2, B1, B2)``, each LRU first; for tests and debugging."""
        return list(self._t1), list(self._t2), list(self._b1), list(self._b2)

    def insert(self, meta: PageMeta) -> None:
        pid = meta.page_id
        if pid in self._t1 or pid in self._t2:
            raise already_tracked(pid)
        resident = len(self._t1) + len(self._t2) + 1
        if pid in self._b1:
            self._p = min(float(resident), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[pid]
            self._t2[pid] = None
        elif pid in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[pid]
            self._t2[pid] = None
        else:
            self._t1[pid] = None

    def touch(self, page_id: PageId) -> None:
        if page_id in self._t1:
            del self._t1[page_id]
            self._t2[page_id] = None
        elif page_id in self._t2:
            self._t2.move_to_end(page_id)

    def update(self, meta: PageMeta) -> None:
        """ARC ignores priority and position; an update is not an access."""

    def remove(self, page_id: PageId) -> None:
        self._t1.pop(page_id, None)
        self._t2.pop(page_id, None)

    def evict(self, n: int, protected: Container[PageId]) -> list[PageId] | None:
        check_n(n)
        if n == 0:
            return []
        capacity = len(self._t1) + len(self._t2)
        plan = self._plan(n, protected)
        if plan is None:
            return None
        for pid, from_t1 in plan:
            if from_t1:
                del self._t1[pid]
                self._b1[pid] = None
            else:
                del self._t2[pid]
                self._b2[pid] = None
        self._trim_ghosts(capacity)
        return [pid for pid, _ in plan]

    def _plan(self, n: int, protected: Container[PageId]) -> list[tuple[PageId, bool]] | None:
        """REPLACE ``n`` times without changing anything: ``(victim, came_from_t1)`` pairs."""
        t1: Iterator[PageId] = (pid for pid in self._t1 if pid not in protected)
        t2: Iterator[PageId] = (pid for pid in self._t2 if pid not in protected)
        size_t1 = len(self._t1)
        plan: list[tuple[PageId, bool]] = []
        while len(plan) < n:
            prefer_t1 = size_t1 > self._p
            first, second = (t1, t2) if prefer_t1 else (t2, t1)
            pid, from_t1 = next(first, None), prefer_t1
            if pid is None:
                pid, from_t1 = next(second, None), not prefer_t1
            if pid is None:
                return None
            plan.append((pid, from_t1))
            size_t1 -= from_t1
        return plan

    def _trim_ghosts(self, capacity: int) -> None:
        """Keeps ``|T1| + |B1| <= c`` and ``|B1| + |B2| <= c``, dropping the oldest ghosts."""
        while self._b1 and len(self._t1) + len(self._b1) > capacity:
            self._b1.popitem(last=False)
        while len(self._b1) + len(self._b2) > capacity:
            (self._b2 if self._b2 else self._b1).popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._t1 or page_id in self._t2
