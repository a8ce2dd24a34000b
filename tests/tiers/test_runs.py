"""RunSet: free-run merging against a plain set of free slots."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.runs import RunSet


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
