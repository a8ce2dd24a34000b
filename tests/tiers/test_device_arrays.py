"""DevicePool's array API: ``take``/``give`` against a plain set model and the list API."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import InvalidArgument
from kvtier.tiers import device
from kvtier.tiers.device import DevicePool


def make_pool(num_slots: int) -> DevicePool:
    """A pool over plain memory (one byte per page): no shm file to clean up."""
    return DevicePool.from_segments([torch.zeros(num_slots, 1, dtype=torch.uint8)])


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def took(pool: DevicePool, n: int) -> list[int]:
    got = pool.take(n)
    assert got is not None and got.dtype == np.int64
    return [int(x) for x in got]


def test_take_is_lowest_first_all_or_nothing() -> None:
    pool = make_pool(8)
    got = pool.take(3)
    assert got is not None and got.dtype == np.int64 and got.tolist() == [0, 1, 2]
    assert pool.take(6) is None  # only 5 free: nothing taken
    assert pool.num_free == 5
    empty = pool.take(0)
    assert empty is not None and empty.dtype == np.int64 and len(empty) == 0
    with pytest.raises(InvalidArgument):
        pool.take(-1)
    pool.give(arr(1))
    assert pool.alloc(2) == [1, 3]  # the list API sees the same slots
    assert pool.num_free == 4


def test_take_lowest_first_after_scattered_gives() -> None:
    pool = make_pool(64)
    assert pool.take(64) is not None
    pool.give(arr(50, 3, 17, 63, 40, 8))
    assert pool.num_free == 6
    assert took(pool, 2) == [3, 8]
    pool.give(arr(0))  # below the hint
    assert took(pool, 3) == [0, 17, 40]
    assert pool.take(3) is None
    assert took(pool, 2) == [50, 63]
    assert pool.num_free == 0


def test_take_spans_many_scan_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "_MIN_SCAN", 1)  # the window starts at 2 n and doubles
    pool = make_pool(5000)
    assert pool.take(4990) is not None
    sparse = np.arange(7, 4990, 97, dtype=np.int64)
    pool.give(np.random.default_rng(1).permutation(sparse))
    got = pool.take(len(sparse) + 4)
    assert got is not None
    assert got.tolist() == [*sparse.tolist(), 4990, 4991, 4992, 4993]


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(arr(2), id="free-slot"),
        pytest.param(arr(5, 2), id="free-among-used"),
        pytest.param(arr(5, 6, 5), id="duplicate"),
        pytest.param(arr(16), id="past-the-end"),
        pytest.param(arr(-1, 4), id="negative"),
    ],
)
def test_bad_give_asserts_and_changes_nothing(bad: np.ndarray) -> None:
    pool = make_pool(16)
    assert pool.take(12) is not None
    pool.give(arr(2, 9))
    before = (pool.num_free, pool._is_free.copy(), pool._hint)
    with pytest.raises(AssertionError):
        pool.give(bad)
    assert pool.num_free == before[0] and pool._hint == before[2]
    assert np.array_equal(pool._is_free, before[1])
    assert took(pool, 6) == [2, 9, 12, 13, 14, 15]


def test_list_api_is_a_wrapper_with_the_same_results() -> None:
    a, b = make_pool(32), make_pool(32)
    for n, back in [(5, [3, 1]), (10, [0, 12, 7]), (20, [])]:
        listed = a.alloc(n)
        taken = b.take(n)
        assert (listed is None) == (taken is None)
        if listed is not None and taken is not None:
            assert listed == taken.tolist()
        a.free(back)
        b.give(np.array(back, dtype=np.int64))
        assert a.num_free == b.num_free


NUM_SLOTS = 40


class PoolMachine(RuleBasedStateMachine):
    """Model: the set of slots in use. Array and list calls interleave on one pool."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = pytest.MonkeyPatch()
        self.patch.setattr(device, "_MIN_SCAN", 2)  # small windows: growth is exercised
        self.pool = make_pool(NUM_SLOTS)
        self.used: set[int] = set()

    def expect(self, n: int) -> list[int] | None:
        free = sorted(set(range(NUM_SLOTS)) - self.used)
        return free[:n] if n <= len(free) else None

    @rule(n=st.integers(0, 15), as_list=st.booleans())
    def take(self, n: int, as_list: bool) -> None:
        want = self.expect(n)
        if as_list:
            got = self.pool.alloc(n)
        else:
            out = self.pool.take(n)
            assert out is None or out.dtype == np.int64
            got = None if out is None else out.tolist()
        assert got == want
        self.used.update(got or [])

    @precondition(lambda self: self.used)
    @rule(data=st.data(), as_list=st.booleans())
    def give(self, data: st.DataObject, as_list: bool) -> None:
        back = data.draw(st.lists(st.sampled_from(sorted(self.used)), min_size=1, unique=True))
        if as_list:
            self.pool.free(back)
        else:
            self.pool.give(np.array(back, dtype=np.int64))
        self.used.difference_update(back)

    @precondition(lambda self: self.used)
    @rule(data=st.data(), kind=st.sampled_from(["free", "low", "high", "repeat"]))
    def bad_give(self, data: st.DataObject, kind: str) -> None:
        """A give with one bad slot among good ones asserts; the next rules see no change."""
        used, free = sorted(self.used), sorted(set(range(NUM_SLOTS)) - self.used)
        good = data.draw(st.lists(st.sampled_from(used), max_size=3, unique=True))
        if kind == "free" and free:
            bad = [data.draw(st.sampled_from(free))]
        elif kind == "repeat":
            bad = [data.draw(st.sampled_from(used))] * 2
        else:
            bad = [-1 if kind == "low" else NUM_SLOTS]
        mixed = np.array(data.draw(st.permutations([*good, *bad])), dtype=np.int64)
        with pytest.raises(AssertionError):
            self.pool.give(mixed)

    @invariant()
    def counts_match(self) -> None:
        assert self.pool.num_free == NUM_SLOTS - len(self.used)

    def teardown(self) -> None:
        self.patch.undo()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_take_some_takes_what_is_free_lowest_first() -> None:
    pool = DevicePool.allocate(8, 64, "cpu")
    assert pool.take_some(3).tolist() == [0, 1, 2]
    assert pool.take_some(10).tolist() == [3, 4, 5, 6, 7]  # fewer are free: all of them
    assert pool.take_some(1).tolist() == [] and pool.num_free == 0
