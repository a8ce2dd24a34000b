"""An append-only log of ``(row, stamp)`` pairs with a movable head, for recency policies.

A policy appends one entry each time it stamps a row (insert, touch) from a clock that only
grows, so stamps increase strictly along the log. Which entries are still current is the
owner's business (typically: the row is tracked and its current stamp equals the logged one);
the log only stores, windows, squeezes and compacts. Entries before ``head`` are all stale.
"""

from __future__ import annotations

import numpy as np

_MIN_CAPACITY = 1024


class RowLog:
    """``(row, stamp)`` pairs in stamping order; ``rows``/``stamps`` views cover ``[0, end)``."""

    def __init__(self) -> None:
        self._rows = np.empty(_MIN_CAPACITY, dtype=np.int64)
        self._stamps = np.empty(_MIN_CAPACITY, dtype=np.int64)
        self.head = 0  # every entry before it is stale
        self.end = 0

    def __len__(self) -> int:
        """Entries from the head on, stale ones included."""
        return self.end - self.head

    def append(self, rows: np.ndarray, stamps: np.ndarray) -> None:
        """Add entries at the hot end; ``stamps`` must exceed every logged stamp."""
        stop = self.end + len(rows)
        if stop > len(self._rows):
            self._grow(stop)
        self._rows[self.end : stop] = rows
        self._stamps[self.end : stop] = stamps
        self.end = stop

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of the rows and stamps of entries ``[start, stop)``."""
        return self._rows[start:stop], self._stamps[start:stop]

    def keep(self, live: np.ndarray) -> None:
        """Keep only the entries from the head on where ``live`` (aligned with them) is True."""
        rows, stamps = self.window(self.head, self.end)
        kept_rows, kept_stamps = rows[live], stamps[live]
        self.head, self.end = 0, len(kept_rows)
        self._rows[: self.end] = kept_rows
        self._stamps[: self.end] = kept_stamps

    def squeeze(self, rows: np.ndarray, stamps: np.ndarray, stop: int) -> None:
        """Replace the entries in ``[head, stop)`` by ``(rows, stamps)``, moved up to end at
        ``stop``; the head moves to the first of them (to ``stop`` when there are none).

        The new entries must be some of the replaced ones, in log order.
        """
        self.head = stop - len(rows)
        self._rows[self.head : stop] = rows
        self._stamps[self.head : stop] = stamps

    def clear(self) -> None:
        self.head = self.end = 0

    def _grow(self, size: int) -> None:
        capacity = max(size, 2 * len(self._rows))
        self._rows = _resized(self._rows, capacity, self.end)
        self._stamps = _resized(self._stamps, capacity, self.end)


def _resized(arr: np.ndarray, capacity: int, used: int) -> np.ndarray:
    out = np.empty(capacity, dtype=arr.dtype)
    out[:used] = arr[:used]
    return out
