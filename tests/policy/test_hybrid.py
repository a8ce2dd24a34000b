"""Exact eviction order of HybridPolicy: priority classes, LRU inside, second chance if reused."""

from __future__ import annotations

from kvtier.policy.hybrid import HybridPolicy

from .helpers import evict, insert_all, meta, touch_all


def test_plain_lru_within_one_class() -> None:
    p = HybridPolicy()
    insert_all(p, [1, 2, 3])
    touch_all(p, [1])
    assert evict(p, 2) == [2, 3]


def test_lower_priority_class_drains_first() -> None:
    p = HybridPolicy()
    p.insert(meta(1, priority=2.0))
    p.insert(meta(2, priority=1.0))
    p.insert(meta(3, priority=2.0))
    p.insert(meta(4, priority=1.0))
    touch_all(p, [2])
    assert evict(p, 3) == [4, 2, 1]
    assert evict(p, 1) == [3]


def test_reused_page_gets_a_second_chance() -> None:
    p = HybridPolicy()
    insert_all(p, [1, 2, 3])
    touch_all(p, [1, 1, 2, 3])  # LRU order 1 (2 hits), 2, 3
    assert evict(p, 1) == [2]  # 1 is passed over and becomes most recent
    assert evict(p, 1) == [3]
    assert evict(p, 1) == [1]  # its second chance is used up


def test_second_chance_wraps_around_within_the_class() -> None:
    p = HybridPolicy()
    insert_all(p, [1, 2])
    touch_all(p, [1, 1, 2, 2])
    p.insert(meta(3, priority=5.0))
    # Both low-class pages are passed over once, then evicted in their new order.
    assert evict(p, 2) == [1, 2]
    assert evict(p, 1) == [3]


def test_one_touch_is_not_enough() -> None:
    p = HybridPolicy()
    insert_all(p, [1, 2])
    touch_all(p, [1, 2])
    assert evict(p, 1) == [1]


def test_update_moves_class_but_keeps_recency() -> None:
    p = HybridPolicy()
    insert_all(p, [1, 2, 3])
    p.update(meta(1, priority=3.0))
    p.update(meta(3, priority=3.0))
    assert evict(p, 3) == [2, 1, 3]


def test_failed_evict_changes_nothing() -> None:
    p = HybridPolicy()
    insert_all(p, [1, 2, 3])
    touch_all(p, [1, 1])
    assert evict(p, 2, protected=[2, 3]) is None
    assert evict(p, 1, protected=[3]) == [2]  # 1 still had its two hits
    assert evict(p, 1, protected=[3]) == [1]
