"""kvtier/tiers/fairqueue.py: owners served in turn, the heaviest owner evicted first."""

from __future__ import annotations

from kvtier.tiers.fairqueue import FairQueue


def test_owners_are_served_in_turn_each_in_its_own_order() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push("a", f"a{i}", 10)
    q.push("b", "b0", 10)
    q.push("c", "c0", 5)
    assert q.bytes == 45 and len(q) == 5
    assert q.peek_size() == 10
    assert [q.pop() for _ in range(5)] == ["a0", "b0", "c0", "a1", "a2"]
    assert not q and q.bytes == 0


def test_room_comes_from_the_heaviest_other_owners_newest_items() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push("noisy", f"n{i}", 10)
    q.push("quiet", "q0", 10)
    assert q.make_room("quiet", 15, 10) == ["n3", "n2"]  # 20 bytes freed for 15 asked
    assert q.bytes == 30
    assert q.make_room("noisy", 10, 10) == []  # never from the asker itself
    q.push("quiet", "q1", 10)  # quiet 20, noisy 20: neither holds more than the other would
    assert q.make_room("quiet", 10, 10) == []
    assert [q.pop() for _ in range(len(q))] == ["n0", "q0", "n1", "q1"]


def test_an_owner_emptied_by_eviction_leaves_the_turn() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", "a0", 30)
    q.push("b", "b0", 5)
    assert q.make_room("b", 30, 5) == ["a0"]
    assert [q.pop() for _ in range(len(q))] == ["b0"] and not q
    q.push("a", "a1", 1)
    assert q.clear() == ["a1"] and not q and q.bytes == 0
