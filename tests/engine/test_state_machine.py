"""Random allocate/write/pin/offload/spill/restore/free sequences under pressure vs a dict model,
on the default chain and on one with two media below the CPU.

Invariants after every step: every restored byte equals what was written; no page is lost or
duplicated (each model page is in exactly one state and slots are not shared); budgets are never
exceeded; pinned pages never move.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import PageState, TierEngine
from kvtier.types import Tier
from tests.conftest import PAGE, small_config
from tests.tiers import dict_medium  # noqa: F401 - registers the dict media

SLOTS, CPU_PAGES, DISK_PAGES = 4, 6, 64


class EngineMachine(RuleBasedStateMachine):
    CHAIN = ("gpu", "cpu", "disk")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        cfg = small_config(
            Path(self.dir.name),
            cpu_memory_gb=CPU_PAGES * PAGE / 2**30,
            disk_gb=DISK_PAGES * PAGE / 2**30,
            disk_admission="always",
            policy="lru",
            tier_chain=self.CHAIN,
        )
        self.engine = TierEngine(cfg)
        self.pool = self.engine.attach("t", SLOTS)
        self.model: dict[int, int] = {}  # page id -> fill byte
        self.pinned: dict[int, int] = {}  # page id -> GPU slot while pinned

    def teardown(self) -> None:
        self.engine.close(grace=5)
        self.dir.cleanup()

    @precondition(lambda self: len(self.model) < DISK_PAGES - CPU_PAGES - SLOTS)
    @rule(n=st.integers(1, 3), value=st.integers(0, 255))
    def allocate_and_write(self, n: int, value: int) -> None:
        got = self.engine.allocate(self.pool.pool_id, n)
        if got is None:
            assert n > SLOTS - len(self.pinned)
            return
        for pid, slot in got:
            self.pool.segments[0][slot].fill_(value)
            self.model[pid] = value
        self.engine.release(self.pool.pool_id, [p for p, _ in got])

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def read_back(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.model)))
        page = self.engine.read(self.pool.pool_id, pid)
        assert int(page.min()) == int(page.max()) == self.model[pid]

    @precondition(lambda self: bool(self.model) and len(self.pinned) < SLOTS - 1)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.model)))
        if pid in self.pinned:
            return
        slots = self.engine.acquire(self.pool.pool_id, [pid])
        assert slots is not None
        assert int(self.pool.segments[0][slots[0]][0]) == self.model[pid]
        self.pinned[pid] = slots[0]

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.pinned)))
        self.engine.release(self.pool.pool_id, [pid])
        del self.pinned[pid]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def offload(self, data: st.DataObject) -> None:
        pids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4))
        self.engine.offload(self.pool.pool_id, pids)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        pids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4))
        self.engine.prefetch(self.pool.pool_id, pids)

    @precondition(lambda self: bool(set(self.model) - set(self.pinned)))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(set(self.model) - set(self.pinned))))
        self.engine.free(self.pool.pool_id, [pid])
        del self.model[pid]

    @invariant()
    def accounting(self) -> None:
        stats = self.engine.stats()
        _gpu, cpu, disk = stats.tiers
        assert cpu.used_bytes <= CPU_PAGES * PAGE and disk.used_bytes <= DISK_PAGES * PAGE
        assert all(m.used_bytes <= m.capacity_bytes for m in stats.media)
        assert disk.pages == sum(m.pages for m in stats.media)
        states = [self.engine.page_info(self.pool.pool_id, p) for p in self.model]
        assert all(s.state is not PageState.DROPPED for s in states), "no page may be lost"
        resident = [s for s in states if s.state is PageState.GPU]
        assert len({s.slot for s in resident}) == len(resident), "two pages share a GPU slot"
        for pid, slot in self.pinned.items():
            info = self.engine.page_info(self.pool.pool_id, pid)
            assert info.state is PageState.GPU and info.slot == slot and info.tier is Tier.GPU
            assert int(self.pool.segments[0][slot][0]) == self.model[pid]


EngineMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineMachine = EngineMachine.TestCase


class TwoLevelMachine(EngineMachine):
    """The same, with two media below the CPU: an 8-page dict medium, then the disk store."""

    CHAIN = ("gpu", "cpu", "dicta", "disk")


TwoLevelMachine.TestCase.settings = EngineMachine.TestCase.settings
TestTwoLevelMachine = TwoLevelMachine.TestCase


def test_model_bytes_survive_full_cycle(tmp_path: Path) -> None:
    """Deterministic companion: every page makes a GPU -> CPU -> disk -> GPU round trip."""
    engine = TierEngine(
        small_config(tmp_path, cpu_memory_gb=2 * PAGE / 2**30, disk_admission="always")
    )
    try:
        pool = engine.attach("t", 2)
        model = {}
        for i in range(12):
            ((pid, slot),) = engine.allocate(pool.pool_id, 1)
            pool.segments[0][slot].copy_(torch.full((PAGE,), i, dtype=torch.uint8))
            model[pid] = i
            engine.release(pool.pool_id, [pid])
        assert any(engine.page_info(pool.pool_id, p).tier is Tier.DISK for p in model)
        for pid, value in model.items():
            page = engine.read(pool.pool_id, pid)
            assert int(page.min()) == int(page.max()) == value
    finally:
        engine.close()
