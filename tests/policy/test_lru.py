"""Exact eviction order of LRUPolicy."""

from __future__ import annotations

from kvtier.policy.lru import LRUPolicy

from .helpers import evict, insert_all, meta, touch_all


def test_evicts_least_recently_used_first() -> None:
    p = LRUPolicy()
    insert_all(p, [1, 2, 3])
    touch_all(p, [1])
    assert evict(p, 2) == [2, 3]
    assert evict(p, 1) == [1]
    assert len(p) == 0


def test_protected_pages_keep_their_place() -> None:
    p = LRUPolicy()
    insert_all(p, [1, 2, 3, 4])
    assert evict(p, 2, protected=[1, 3]) == [2, 4]
    assert evict(p, 1) == [1]
    assert evict(p, 1) == [3]


def test_update_is_not_an_access() -> None:
    p = LRUPolicy()
    insert_all(p, [1, 2])
    p.update(meta(1, priority=100.0))
    assert evict(p, 1) == [1]


def test_reinserted_page_is_most_recent() -> None:
    p = LRUPolicy()
    insert_all(p, [1, 2, 3])
    assert evict(p, 1) == [1]
    p.insert(meta(1))
    assert evict(p, 3) == [2, 3, 1]
