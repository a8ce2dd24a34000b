"""RunSet: free-run merging against a plain set of free slots; the vectorised run grouping."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.runs import RunSet, ascending, free_runs, run_bounds


def test_take_and_merge() -> None:
    rs = RunSet(10)
    rs.take(0, 10)
    assert list(rs.items()) == [] and rs.total == 0
    rs.add(2, 2)
    rs.add(6, 1)
    rs.add(4, 2)  # bridges [2,4) and [6,7)
    assert list(rs.items()) == [(2, 5)]
    rs.add(0, 1)
    assert list(rs.items()) == [(0, 1), (2, 5)]
    with pytest.raises(AssertionError):
        rs.add(3, 1)  # already free


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 31), st.integers(1, 8)), max_size=40))
def test_matches_a_set_model(ops: list[tuple[bool, int, int]]) -> None:
    rs = RunSet(32)
    free = set(range(32))
    for is_take, pos, k in ops:
        runs = list(rs.items())
        if is_take and runs:
            start, length = runs[pos % len(runs)]
            k = min(k, length)
            rs.take(start, k)
            free -= set(range(start, start + k))
        elif not is_take:
            span = set(range(pos, min(32, pos + k)))
            if span and not span & free:
                rs.add(pos, len(span))
                free |= span
        got = {s for start, length in rs.items() for s in range(start, start + length)}
        assert got == free and rs.total == len(free)
        starts = [s for s, _ in rs.items()]
        ends = {s + n for s, n in rs.items()}
        assert not ends & set(starts)  # adjacent runs are always merged


def reference_runs(slots: list[int], per_chunk: int) -> list[tuple[int, int]]:
    """Positions ``(lo, hi)`` of the runs, found one slot at a time."""
    out: list[tuple[int, int]] = []
    for pos, s in enumerate(slots):
        if out and s == slots[pos - 1] + 1 and s % per_chunk:
            out[-1] = (out[-1][0], pos + 1)
        else:
            out.append((pos, pos + 1))
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=30), st.integers(1, 9))
def test_run_bounds_matches_a_slot_by_slot_walk(slots: list[int], per_chunk: int) -> None:
    lo, hi = run_bounds(np.array(slots, dtype=np.int64), per_chunk)
    assert list(zip(lo.tolist(), hi.tolist(), strict=True)) == reference_runs(slots, per_chunk)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, unique=True), st.integers(1, 9))
def test_free_runs_are_the_sorted_runs(slots: list[int], per_chunk: int) -> None:
    order = sorted(slots)
    shuffled = np.array(slots, dtype=np.int64)  # distinct, in any order
    chunk_nos, starts, counts = free_runs(shuffled, per_chunk)
    ids = [
        c * per_chunk + s + j
        for c, s, k in zip(chunk_nos, starts, counts, strict=True)
        for j in range(k)
    ]
    assert ids == order
    assert [(hi - lo) for lo, hi in reference_runs(order, per_chunk)] == counts
    assert all(s + k <= per_chunk for s, k in zip(starts, counts, strict=True))


def test_ascending_and_free_runs_reject_repeats() -> None:
    same = np.array([1, 2, 3], dtype=np.int64)
    assert ascending(same)[0] is same and ascending(same)[1]  # sorted input is not copied
    assert ascending(np.array([3, 1, 2], dtype=np.int64))[0].tolist() == [1, 2, 3]
    assert not ascending(np.array([3, 1, 3], dtype=np.int64))[1]
    assert free_runs(np.array([9, 3, 4, 5], dtype=np.int64), 4) == ([0, 1, 2], [3, 0, 1], [1, 2, 1])
    with pytest.raises(AssertionError):
        free_runs(np.array([2, 5, 2], dtype=np.int64), 4)
    with pytest.raises(AssertionError):
        free_runs(np.array([-1, 0], dtype=np.int64), 4)
