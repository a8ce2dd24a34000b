"""S3-FIFO (Yang et al., SOSP 2023): a small FIFO, a main FIFO and a ghost FIFO.

* ``insert``: a page whose id is in the ghost queue enters the tail of ``main`` (it was evicted
  too early once); any other page enters the tail of ``small``. Its frequency starts at 0.
* ``touch``: frequency += 1, saturating at ``MAX_FREQ`` (3, two bits). Queues don't move.
* ``evict``: the tier's capacity is unknown, so the resident count ``c`` at the start of the call
  stands in for it. Until ``n`` victims are found, one step at a time:

  - if ``small`` holds at least ``SMALL_PERCENT`` (10 %) of ``c`` pages (or ``main`` has no
    candidates), take the head of ``small``: a page touched at least once (``freq >= 1``) is
    promoted to the tail of ``main`` with its frequency reset; otherwise it is a victim and its
    id enters the ghost queue. One-hit wonders thus leave quickly from ``small``.
  - else take the head of ``main``: a page with ``freq > 0`` is reinserted at the tail with
    ``freq - 1``; otherwise it is a victim (no ghost).

  Protected pages met at a head are set aside and put back at that head afterwards, so they keep
  their place. The ghost queue holds at most ``c`` ids (oldest dropped first).
* ``remove`` forgets a page without a ghost; ``update`` is ignored (no priorities in S3-FIFO).

State only changes once ``n`` victims are known to exist, so ``None`` means no change.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from typing import ClassVar

from kvtier.policy._common import already_tracked, check_n, enough_evictable
from kvtier.policy.base import EvictionPolicy
from kvtier.types import PageId, PageMeta

_Fifo = OrderedDict[PageId, None]


class S3FIFOPolicy(EvictionPolicy):
    """Small/main/ghost FIFO queues with 2-bit access frequencies."""

    name: ClassVar[str] = "s3fifo"
    SMALL_PERCENT: ClassVar[int] = 10
    MAX_FREQ: ClassVar[int] = 3

    def __init__(self) -> None:
        # Every queue is head (oldest) first.
        self._small: _Fifo = OrderedDict()
        self._main: _Fifo = OrderedDict()
        self._ghost: _Fifo = OrderedDict()
        self._freq: dict[PageId, int] = {}

    def queues(self) -> tuple[list[PageId], list[PageId], list[PageId]]:
        """``(small, main, ghost)``, each head first; for tests and debugging."""
        return list(self._small), list(self._main), list(self._ghost)

    def insert(self, meta: PageMeta) -> None:
        pid = meta.page_id
        if pid in self._freq:
            raise already_tracked(pid)
        self._freq[pid] = 0
        if pid in self._ghost:
            del self._ghost[pid]
            self._main[pid] = None
        else:
            self._small[pid] = None

    def touch(self, page_id: PageId) -> None:
        freq = self._freq.get(page_id)
        if freq is not None:
            self._freq[page_id] = min(freq + 1, self.MAX_FREQ)

    def update(self, meta: PageMeta) -> None:
        """S3-FIFO ignores priority and position; an update is not an access."""

    def remove(self, page_id: PageId) -> None:
        if self._freq.pop(page_id, None) is not None:
            self._small.pop(page_id, None)
            self._main.pop(page_id, None)

    def evict(self, n: int, protected: Container[PageId]) -> list[PageId] | None:
        check_n(n)
        if n == 0:
            return []
        capacity = len(self._freq)
        if not enough_evictable(self._freq, capacity, n, protected):
            return None
        victims: list[PageId] = []
        held_small: list[PageId] = []
        held_main: list[PageId] = []
        while len(victims) < n:
            # Guaranteed by enough_evictable: every unprotected page is eventually a victim.
            assert self._small or self._main
            small_size = len(self._small) + len(held_small)
            if self._small and (
                small_size * 100 >= capacity * self.SMALL_PERCENT or not self._main
            ):
                self._step_small(protected, held_small, victims)
            else:
                self._step_main(protected, held_main, victims)
        _put_back(self._small, held_small)
        _put_back(self._main, held_main)
        for pid in victims:
            del self._freq[pid]
        while len(self._ghost) > capacity:
            self._ghost.popitem(last=False)
        return victims

    def _step_small(
        self, protected: Container[PageId], held: list[PageId], victims: list[PageId]
    ) -> None:
        pid, _ = self._small.popitem(last=False)
        if pid in protected:
            held.append(pid)
        elif self._freq[pid] >= 1:
            self._freq[pid] = 0
            self._main[pid] = None
        else:
            victims.append(pid)
            self._ghost[pid] = None

    def _step_main(
        self, protected: Container[PageId], held: list[PageId], victims: list[PageId]
    ) -> None:
        pid, _ = self._main.popitem(last=False)
        if pid in protected:
            held.append(pid)
        elif self._freq[pid] > 0:
            self._freq[pid] -= 1
            self._main[pid] = None
        else:
            victims.append(pid)

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._freq


def _put_back(queue: _Fifo, held: list[PageId]) -> None:
    """Returns pages set aside from ``queue``'s head to that head, in their original order."""
    for pid in reversed(held):
        queue[pid] = None
        queue.move_to_end(pid, last=False)
