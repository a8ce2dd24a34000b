"""``PerPagePolicy``: any ``EvictionPolicy`` behind the batched ``RowPolicy`` interface.

The wrapped policy's page ids are the rows (plain ints). Each batch call becomes one batch call
of the wrapped policy (``insert_many``, ``remove_many``, ``touch_many``) or a loop of per-page
``update`` calls, so the per-page cost of the wrapped policy remains; only ``LRUPolicy`` is
row-native today.

The adapter keeps its own set of tracked rows. It answers ``__len__`` and ``contains`` from it,
checks ``insert`` against it before the wrapped policy sees anything (so a bad insert changes
nothing whatever the wrapped ``insert_many`` does), and builds the one array of tracked rows
that ``evict`` hands to ``protected`` in a single call: ``protected`` is never called per row.
"""

from __future__ import annotations

import numpy as np

from kvtier.policy._common import as_rows, check_n, first_offender
from kvtier.policy.base import EvictionPolicy, RowFilter, RowMeta, RowPolicy
from kvtier.types import PageId, PageMeta

_NO_ROWS = np.empty(0, dtype=np.int64)


class PerPagePolicy(RowPolicy):
    """A ``RowPolicy`` that forwards to a per-page ``EvictionPolicy`` whose page ids are rows."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._rows: set[int] = set()

    @property
    def policy(self) -> EvictionPolicy:
        """The wrapped per-page policy."""
        return self._policy

    def insert(self, rows: np.ndarray, meta: RowMeta) -> None:
        ids = as_rows(rows).tolist()
        if len(set(ids)) != len(ids) or not self._rows.isdisjoint(ids):
            raise first_offender(ids, self._rows)
        self._policy.insert_many(_page_metas(ids, meta))
        self._rows.update(ids)

    def remove(self, rows: np.ndarray) -> None:
        ids = as_rows(rows).tolist()
        self._policy.remove_many([PageId(r) for r in ids])
        self._rows.difference_update(ids)

    def touch(self, rows: np.ndarray) -> None:
        self._policy.touch_many([PageId(r) for r in as_rows(rows).tolist()])

    def update(self, rows: np.ndarray, meta: RowMeta) -> None:
        for page in _page_metas(as_rows(rows).tolist(), meta):
            self._policy.update(page)

    def evict(self, n: int, protected: RowFilter, *, partial: bool = False) -> np.ndarray | None:
        check_n(n)
        if n == 0 or (partial and not self._rows):
            return _NO_ROWS.copy()
        if n > len(self._rows) and not partial:
            return None
        tracked = np.fromiter(self._rows, dtype=np.int64, count=len(self._rows))
        mask = np.asarray(protected(tracked), dtype=bool)
        guarded = {PageId(r) for r in tracked[mask].tolist()}
        free = len(tracked) - len(guarded)
        k = min(n, free) if partial else n
        if k > free:
            return None
        if k == 0:
            return _NO_ROWS.copy()
        victims = self._policy.evict(k, guarded)
        if victims is None:  # the wrapped policy broke its contract; report no change
            return _NO_ROWS.copy() if partial else None
        self._rows.difference_update(victims)
        return np.array(victims, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._rows)

    def contains(self, rows: np.ndarray) -> np.ndarray:
        ids = as_rows(rows).tolist()
        return np.fromiter((r in self._rows for r in ids), dtype=bool, count=len(ids))


def _page_metas(ids: list[int], meta: RowMeta) -> list[PageMeta]:
    """One ``PageMeta`` per row, from the aligned ``RowMeta`` arrays."""
    return [
        PageMeta(PageId(r), priority=pr, position=pos, length=ln)
        for r, pr, pos, ln in zip(
            ids,
            meta.priority.tolist(),
            meta.position.tolist(),
            meta.length.tolist(),
            strict=True,
        )
    ]
