"""Exact eviction order of HybridPolicy: priority classes, LRU inside, second chance if reused."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy.hybrid import HybridPolicy
from kvtier.types import PageId

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
    p.update(meta(3, priority=3.0))
    p.update(meta(1, priority=3.0))  # joins the class behind 3 but is older
    assert evict(p, 3) == [2, 1, 3]


def test_failed_evict_changes_nothing() -> None:
    p = HybridPolicy()
    insert_all(p, [1, 2, 3])
    touch_all(p, [1, 1])
    assert evict(p, 2, protected=[2, 3]) is None
    assert evict(p, 1, protected=[3]) == [2]  # 1 still had its two hits
    assert evict(p, 1, protected=[3]) == [1]


class _Reference:
    """The documented order, computed the slow and obvious way (a sort per eviction)."""

    def __init__(self) -> None:
        self.pages: dict[int, list[float]] = {}  # id -> [priority, last_access, hits]
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def evict(self, n: int, protected: set[int]) -> list[int] | None:
        free = sorted(
            (p for p in self.pages if p not in protected),
            key=lambda p: (self.pages[p][0], self.pages[p][1]),
        )
        if len(free) < n:
            return None
        victims: list[int] = []
        for prio in sorted({self.pages[p][0] for p in free}):
            queue = [p for p in free if self.pages[p][0] == prio]
            while queue and len(victims) < n:
                p = queue.pop(0)
                if self.pages[p][2] >= 2:
                    self.pages[p][1:] = [self.tick(), 0]
                    queue.append(p)
                else:
                    victims.append(p)
        for p in victims:
            del self.pages[p]
        return victims


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "touch", "update", "remove", "evict"]),
        st.integers(0, 9),
        st.sampled_from([1.0, 2.0, 3.0]),
        st.frozensets(st.integers(0, 9), max_size=4),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_matches_reference(ops: list[tuple[str, int, float, frozenset[int]]]) -> None:
    p, ref = HybridPolicy(), _Reference()
    for op, page, prio, protected in ops:
        if op == "insert" and page not in ref.pages:
            p.insert(meta(page, priority=prio))
            ref.pages[page] = [prio, ref.tick(), 0]
        elif op == "touch" and page in ref.pages:
            p.touch(PageId(page))
            ref.pages[page][1:] = [ref.tick(), ref.pages[page][2] + 1]
        elif op == "update" and page in ref.pages:
            p.update(meta(page, priority=prio))
            ref.pages[page][0] = prio
        elif op == "remove":
            p.remove(PageId(page))
            ref.pages.pop(page, None)
        elif op == "evict":
            assert evict(p, page % 4, protected) == ref.evict(page % 4, set(protected))
