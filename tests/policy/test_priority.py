"""Exact eviction order of PriorityPolicy: recency / priority * (position + 1) / length."""

from __future__ import annotations

import pytest

from kvtier.policy.priority import PriorityPolicy
from kvtier.types import PageId

from .helpers import evict, meta, touch_all


def test_score_formula() -> None:
    p = PriorityPolicy()
    p.insert(meta(1, priority=1.0, position=0, length=4))  # tick 1
    p.insert(meta(2, priority=1.0, position=3, length=4))  # tick 2
    p.insert(meta(3, priority=4.0, position=3, length=4))  # tick 3 (clock = 3)
    assert p.score(PageId(1)) == pytest.approx(3 * 1.0 * 0.25)
    assert p.score(PageId(2)) == pytest.approx(2 * 1.0 * 1.0)
    assert p.score(PageId(3)) == pytest.approx(1 * 0.25 * 1.0)
    assert evict(p, 3) == [2, 1, 3]


def test_sequence_tail_goes_before_its_head() -> None:
    p = PriorityPolicy()
    for pos in range(4):
        p.insert(meta(10 + pos, position=pos, length=4))
    # Recency favours evicting the head (inserted first), lateness the tail; with equal
    # priorities: scores 4*1/4=1, 3*2/4=1.5, 2*3/4=1.5, 1*4/4=1 -> ties break older first.
    assert evict(p, 4) == [11, 12, 10, 13]


def test_low_priority_and_old_pages_go_first() -> None:
    p = PriorityPolicy()
    p.insert(meta(1, priority=8.0))
    p.insert(meta(2, priority=1.0))
    p.insert(meta(3, priority=0.5))
    touch_all(p, [2])  # clock 4: recency 1:4, 2:1, 3:2
    assert evict(p, 3) == [3, 2, 1]  # scores 0.5, 1, 4


def test_touch_resets_recency_and_update_is_not_an_access() -> None:
    p = PriorityPolicy()
    p.insert(meta(1))
    p.insert(meta(2))
    touch_all(p, [1])
    assert evict(p, 1, protected=[]) == [2]
    p.insert(meta(2))
    p.update(meta(1, priority=100.0))
    assert evict(p, 1) == [2]  # 1 is older but now worth 100x more


def test_ties_break_by_age_then_id() -> None:
    p = PriorityPolicy()
    p.insert(meta(5, priority=2.0))  # recency 2 / 2 = 1
    p.insert(meta(4, priority=1.0))  # recency 1 / 1 = 1
    assert evict(p, 2) == [5, 4]


def test_bad_metadata_is_clamped() -> None:
    p = PriorityPolicy()
    p.insert(meta(1, priority=0.0, position=9, length=0))
    p.insert(meta(2, priority=1.0))
    assert p.score(PageId(1)) > p.score(PageId(2))
    assert evict(p, 1) == [1]
