"""Exact behaviour of S3FIFOPolicy: small/main/ghost queues and frequency bits."""

from __future__ import annotations

from kvtier.policy.s3fifo import S3FIFOPolicy

from .helpers import evict, insert_all, meta, touch_all


def test_one_hit_wonders_leave_from_small_first() -> None:
    p = S3FIFOPolicy()
    insert_all(p, range(1, 11))
    touch_all(p, [1, 2, 3, 4, 5])
    # Reused pages at the small head are promoted to main; the first unused ones are victims.
    assert evict(p, 3) == [6, 7, 8]
    assert p.queues() == ([9, 10], [1, 2, 3, 4, 5], [6, 7, 8])
    assert evict(p, 2) == [9, 10]
    assert evict(p, 1) == [1]  # promotion reset the frequency


def test_ghost_hit_goes_straight_to_main() -> None:
    p = S3FIFOPolicy()
    insert_all(p, range(1, 11))
    touch_all(p, [1])
    assert evict(p, 1) == [2]
    p.insert(meta(2))
    small, main, ghost = p.queues()
    assert 2 in main and 2 not in small and ghost == [] and main == [1, 2]


def test_small_queue_is_used_only_while_it_holds_ten_percent() -> None:
    p = S3FIFOPolicy()
    insert_all(p, range(1, 12))
    touch_all(p, range(1, 12))
    # Ten promotions later small holds 1 of 11 pages (< 10 %), so main's head is the victim.
    assert evict(p, 1) == [1]
    assert p.queues()[:2] == ([11], list(range(2, 11)))
    p.insert(meta(12))
    # small holds 2 of 11 (>= 10 %): 11 is promoted; then 1 of 11 again, so main's head goes
    # although 12 is a one-hit wonder.
    assert evict(p, 1) == [2]
    # small holds 1 of 10 pages (10 %): 12 leaves from small.
    assert evict(p, 1) == [12]


def test_main_frequency_buys_extra_rounds() -> None:
    p = S3FIFOPolicy()
    insert_all(p, [1, 2, 3])
    touch_all(p, [1, 2, 3])
    assert evict(p, 1) == [1]  # all promoted with their frequency reset; 1 is main's head
    assert p.queues() == ([], [2, 3], [])  # main evictions leave no ghost
    touch_all(p, [2, 2, 2, 2])  # saturates at MAX_FREQ = 3
    assert evict(p, 1) == [3]  # 2 is reinserted at the tail with freq 2
    p.insert(meta(4))
    p.insert(meta(5))
    touch_all(p, [4, 5])
    # small [4, 5] -> main [2 (freq 2), 4, 5]; then 2 -> freq 1, 4 and 5 are victims.
    assert evict(p, 2) == [4, 5]
    assert evict(p, 1) == [2]


def test_protected_pages_keep_their_place() -> None:
    p = S3FIFOPolicy()
    insert_all(p, [1, 2, 3])
    assert evict(p, 1, protected=[1, 2]) == [3]
    assert p.queues() == ([1, 2], [], [3])
    assert evict(p, 1) == [1]


def test_ghost_queue_is_bounded_by_the_resident_count() -> None:
    p = S3FIFOPolicy()
    insert_all(p, range(3))
    assert evict(p, 3) == [0, 1, 2]
    insert_all(p, [10])
    assert evict(p, 1) == [10]
    assert p.queues()[2] == [10]
