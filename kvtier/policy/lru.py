"""Least-recently-used eviction, row-native.

The engine passes page-table rows, dense ints: page ids (and rows) must be non-negative ints,
and memory grows with the largest one seen. ``LRUPolicy`` is both a ``RowPolicy`` (batches of
rows as ``int64`` arrays, the engine's interface) and an ``EvictionPolicy`` (one page id per
call, plus the ``*_many`` forms): each method takes either form and the per-page form maps onto
the row form, so both see one state.

``insert`` and ``touch`` make rows the most recently used, in order; ``evict`` names the least
recently used unprotected rows, oldest first; ``update`` is ignored (metadata plays no part).

How: a logical clock stamps every inserted or touched row (``_stamp``, indexed by row, with
``_tracked``); eviction order is ascending stamp. Each stamping is also appended to a
``RowLog`` of ``(row, stamp)`` pairs, whose stamps therefore increase along it; an entry is live
iff its row is tracked and still carries that stamp, so each tracked row has exactly one live
entry and ``remove`` only clears ``_tracked``. ``evict`` scans the log from its head in
geometrically growing windows (vectorised: live and not protected) and takes the first ``n``;
the scanned part of the log is then squeezed to its live entries left, in order, and the head
moves to the first of them. So ``evict`` costs O(n + protected rows skipped + entries that died
since the last scan): protected rows at the cold end stay there and are checked again next time,
as an ordered-dict LRU walks past them. The log is compacted to its live entries once it holds
more than ``2 * len + 1024`` entries, and cleared when nothing is tracked. ``insert``, ``touch``
and ``remove`` are O(batch) numpy operations.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, overload

import numpy as np

from kvtier.policy._common import as_rows, check_n, first_offender
from kvtier.policy._rowlog import RowLog
from kvtier.policy.base import EvictionPolicy, RowFilter, RowMeta, RowPolicy
from kvtier.types import PageId, PageMeta

_SLACK = 1024  # log entries allowed beyond 2 * tracked before compaction
_MIN_WINDOW = 64  # first eviction scan window, in log entries
_NEGATIVE = 1 << 63  # an int64 below zero, viewed as uint64, is at least this


class LRUPolicy(EvictionPolicy, RowPolicy):
    """Evicts the least recently inserted or touched row first; metadata is ignored."""

    name: ClassVar[str] = "lru"
    uses_meta: ClassVar[bool] = False
    touch_after_insert: ClassVar[bool] = False  # already the most recent, in that order

    def __init__(self) -> None:
        self._stamp = np.zeros(0, dtype=np.int64)  # by row: clock at the last insert / touch
        self._tracked = np.zeros(0, dtype=bool)  # by row
        self._count = 0
        self._clock = 0
        self._log = RowLog()

    # Both interfaces: the row form takes arrays, the per-page form PageMeta / PageId.

    @overload
    def insert(self, rows: PageMeta) -> None: ...
    @overload
    def insert(self, rows: np.ndarray, meta: RowMeta) -> None: ...
    def insert(self, rows: PageMeta | np.ndarray, meta: RowMeta | None = None) -> None:
        if isinstance(rows, PageMeta):
            self._insert(_one(rows.page_id))
        else:
            self._insert(as_rows(rows))

    @overload
    def touch(self, rows: PageId) -> None: ...
    @overload
    def touch(self, rows: np.ndarray) -> None: ...
    def touch(self, rows: PageId | np.ndarray) -> None:
        self._touch(self._in_range(rows if isinstance(rows, np.ndarray) else _one(rows)))

    @overload
    def update(self, rows: PageMeta) -> None: ...
    @overload
    def update(self, rows: np.ndarray, meta: RowMeta) -> None: ...
    def update(self, rows: PageMeta | np.ndarray, meta: RowMeta | None = None) -> None:
        """Priority and position play no part in LRU; an update is not an access."""

    @overload
    def remove(self, rows: PageId) -> None: ...
    @overload
    def remove(self, rows: np.ndarray) -> None: ...
    def remove(self, rows: PageId | np.ndarray) -> None:
        self._remove(self._in_range(rows if isinstance(rows, np.ndarray) else _one(rows)))

    @overload
    def evict(
        self, n: int, protected: Container[PageId], *, partial: bool = False
    ) -> list[PageId] | None: ...
    @overload
    def evict(
        self, n: int, protected: RowFilter, *, partial: bool = False
    ) -> np.ndarray | None: ...
    def evict(
        self, n: int, protected: Container[PageId] | RowFilter, *, partial: bool = False
    ) -> list[PageId] | np.ndarray | None:
        """Row form when ``protected`` is a callable, per-page form when it is a container."""
        if isinstance(protected, Container):
            victims = self._evict(n, _container_filter(protected), partial=partial)
            return None if victims is None else [PageId(v) for v in victims.tolist()]
        return self._evict(n, protected, partial=partial)

    def __len__(self) -> int:
        return self._count

    def contains(self, rows: np.ndarray) -> np.ndarray:
        rows = as_rows(rows)
        mask = np.zeros(len(rows), dtype=bool)
        inside = rows.view(np.uint64) < len(self._tracked)
        mask[inside] = self._tracked[rows[inside]]
        return mask

    def __contains__(self, page_id: object) -> bool:
        if not isinstance(page_id, int | np.integer):
            return False
        return bool(0 <= page_id < len(self._tracked) and self._tracked[page_id])

    # Per-page batch forms: one row call each.

    def insert_many(self, metas: Sequence[PageMeta]) -> None:
        self._insert(as_rows([m.page_id for m in metas]))

    def remove_many(self, page_ids: Iterable[PageId]) -> None:
        self._remove(self._in_range(as_rows(list(dict.fromkeys(page_ids)))))

    def touch_many(self, page_ids: Iterable[PageId]) -> None:
        # A repeated id ends up where its last touch puts it.
        last = list(dict.fromkeys(reversed(list(page_ids))))[::-1]
        self._touch(self._in_range(as_rows(last)))

    # The row mechanics.

    def _insert(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        top = int(rows.view(np.uint64).max())
        if top >= _NEGATIVE:
            bad = int(rows[rows < 0][0])
            raise ValueError(f"row {bad} is negative; LRU tracks page-table rows (ints >= 0)")
        self._reserve(top + 1)
        if self._tracked[rows].any():
            raise first_offender(rows.tolist(), set(rows[self._tracked[rows]].tolist()))
        stamps = self._stamps(len(rows))
        self._stamp[rows] = stamps
        # A repeated row keeps only one of its stamps. Stamps of untracked rows mean nothing,
        # so raising here changes nothing visible.
        if (self._stamp[rows] != stamps).any():
            raise first_offender(rows.tolist(), ())
        self._tracked[rows] = True
        self._count += len(rows)
        self._logged(rows, stamps)

    def _touch(self, rows: np.ndarray) -> None:
        rows = rows[self._tracked[rows]]
        if len(rows):
            stamps = self._stamps(len(rows))
            self._stamp[rows] = stamps
            self._logged(rows, stamps)

    def _remove(self, rows: np.ndarray) -> None:
        self._count -= int(np.count_nonzero(self._tracked[rows]))
        self._tracked[rows] = False
        if self._count == 0:
            self._log.clear()

    def _evict(self, n: int, protected: RowFilter, *, partial: bool) -> np.ndarray | None:
        check_n(n)
        if n > self._count and not partial:
            return None
        n = min(n, self._count)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        scan = self._scan(n, protected)
        victims = _joined(scan.victims)
        if len(victims) < n and not partial:
            self._compact()  # the log was walked to its end: drop the dead entries met
            return None
        self._tracked[victims] = False
        self._count -= len(victims)
        self._log.squeeze(_joined(scan.kept_rows), _joined(scan.kept_stamps), scan.stop)
        if self._count == 0:
            self._log.clear()
        return victims

    def _scan(self, n: int, protected: RowFilter) -> _Scan:
        """Up to ``n`` unprotected live rows from the log head, oldest first (see ``_Scan``)."""
        log, scan = self._log, _Scan(stop=self._log.head)
        width = max(2 * n, _MIN_WINDOW)
        while n and scan.stop < log.end:
            start, stop = scan.stop, min(scan.stop + width, log.end)
            rows, stamps = log.window(start, stop)
            live = np.flatnonzero(self._tracked[rows] & (self._stamp[rows] == stamps))
            rows, stamps = rows[live], stamps[live]
            guarded = np.asarray(protected(rows), dtype=bool) if len(rows) else rows < 0
            free = np.flatnonzero(~guarded)[:n]
            n -= len(free)
            if not n:  # stop right after the last victim: later entries stay as they are
                stop = start + int(live[free[-1]]) + 1
                guarded[free[-1] :] = False
            scan.victims.append(rows[free])
            scan.kept_rows.append(rows[guarded])
            scan.kept_stamps.append(stamps[guarded])
            scan.stop, width = stop, 2 * width
        return scan

    def _stamps(self, k: int) -> np.ndarray:
        stamps = np.arange(self._clock, self._clock + k, dtype=np.int64)
        self._clock += k
        return stamps

    def _logged(self, rows: np.ndarray, stamps: np.ndarray) -> None:
        """Log fresh stamps; compact the log once stale entries dominate it."""
        self._log.append(rows, stamps)
        if len(self._log) > 2 * self._count + _SLACK:
            self._compact()

    def _compact(self) -> None:
        """Keep only the live log entries."""
        rows, stamps = self._log.window(self._log.head, self._log.end)
        self._log.keep(self._tracked[rows] & (self._stamp[rows] == stamps))

    def _in_range(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` without those that can't be tracked (negative or never seen)."""
        rows = as_rows(rows)
        if len(rows) and int(rows.view(np.uint64).max()) >= len(self._tracked):
            rows = rows[rows.view(np.uint64) < len(self._tracked)]
        return rows

    def _reserve(self, size: int) -> None:
        """Grow the by-row arrays (doubling) to hold rows ``< size``."""
        if size <= len(self._tracked):
            return
        capacity = max(size, 2 * len(self._tracked))
        stamp = np.zeros(capacity, dtype=np.int64)
        stamp[: len(self._stamp)] = self._stamp
        tracked = np.zeros(capacity, dtype=bool)
        tracked[: len(self._tracked)] = self._tracked
        self._stamp, self._tracked = stamp, tracked


@dataclass(slots=True)
class _Scan:
    """What an eviction scan of the log found, oldest first, window by window.

    ``victims``: unprotected live rows, at most ``n``. ``kept_*``: the live entries scanned that
    are not victims (protected ones). ``stop``: the scan covered the log from its head up to
    here, the last victim included. Squeezing that part to the kept entries keeps the next scan
    from walking the dead ones again.
    """

    stop: int
    victims: list[np.ndarray] = field(default_factory=list)
    kept_rows: list[np.ndarray] = field(default_factory=list)
    kept_stamps: list[np.ndarray] = field(default_factory=list)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def _one(page_id: int) -> np.ndarray:
    if not isinstance(page_id, int | np.integer):
        raise TypeError(f"page id {page_id!r} is not an int; LRU tracks page-table rows")
    return np.array([page_id], dtype=np.int64)


def _container_filter(protected: Container[PageId]) -> RowFilter:
    """A ``protected`` callable over rows, from a per-page container of page ids."""

    def mask(rows: np.ndarray) -> np.ndarray:
        return np.fromiter(
            (PageId(r) in protected for r in rows.tolist()), dtype=bool, count=len(rows)
        )

    return mask
