"""Priority eviction: the kvcached offload design's score.

Each page gets a score; ``evict`` names the unprotected pages with the *highest* score first,
i.e. the least valuable ones: old, low priority, late in their sequence::

    score = recency * (1 / priority) * (1 - d / length)

* ``recency = clock - last_access + 1`` (>= 1). ``clock`` is a logical clock that ticks once on
  every ``insert`` and ``touch`` (not on wall time), so the order is deterministic and
  reproducible; ``last_access`` is the tick of the page's latest insert or touch.
* ``priority`` is ``PageMeta.priority`` (> 0, higher = keep longer); non-positive values are
  treated as a tiny positive number, i.e. "evict first".
* ``d = length - 1 - position`` is the number of pages after this one in its sequence, so the
  last factor is ``(position + 1) / length`` in (0, 1]. The tail of a sequence goes first:
  a prefix page is worth more than the pages after it, which can't be reused without it.
  (Position is counted from the sequence *end* here; with ``d = position`` the formula would
  evict sequence heads first, the opposite of the intent.) ``position`` is clamped to
  ``[0, length - 1]`` and ``length`` to ``>= 1``.

Ties break towards the older ``last_access``, then the smaller page id. Because recency grows
with the clock, scores change relative to each other over time: ``evict`` therefore scores all
tracked pages on each call and selects the top ``n`` with a heap (O(N log n)).
``update`` changes priority/position/length without counting as an access.
"""

from __future__ import annotations

import heapq
from collections.abc import Container
from dataclasses import dataclass
from typing import ClassVar

from kvtier.policy._common import already_tracked, check_n
from kvtier.policy.base import EvictionPolicy
from kvtier.types import PageId, PageMeta

_MIN_PRIORITY = 1e-9


@dataclass(slots=True)
class _Entry:
    meta: PageMeta
    last_access: int


class PriorityPolicy(EvictionPolicy):
    """Evicts the page with the highest recency / priority / sequence-tail score first."""

    name: ClassVar[str] = "priority"

    def __init__(self) -> None:
        self._pages: dict[PageId, _Entry] = {}
        self._clock = 0

    def insert(self, meta: PageMeta) -> None:
        if meta.page_id in self._pages:
            raise already_tracked(meta.page_id)
        self._clock += 1
        self._pages[meta.page_id] = _Entry(meta, self._clock)

    def touch(self, page_id: PageId) -> None:
        entry = self._pages.get(page_id)
        if entry is not None:
            self._clock += 1
            entry.last_access = self._clock

    def update(self, meta: PageMeta) -> None:
        entry = self._pages.get(meta.page_id)
        if entry is not None:
            entry.meta = meta

    def remove(self, page_id: PageId) -> None:
        self._pages.pop(page_id, None)

    def score(self, page_id: PageId) -> float:
        """The page's current score (see the module docstring); ``KeyError`` if untracked."""
        entry = self._pages[page_id]
        meta = entry.meta
        length = max(meta.length, 1)
        position = min(max(meta.position, 0), length - 1)
        recency = self._clock - entry.last_access + 1
        priority = max(meta.priority, _MIN_PRIORITY)
        return recency / priority * ((position + 1) / length)

    def evict(self, n: int, protected: Container[PageId]) -> list[PageId] | None:
        check_n(n)
        if n == 0:
            return []
        candidates = [pid for pid in self._pages if pid not in protected]
        if len(candidates) < n:
            return None

        def order(pid: PageId) -> tuple[float, int, int]:
            return (-self.score(pid), self._pages[pid].last_access, pid)

        victims = heapq.nsmallest(n, candidates, key=order)
        for pid in victims:
            del self._pages[pid]
        return victims

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._pages
