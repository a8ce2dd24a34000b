"""LRUPolicy's row form: exact eviction order, its log staying bounded, large batches."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvtier.policy import lru
from kvtier.policy.lru import LRUPolicy
from kvtier.types import PageId

from .helpers import evict, evict_rows, insert_rows, meta, row_meta, rows

BATCH = st.lists(st.integers(min_value=0, max_value=40), max_size=12, unique=True)


def _log_bound(tracked: int) -> int:
    """The most entries the log holds after an insert or touch: past this it is compacted."""
    return 2 * tracked + lru._SLACK


def test_exact_order_in_and_across_batches() -> None:
    p = LRUPolicy()
    insert_rows(p, [3, 1, 2])
    p.touch(rows(3, 9))
    insert_rows(p, [0])
    p.touch(rows(1))
    assert evict_rows(p, 3) == [2, 3, 0]
    assert evict_rows(p, 1) == [1]
    assert len(p) == 0


def test_protected_rows_keep_their_place() -> None:
    p = LRUPolicy()
    insert_rows(p, [1, 2, 3, 4])
    assert evict_rows(p, 2, protected=[1, 3]) == [2, 4]
    insert_rows(p, [5])
    assert evict_rows(p, 1, protected=[1]) == [3]
    assert evict_rows(p, 2) == [1, 5]


def test_partial_takes_what_is_free_in_order() -> None:
    p = LRUPolicy()
    insert_rows(p, range(6))
    p.touch(rows(0))
    assert evict_rows(p, 10, protected=[2, 3], partial=True) == [1, 4, 5, 0]
    assert evict_rows(p, 1, protected=[2, 3], partial=True) == []
    assert evict_rows(p, 2) == [2, 3]


def test_update_is_not_an_access_and_forms_share_state() -> None:
    p = LRUPolicy()
    insert_rows(p, [1, 2])
    p.update(rows(1), row_meta(1, priority=100.0))
    p.insert(meta(3))
    p.touch(PageId(1))
    assert PageId(3) in p and p.contains(rows(3)).tolist() == [True]
    assert evict(p, 1) == [2]
    assert evict_rows(p, 2) == [3, 1]


def test_negative_rows_are_rejected_or_ignored() -> None:
    p = LRUPolicy()
    insert_rows(p, [1])
    with pytest.raises(ValueError, match="-4"):
        insert_rows(p, [2, -4])
    assert len(p) == 1 and p.contains(rows(2, -4)).tolist() == [False, False]
    p.touch(rows(-1, 1))
    p.remove(rows(-1))
    assert PageId(-1) not in p and "1" not in p
    assert evict_rows(p, 1) == [1]


def test_log_stays_bounded_over_touch_cycles() -> None:
    p = LRUPolicy()
    model: OrderedDict[int, None] = OrderedDict.fromkeys(range(100))
    insert_rows(p, range(100))
    rng = np.random.default_rng(7)
    for _ in range(10_000):
        batch = rng.permutation(100)[: rng.integers(1, 100)]
        p.touch(batch)
        for r in batch.tolist():
            model.move_to_end(r)
        assert len(p._log) <= _log_bound(100)
    assert evict_rows(p, 100) == list(model)


def test_log_stays_bounded_behind_a_pinned_cold_row() -> None:
    p = LRUPolicy()
    insert_rows(p, [0])
    for k in range(1, 2001):
        insert_rows(p, range(10 * k, 10 * k + 10))
        assert evict_rows(p, 10, protected=[0]) == list(range(10 * k, 10 * k + 10))
        assert len(p._log) <= 2  # the pinned row, and nothing dead behind it
    assert evict_rows(p, 1) == [0]


def test_large_batch_with_every_third_row_protected() -> None:
    p = LRUPolicy()
    order = np.random.default_rng(3).permutation(100_000).astype(np.int64)
    p.insert(order, row_meta(len(order)))
    victims = p.evict(50_000, lambda r: r % 3 == 0)
    expected = order[order % 3 != 0][:50_000]
    assert victims is not None and np.array_equal(victims, expected)
    assert len(p) == 50_000
    assert not p.contains(expected).any()
    rest = p.evict(50_000, lambda r: np.zeros(len(r), dtype=bool))
    assert rest is not None
    assert np.array_equal(rest, order[~np.isin(order, expected)])


class RowLRUMachine(RuleBasedStateMachine):
    """Row and per-page calls mixed; an ordered dict (cold end first) is the model."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = LRUPolicy()
        self.model: OrderedDict[int, None] = OrderedDict()

    @rule(batch=BATCH)
    def insert(self, batch: list[int]) -> None:
        fresh = [r for r in batch if r not in self.model]
        insert_rows(self.policy, fresh)
        self.model.update(dict.fromkeys(fresh))
        if fresh:  # the log is compacted when it grows
            assert len(self.policy._log) <= _log_bound(len(self.model))

    @rule(batch=BATCH)
    def touch(self, batch: list[int]) -> None:
        self.policy.touch(rows(*batch))
        touched = [r for r in batch if r in self.model]
        for r in touched:
            self.model.move_to_end(r)
        if touched:  # the log is compacted when it grows
            assert len(self.policy._log) <= _log_bound(len(self.model))

    @rule(batch=BATCH, per_page=st.booleans())
    def remove(self, batch: list[int], per_page: bool) -> None:
        if per_page:
            self.policy.remove_many([PageId(r) for r in batch])
        else:
            self.policy.remove(rows(*batch))
        for r in batch:
            self.model.pop(r, None)

    @rule(n=st.integers(0, 12), guarded=BATCH, partial=st.booleans())
    def evict(self, n: int, guarded: list[int], partial: bool) -> None:
        free = [r for r in self.model if r not in guarded]
        expected = free[:n] if partial or len(free) >= n else None
        assert evict_rows(self.policy, n, guarded, partial=partial) == expected
        for r in expected or ():
            del self.model[r]

    @invariant()
    def same_tracked_rows(self) -> None:
        assert len(self.policy) == len(self.model)
        tracked = self.policy.contains(rows(*range(41)))
        assert np.flatnonzero(tracked).tolist() == sorted(self.model)


@pytest.mark.parametrize(("slack", "window"), [(1024, 64), (0, 1)])
def test_row_state_machine(monkeypatch: pytest.MonkeyPatch, slack: int, window: int) -> None:
    """Also with compaction on nearly every call and the smallest first scan windows."""
    monkeypatch.setattr(lru, "_SLACK", slack)
    monkeypatch.setattr(lru, "_MIN_WINDOW", window)
    run_state_machine_as_test(
        RowLRUMachine, settings=settings(max_examples=150, stateful_step_count=60, deadline=None)
    )
