"""Exact behaviour of ARCPolicy: T1/T2 placement, REPLACE, ghost hits adapting p."""

from __future__ import annotations

from kvtier.policy.arc import ARCPolicy

from .helpers import evict, insert_all, meta, touch_all


def _setup() -> ARCPolicy:
    p = ARCPolicy()
    insert_all(p, [1, 2, 3, 4])
    touch_all(p, [3, 4])
    assert p.lists() == ([1, 2], [3, 4], [], [])
    return p


def test_new_pages_enter_t1_and_touch_promotes_to_t2() -> None:
    p = _setup()
    touch_all(p, [3])
    assert p.lists() == ([1, 2], [4, 3], [], [])


def test_replace_takes_t1_while_it_exceeds_target() -> None:
    p = _setup()
    assert p.target == 0
    assert evict(p, 3) == [1, 2, 3]
    assert p.lists() == ([], [4], [1, 2], [3])


def test_b1_ghost_hit_grows_target_and_shifts_eviction_to_t2() -> None:
    p = _setup()
    assert evict(p, 1) == [1]
    p.insert(meta(1))  # B1 hit: p += max(|B2| / |B1|, 1) = 1
    assert p.target == 1
    assert p.lists() == ([2], [3, 4, 1], [], [])
    assert evict(p, 2) == [3, 4]  # |T1| == 1 is not above p: T2 goes first
    assert p.lists() == ([2], [1], [], [3, 4])


def test_b2_ghost_hit_shrinks_target() -> None:
    p = _setup()
    evict(p, 1)
    p.insert(meta(1))
    evict(p, 2)  # B2 = [3, 4], p = 1
    p.insert(meta(3))  # B2 hit: p -= max(|B1| / |B2|, 1) = 1
    assert p.target == 0
    assert p.lists() == ([2], [1, 3], [], [4])
    assert evict(p, 1) == [2]


def test_falls_back_to_the_other_list_when_one_is_protected() -> None:
    p = _setup()
    assert evict(p, 2, protected=[1, 2]) == [3, 4]
    assert p.lists() == ([1, 2], [], [], [3, 4])


def test_ghosts_are_bounded_by_the_resident_count() -> None:
    p = ARCPolicy()
    insert_all(p, range(4))
    assert evict(p, 2) == [0, 1]
    insert_all(p, range(10, 12))
    assert evict(p, 4) == [2, 3, 10, 11]
    t1, t2, b1, b2 = p.lists()
    assert (t1, t2) == ([], [])
    assert len(b1) + len(b2) <= 4
    assert b1 == [2, 3, 10, 11]


def test_remove_leaves_no_ghost() -> None:
    p = _setup()
    p.remove(meta(1).page_id)
    p.remove(meta(3).page_id)
    assert p.lists() == ([2], [4], [], [])
