"""Small helpers shared by the built-in eviction policies (no state lives here)."""

from __future__ import annotations

from collections.abc import Container, Iterable, Sized

import numpy as np

from kvtier.types import PageId


def check_n(n: int) -> None:
    """``evict`` takes a non-negative count; a negative one is a caller bug."""
    if n < 0:
        raise ValueError(f"evict(n): n must be >= 0, got {n}")


def already_tracked(page_id: PageId) -> ValueError:
    """The error for ``insert`` of a tracked page: the engine broke its own bookkeeping."""
    return ValueError(f"page {page_id} is already tracked by this policy")


def enough_evictable(
    tracked: Iterable[PageId], size: int, n: int, protected: Container[PageId]
) -> bool:
    """Whether at least ``n`` of the ``size`` tracked pages are not ``protected``.

    Skips the O(size) scan when ``protected`` is sized and small enough that ``n`` unprotected
    pages must exist; policies whose eviction loop mutates state call this before mutating, so
    an ``evict`` that returns ``None`` changes nothing.
    """
    if n > size:
        return False
    if isinstance(protected, Sized) and len(protected) + n <= size:
        return True
    free = 0
    for page_id in tracked:
        if page_id not in protected:
            free += 1
            if free >= n:
                return True
    return free >= n


def as_rows(rows: object) -> np.ndarray:
    """``rows`` as a 1-D ``int64`` array (no copy when it already is one)."""
    arr = np.asarray(rows, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"rows must be a 1-D array, got shape {arr.shape}")
    return arr


def first_offender(rows: Iterable[int], tracked: Container[int]) -> ValueError:
    """The ``insert`` error for the first row that is tracked or repeated (the slow path)."""
    seen: set[int] = set()
    for row in rows:
        if row in tracked or row in seen:
            return already_tracked(PageId(row))
        seen.add(row)
    raise AssertionError("first_offender called on rows with no offender")
