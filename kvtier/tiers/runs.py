"""Free-run bookkeeping for fixed-slot chunks: a sorted set of disjoint ``[start, start+len)`` runs.

``RunSet(size)`` starts with one free run covering ``[0, size)``. ``take(start, k)`` removes the
first ``k`` slots of the run that begins at ``start``; ``add(start, k)`` returns slots and merges
them with adjacent runs. Returning a slot that is already free is an internal error (assert).

Vectorised grouping of slot-id arrays (int64, no Python loop per slot):
    * ``as_slots(seq) -> int64 array``: what the list APIs hand to the array ones.
    * ``ascending(slots) -> (sorted, distinct)``.
    * ``run_bounds(slots, per_chunk) -> (lo, hi)``: positions of the runs of consecutive ids within
      one chunk, in the given order.
    * ``free_runs(slots, per_chunk) -> (chunk_nos, starts, counts)``: the sorted runs of a free;
      asserts the ids are distinct and non-negative.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import numpy as np

_ZERO = np.zeros(1, dtype=np.int64)


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


def as_slots(slots: Sequence[int] | np.ndarray) -> np.ndarray:
    """``slots`` as an ``int64`` array; a list is read in one C pass (``fromiter``)."""
    if isinstance(slots, np.ndarray):
        return np.asarray(slots, dtype=np.int64)
    return np.fromiter(slots, dtype=np.int64, count=len(slots))


def strictly_ascending(values: np.ndarray) -> bool:
    """Every element greater than the one before: one comparison of the array against itself
    shifted by one (no difference array)."""
    return len(values) < 2 or bool(np.greater(values[1:], values[:-1]).all())


def ascending(slots: np.ndarray) -> tuple[np.ndarray, bool]:
    """``slots`` in ascending order (no copy if already so) and whether they are all distinct."""
    if strictly_ascending(slots):
        return slots, True
    ordered = np.sort(slots)
    return ordered, bool(np.not_equal(ordered[1:], ordered[:-1]).all())


def run_bounds(slots: np.ndarray, per_chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``[lo, hi)`` of the runs of ``slots`` (in the given order).

    A run is a maximal stretch of consecutive positions whose ids go up by one within one chunk
    (chunk ``c`` holds ids ``[c * per_chunk, (c + 1) * per_chunk)``). ``slots`` is non-empty.
    """
    tail = slots[1:]
    cut = np.flatnonzero((tail != slots[:-1] + 1) | (tail % per_chunk == 0)) + 1
    lo = np.concatenate((_ZERO, cut))
    hi = np.concatenate((cut, np.array([len(slots)], dtype=np.int64)))
    return lo, hi


def free_runs(slots: np.ndarray, per_chunk: int) -> tuple[list[int], list[int], list[int]]:
    """``(chunk_nos, starts, counts)`` of the sorted runs of non-empty, distinct ``slots``.

    Asserts (internal error) on a negative or repeated id; nothing is changed either way.
    """
    ordered, distinct = ascending(slots)
    assert distinct, f"slot freed twice in {slots.tolist()}"
    first, last = int(ordered[0]), int(ordered[-1])
    assert first >= 0, f"negative slot in {slots.tolist()}"
    if last - first == len(ordered) - 1:  # one span of ids: cut it at chunk ends only
        return _split_span(first, last + 1, per_chunk)
    lo, hi = run_bounds(ordered, per_chunk)
    firsts = ordered[lo]
    return (firsts // per_chunk).tolist(), (firsts % per_chunk).tolist(), (hi - lo).tolist()


def _split_span(begin: int, end: int, per_chunk: int) -> tuple[list[int], list[int], list[int]]:
    """``free_runs`` of the ids ``[begin, end)``: one run per chunk they touch."""
    chunk_nos, starts, counts = [], [], []
    while begin < end:
        chunk_no, start = divmod(begin, per_chunk)
        k = min(end - begin, per_chunk - start)
        chunk_nos.append(chunk_no)
        starts.append(start)
        counts.append(k)
        begin += k
    return chunk_nos, starts, counts
