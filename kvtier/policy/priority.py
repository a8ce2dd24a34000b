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
tracked pages on each call and selects the top ``n`` with a heap (O(N log n); about 30 ms for
50k pages).
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
    last_access: int
    weight: float  # (1 / priority) * (position + 1) / length, fixed until the next update


def _weight(meta: PageMeta) -> float:
    length = max(meta.length, 1)
    position = min(max(meta.position, 0), length - 1)
    return (position + 1) / length / max(meta.priority, _MIN_PRIORITY)


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
        self._pages[meta.page_id] = _Entry(self._clock, _weight(meta))

    def touch(self, page_id: PageId) -> None:
        entry = self._pages.get(page_id)
        if entry is not None:
            self._clock += 1
            entry.last_access = self._clock

    def update(self, meta: PageMeta) -> None:
        entry = self._pages.get(meta.page_id)
        if entry is not None:
            entry.weight = _weight(meta)

    def remove(self, page_id: PageId) -> None:
        self._pages.pop(page_id, None)

    def score(self, page_id: PageId) -> float:
        """The page's current score (see the module docstring); ``KeyError`` if untracked."""
        entry = self._pages[page_id]
        return (self._clock - entry.last_access + 1) * entry.weight

    def evict(self, n: int, protected: Container[PageId]) -> list[PageId] | None:
        check_n(n)
        if n == 0:
            return []
        now = self._clock + 1
        # Inline score: this loop runs over every tracked page on each call.
        ranked = [
            (-(now - e.last_access) * e.weight, e.last_access, pid)
            for pid, e in self._pages.items()
            if pid not in protected
        ]
        if len(ranked) < n:
            return None
        victims = [pid for _, _, pid in heapq.nsmallest(n, ranked)]
        for pid in victims:
            del self._pages[pid]
        return victims

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._pages
