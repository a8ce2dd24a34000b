"""Free-run bookkeeping for fixed-slot chunks: a sorted set of disjoint ``[start, start+len)`` runs.

``RunSet(size)`` starts with one free run covering ``[0, size)``. ``take(start, k)`` removes the
first ``k`` slots of the run that begins at ``start``; ``add(start, k)`` returns slots and merges
them with adjacent runs. Returning a slot that is already free is an internal error (assert).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator


class RunSet:
    """Disjoint free runs inside ``[0, size)``, merged on every ``add``."""

    __slots__ = ("_ends", "_lens", "_starts", "size", "total")

    def __init__(self, size: int, full: bool = True) -> None:
        self.size = size
        self._starts: list[int] = []
        self._lens: dict[int, int] = {}
        self._ends: dict[int, int] = {}  # exclusive end -> start, to merge with a left neighbour
        self.total = 0
        if full and size > 0:
            self._insert(0, size)

    def items(self) -> Iterator[tuple[int, int]]:
        """``(start, length)`` of each free run, in address order."""
        return ((s, self._lens[s]) for s in self._starts)

    def take(self, start: int, k: int) -> None:
        length = self._lens[start]
        assert 0 < k <= length, f"take {k} from a run of {length}"
        self._remove(start)
        if k < length:
            self._insert(start + k, length - k)

    def add(self, start: int, k: int) -> None:
        assert start >= 0 and start + k <= self.size and k > 0, f"bad run {start}+{k}"
        i = bisect.bisect_right(self._starts, start)
        if i > 0:
            left = self._starts[i - 1]
            assert left + self._lens[left] <= start, f"double free of slot {start}"
        if i < len(self._starts):
            assert start + k <= self._starts[i], f"double free of slot {self._starts[i]}"
        left_start = self._ends.get(start)
        if left_start is not None:
            k += start - left_start
            self._remove(left_start)
            start = left_start
        right_len = self._lens.get(start + k)
        if right_len is not None:
            self._remove(start + k)
            k += right_len
        self._insert(start, k)

    def _insert(self, start: int, k: int) -> None:
        bisect.insort(self._starts, start)
        self._lens[start] = k
        self._ends[start + k] = start
        self.total += k

    def _remove(self, start: int) -> None:
        k = self._lens.pop(start)
        del self._ends[start + k]
        del self._starts[bisect.bisect_left(self._starts, start)]
        self.total -= k
