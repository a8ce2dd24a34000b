"""HostArena: budget, best-fit contiguous runs, chunk release, pooled buffers."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import InvalidArgument
from kvtier.tiers.base import HostSlot
from kvtier.tiers.pinned import HostArena

KIB = 1024
P = 4 * KIB


@pytest.fixture
def arena():
    a = HostArena(budget_bytes=64 * KIB, chunk_bytes=16 * KIB, pin=False)
    yield a
    a.close()


def test_chunks_are_lazy_exact_and_aligned(arena: HostArena) -> None:
    assert arena.reserved_bytes == 0
    got = arena.alloc(P, 3)
    assert got == [0, 1, 2]
    assert arena.reserved_bytes == 16 * KIB  # one exact chunk, not a power-of-two round-up
    assert arena.used_bytes == 3 * P
    assert arena.capacity_bytes == 64 * KIB
    for row in arena.rows(P, got):
        assert row.data_ptr() % mmap.PAGESIZE == 0 and row.numel() == P


def test_all_or_nothing_and_budget(arena: HostArena) -> None:
    assert arena.alloc(P, 17) is None  # 16 pages fit the budget
    assert arena.reserved_bytes == 0
    got = arena.alloc(P, 16)
    assert got is not None and sorted(got) == list(range(16))
    assert arena.alloc(P, 1) is None
    assert arena.reserved_bytes == 64 * KIB


def test_best_fit_prefers_smallest_run(arena: HostArena) -> None:
    got = arena.alloc(P, 8)  # chunks 0 and 1 full
    assert got == list(range(8))
    arena.free(P, [HostSlot(1)])  # hole of 1 in chunk 0
    arena.free(P, [HostSlot(4), HostSlot(5), HostSlot(6)])  # hole of 3 in chunk 1
    assert arena.alloc(P, 2) == [4, 5]  # fits the 3-hole, not a new chunk
    assert arena.alloc(P, 1) == [1]  # best fit: the 1-hole, not slot 6
    assert arena.reserved_bytes == 32 * KIB


def test_runs_group_contiguous_slots(arena: HostArena) -> None:
    got = arena.alloc(P, 8)
    assert got is not None
    for s, row in zip(got, arena.rows(P, got), strict=True):
        row.fill_(int(s))
    order = [HostSlot(x) for x in (2, 3, 4, 7, 0, 1)]
    runs = arena.runs(P, order)
    assert [list(pos) for _, pos in runs] == [[0, 1], [2], [3], [4, 5]]  # 3|4 is a chunk boundary
    for view, pos in runs:
        assert view.shape == (len(pos), P)
        for j, p in enumerate(pos):
            assert torch.all(view[j] == int(order[p]))


def test_run_addresses_are_the_runs_first_bytes(arena: HostArena) -> None:
    got = arena.alloc(P, 8)
    assert got is not None
    for order in ([2, 3, 4, 7, 0, 1], [0, 1, 2], [4, 5, 6, 7], [5], [1, 0], [0, 2, 1, 3]):
        slots = np.array([int(got[i]) for i in order], dtype=np.int64)
        views = arena.runs_array(P, slots)
        addresses = arena.run_addresses(P, slots)
        assert [(v.data_ptr(), lo, hi) for v, lo, hi in views] == addresses, order
    assert arena.run_addresses(P, np.empty(0, dtype=np.int64)) == []


def test_one_run_is_one_view_and_frees_in_one_piece(arena: HostArena) -> None:
    got = arena.alloc(P, 3)
    assert got is not None and got == [got[0], got[0] + 1, got[0] + 2]
    ((view, pos),) = arena.runs(P, got)
    assert view.shape == (3, P) and list(pos) == [0, 1, 2]
    assert [list(pos) for _, pos in arena.runs(P, got[::-1])] == [[0], [1], [2]]
    arena.free(P, got[::-1])
    assert arena.alloc(P, 3) == got
    with pytest.raises(AssertionError):
        arena.free(P, [got[0], got[0]])


def test_multi_chunk_request_and_oversized_pages() -> None:
    with HostArena(budget_bytes=100 * KIB, chunk_bytes=16 * KIB, pin=False) as arena:
        got = arena.alloc(P, 10)  # spans 3 chunks: 4 + 4 + 2
        assert got == list(range(10))
        assert [len(p) for _, p in arena.runs(P, got)] == [4, 4, 2]
        big = arena.alloc(40 * KIB, 1)  # larger than a chunk: a chunk of exactly one page
        assert big == [0]
        assert arena.reserved_bytes == 48 * KIB + 40 * KIB
        assert arena.alloc(40 * KIB, 1) is None


def test_empty_chunks_stay_pinned_until_another_size_needs_the_budget(arena: HostArena) -> None:
    a = arena.alloc(P, 16)
    assert a is not None
    assert arena.alloc(8 * KIB, 1) is None  # budget all used by 4 KiB slots
    arena.free(P, a)
    assert arena.used_bytes == 0
    assert arena.reserved_bytes == 64 * KIB  # empty chunks stay mapped: no re-pinning churn
    b = arena.alloc(8 * KIB, 8)  # needs the whole budget: the spare is reclaimed
    assert b is not None and arena.reserved_bytes == 64 * KIB
    assert arena.alloc(P, 1) is None


def test_pooled_buffers_share_the_budget(arena: HostArena) -> None:
    buf = arena.get_buffer(40 * KIB)
    assert buf is not None and buf.numel() == 40 * KIB and buf.data_ptr() % mmap.PAGESIZE == 0
    assert arena.used_bytes == 40 * KIB
    assert arena.alloc(P, 7) is None  # 24 KiB left: one 16 KiB chunk + nothing
    assert arena.get_buffer(32 * KIB) is None
    ptr = buf.data_ptr()
    arena.put_buffer(buf)
    assert arena.used_bytes == 0 and arena.reserved_bytes == 40 * KIB
    again = arena.get_buffer(40 * KIB)
    assert again is not None and again.data_ptr() == ptr  # reused, not remapped
    arena.put_buffer(again)
    assert arena.alloc(P, 16) is not None  # the idle buffer is released for slots
    assert arena.reserved_bytes == 64 * KIB


def test_rejects_bad_arguments(arena: HostArena) -> None:
    with pytest.raises(InvalidArgument):
        arena.alloc(0, 1)
    with pytest.raises(InvalidArgument):
        arena.alloc(P, -1)
    with pytest.raises(InvalidArgument):
        HostArena(budget_bytes=-1, chunk_bytes=P)
    with pytest.raises(InvalidArgument):
        arena.get_buffer(0)
    assert arena.alloc(P, 0) == []


def test_double_free_is_an_internal_error(arena: HostArena) -> None:
    got = arena.alloc(P, 2)
    assert got is not None
    arena.free(P, got[:1])
    with pytest.raises(AssertionError):
        arena.free(P, got[:1])


PAGE_SIZES = (4 * KIB, 8 * KIB, 12 * KIB, 24 * KIB)
BUDGET = 96 * KIB
CHUNK = 16 * KIB


class ArenaMachine(RuleBasedStateMachine):
    """Model: a dict (page_size, slot) -> tag byte, and the live pooled buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.arena = HostArena(budget_bytes=BUDGET, chunk_bytes=CHUNK, pin=False)
        self.model: dict[tuple[int, HostSlot], int] = {}
        self.bufs: list[torch.Tensor] = []
        self.tag = 0

    @rule(ps=st.sampled_from(PAGE_SIZES), n=st.integers(0, 9))
    def alloc(self, ps: int, n: int) -> None:
        before = self.arena.reserved_bytes
        got = self.arena.alloc(ps, n)
        if got is None:
            assert self.arena.reserved_bytes <= before  # a refusal maps nothing new
            per = max(1, CHUNK // ps)
            need = -(-n // per) * per * ps
            assert self.worst_case_reserved() + need > BUDGET  # a refusal must be justified
            return
        assert len(got) == n == len(set(got))
        rows = self.arena.rows(ps, got)
        for s, row in zip(got, rows, strict=True):
            assert (ps, s) not in self.model
            self.tag = (self.tag + 1) % 251
            row.fill_(self.tag)
            self.model[(ps, s)] = self.tag
        runs = self.arena.runs(ps, got)
        assert sorted(p for _, pos in runs for p in pos) == list(range(n))
        for view, pos in runs:
            assert view.data_ptr() == rows[pos[0]].data_ptr()  # one contiguous run
        if n and n * ps <= 16 * KIB and before + CHUNK <= BUDGET:
            assert len(runs) == 1  # fits a fresh chunk within budget: always one run

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        for ps in {k[0] for k in keys}:
            self.arena.free(ps, [s for p, s in keys if p == ps])
        for k in keys:
            del self.model[k]

    @rule(n=st.sampled_from((5 * KIB, 20 * KIB)))
    def get_buffer(self, n: int) -> None:
        buf = self.arena.get_buffer(n)
        if buf is not None:
            assert buf.numel() == n
            self.bufs.append(buf)

    @precondition(lambda self: self.bufs)
    @rule()
    def put_buffer(self) -> None:
        self.arena.put_buffer(self.bufs.pop())

    def used_model(self) -> int:
        return sum(ps for ps, _ in self.model) + sum(b.numel() for b in self.bufs)

    def worst_case_reserved(self) -> int:
        """Bytes that can't be reclaimed: each used slot's chunk, each busy buffer."""
        chunks = {(ps, s // max(1, CHUNK // ps)) for ps, s in self.model}
        slot_bytes = sum(max(1, CHUNK // ps) * ps for ps, _ in chunks)
        return slot_bytes + sum(-(-b.numel() // mmap.PAGESIZE) * mmap.PAGESIZE for b in self.bufs)

    @invariant()
    def within_budget_and_bytes_intact(self) -> None:
        assert self.arena.reserved_bytes <= BUDGET
        assert self.arena.used_bytes == self.used_model()
        assert self.arena.used_bytes <= self.arena.reserved_bytes
        for (ps, s), tag in self.model.items():
            row = self.arena.rows(ps, [s])[0]
            assert int(row[0]) == tag and int(row[-1]) == tag  # no two slots overlap

    def teardown(self) -> None:
        self.arena.close()


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunks_are_registered_and_dma_round_trips() -> None:
    with HostArena(budget_bytes=1 << 22, chunk_bytes=1 << 20, pin=True) as arena:
        got = arena.alloc(64 * KIB, 4)
        assert got is not None and arena.is_pinned(64 * KIB, got[0])
        (view, pos), *rest = arena.runs(64 * KIB, got)
        assert not rest and list(pos) == [0, 1, 2, 3] and view.is_pinned()
        view.copy_(torch.arange(view.numel(), dtype=torch.int64).remainder(251).view_as(view))
        dev = view.to("cuda", non_blocking=True)
        back = arena.alloc(64 * KIB, 4)
        assert back is not None
        (dst, _), *_ = arena.runs(64 * KIB, back)
        dst.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dst, view)
        buf = arena.get_buffer(3 * KIB)
        assert buf is not None and buf.is_pinned()
        arena.put_buffer(buf)
