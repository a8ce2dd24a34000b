"""Test helpers for policy tests: small integer page ids, CacheLib style."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvtier.policy.base import EvictionPolicy, RowMeta, RowPolicy
from kvtier.types import PageId, PageMeta


def meta(page_id: int, priority: float = 1.0, position: int = 0, length: int = 1) -> PageMeta:
    return PageMeta(PageId(page_id), priority=priority, position=position, length=length)


def insert_all(policy: EvictionPolicy, ids: Iterable[int]) -> None:
    for i in ids:
        policy.insert(meta(i))


def touch_all(policy: EvictionPolicy, ids: Iterable[int]) -> None:
    for i in ids:
        policy.touch(PageId(i))


def evict(policy: EvictionPolicy, n: int, protected: Iterable[int] = ()) -> list[int] | None:
    """``policy.evict`` with plain ints, so expected orders read as literals."""
    victims = policy.evict(n, {PageId(p) for p in protected})
    return None if victims is None else [int(v) for v in victims]


def rows(*ids: int) -> np.ndarray:
    """A rows batch, as the engine passes it."""
    return np.array(ids, dtype=np.int64)


def row_meta(n: int, priority: float = 1.0, position: int = 0, length: int = 1) -> RowMeta:
    """``RowMeta`` for ``n`` rows, all alike."""
    return RowMeta(
        np.full(n, priority, dtype=np.float64),
        np.full(n, position, dtype=np.int64),
        np.full(n, length, dtype=np.int64),
    )


def insert_rows(policy: RowPolicy, ids: Iterable[int]) -> None:
    batch = rows(*ids)
    policy.insert(batch, row_meta(len(batch)))


def evict_rows(
    policy: RowPolicy, n: int, protected: Iterable[int] = (), *, partial: bool = False
) -> list[int] | None:
    """``policy.evict`` with a protected set of plain ints, victims as a plain list."""
    guarded = rows(*protected)
    victims = policy.evict(n, lambda r: np.isin(r, guarded), partial=partial)
    return None if victims is None else victims.tolist()
