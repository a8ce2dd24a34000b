"""HostArena's array API: ``alloc_array``/``free_array`` against the list API, ``runs_array``."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidArgument
from kvtier.tiers.pinned import HostArena

KIB = 1024
P = 4 * KIB  # 4 slots per 16 KiB chunk: runs cross chunk ends often


@pytest.fixture
def arena():
    a = HostArena(budget_bytes=64 * KIB, chunk_bytes=16 * KIB, pin=False)
    yield a
    a.close()


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def tag_rows(arena: HostArena, slots: np.ndarray) -> None:
    """Fill each slot's page with its own id (mod 251) so views can be checked byte by byte."""
    for s, row in zip(slots.tolist(), arena.rows(P, slots.tolist()), strict=True):
        row.fill_(s % 251)


def check_runs(arena: HostArena, slots: np.ndarray) -> list[tuple[torch.Tensor, int, int]]:
    """``runs_array`` covers every position in order, in maximal runs of bytes equal to rows()."""
    runs = arena.runs_array(P, slots)
    per = arena.slots_per_chunk(P)
    assert [lo for _, lo, _ in runs] == [0, *(hi for _, _, hi in runs[:-1])]
    assert runs[-1][2] == len(slots)
    rows = arena.rows(P, slots.tolist())
    for view, lo, hi in runs:
        ids = slots[lo:hi].tolist()
        assert ids == list(range(ids[0], ids[0] + len(ids)))  # consecutive ids
        assert ids[0] // per == ids[-1] // per  # in one chunk
        assert view.shape == (hi - lo, P) and view.is_contiguous()
        assert view.data_ptr() == rows[lo].data_ptr()
        assert torch.equal(view, torch.stack(rows[lo:hi]))
        if hi < len(slots):  # maximal: the next slot could not have joined
            nxt = int(slots[hi])
            assert nxt != ids[-1] + 1 or nxt % per == 0
    listed = arena.runs(P, slots.tolist())
    assert [(v.data_ptr(), v.shape, r) for v, r in listed] == [
        (v.data_ptr(), v.shape, range(lo, hi)) for v, lo, hi in runs
    ]
    return runs


def test_alloc_array_is_alloc_as_int64(arena: HostArena) -> None:
    got = arena.alloc_array(P, 6)
    assert got is not None and got.dtype == np.int64 and got.tolist() == list(range(6))
    empty = arena.alloc_array(P, 0)
    assert empty is not None and empty.dtype == np.int64 and len(empty) == 0
    assert arena.alloc_array(P, 11) is None  # 10 left in the budget: nothing changed
    assert arena.used_bytes == 6 * P and arena.reserved_bytes == 32 * KIB
    with pytest.raises(InvalidArgument):
        arena.alloc_array(P, -1)
    with pytest.raises(InvalidArgument):
        arena.alloc_array(0, 1)
    arena.free_array(P, arr(5, 1, 4))
    assert arena.alloc(P, 2) == [4, 5]  # best fit, as the list API


def test_runs_array_contiguous_is_one_view(arena: HostArena) -> None:
    got = arena.alloc_array(P, 3)
    assert got is not None
    tag_rows(arena, got)
    ((view, lo, hi),) = check_runs(arena, got)
    assert (lo, hi) == (0, 3) and view.shape == (3, P)
    assert arena.runs_array(P, arr()) == []


@pytest.mark.parametrize(
    "order",
    [
        pytest.param([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], id="chunk-crossing"),
        pytest.param([9, 8, 7, 6, 5, 4, 3, 2, 1, 0], id="reversed"),
        pytest.param([2, 3, 4, 7, 0, 1], id="scattered"),
        pytest.param([6, 7, 8, 1, 5, 9, 2, 3], id="scattered-crossing"),
        pytest.param([4], id="single"),
    ],
)
def test_runs_array_orders(arena: HostArena, order: list[int]) -> None:
    got = arena.alloc_array(P, 10)
    assert got is not None and got.tolist() == list(range(10))
    tag_rows(arena, got)
    runs = check_runs(arena, np.array(order, dtype=np.int64))
    if order == sorted(order) and len(order) == 10:
        assert [(lo, hi) for _, lo, hi in runs] == [(0, 4), (4, 8), (8, 10)]
    if order == sorted(order, reverse=True):
        assert len(runs) == len(order)


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(14)), st.integers(1, 14))
def test_runs_array_any_order(order: list[int], n: int) -> None:
    with HostArena(budget_bytes=64 * KIB, chunk_bytes=16 * KIB, pin=False) as arena:
        got = arena.alloc_array(P, 14)
        assert got is not None
        tag_rows(arena, got)
        check_runs(arena, np.array(order[:n], dtype=np.int64))


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(arr(3, 1, 3), id="duplicate"),
        pytest.param(arr(-1), id="negative"),
        pytest.param(arr(2, 40), id="unknown-chunk"),
        pytest.param(arr(7), id="already-free"),
    ],
)
def test_bad_free_array_asserts_and_changes_nothing(arena: HostArena, bad: np.ndarray) -> None:
    got = arena.alloc_array(P, 7)
    assert got is not None
    arena.free_array(P, arr(5))
    with pytest.raises(AssertionError):
        arena.free_array(P, bad)
    assert arena.used_bytes == 6 * P
    # The holes are exactly as before: 5 and 7 (best fit, lowest first), then a fresh chunk.
    assert [arena.alloc(P, 1), arena.alloc(P, 1), arena.alloc(P, 2)] == [[5], [7], [8, 9]]


OPS = st.lists(
    st.tuples(st.booleans(), st.sampled_from((P, 8 * KIB, 12 * KIB)), st.integers(0, 9)),
    max_size=30,
)


@settings(max_examples=80, deadline=None)
@given(OPS, st.randoms(use_true_random=False))
def test_array_api_matches_list_api(ops: list[tuple[bool, int, int]], rnd: random.Random) -> None:
    """Two arenas, one driven by lists and one by arrays, stay identical step by step."""
    lists = HostArena(budget_bytes=96 * KIB, chunk_bytes=16 * KIB, pin=False)
    arrays = HostArena(budget_bytes=96 * KIB, chunk_bytes=16 * KIB, pin=False)
    live: dict[int, list[int]] = {}
    try:
        for is_alloc, ps, n in ops:
            if is_alloc:
                want = lists.alloc(ps, n)
                got = arrays.alloc_array(ps, n)
                assert got is None or got.dtype == np.int64
                assert want == (None if got is None else got.tolist())
                live.setdefault(ps, []).extend(want or [])
            elif live.get(ps):
                rnd.shuffle(live[ps])
                back, live[ps] = live[ps][:n], live[ps][n:]
                lists.free(ps, back)
                arrays.free_array(ps, np.array(back, dtype=np.int64))
            assert lists.used_bytes == arrays.used_bytes
            assert lists.reserved_bytes == arrays.reserved_bytes
    finally:
        lists.close()
        arrays.close()
