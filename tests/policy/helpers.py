"""Test helpers for policy tests: small integer page ids, CacheLib style."""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.policy.base import EvictionPolicy
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
