"""Adding a medium is one tier file, one handler file and the registry lines: a dict-backed
medium (what a remote page store would start from), named in the tier chain below the CPU,
takes the pages the CPU tier has no room for and gives them back, bytes exact, through the
whole engine (offload, cascade, restore, acquire), on a lane its handlers name."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch

from kvtier import PageState, Tier
from kvtier.config import OffloadConfig
from kvtier.errors import ConfigError
from kvtier.tiers.base import DiskSlot, TierCounters
from kvtier.tiers.medium import NoRecords
from kvtier.tiers.pinned import HostArena
from kvtier.tiers.registry import register_medium
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.transfer.registry import RouteContext, register_route
from kvtier.types import Direction
from tests.conftest import PAGE
from tests.engine.test_engine import fill, verify


# -- the tier file -----------------------------------------------------------------------------
class DictMedium(NoRecords):
    """Pages as ``bytes`` in a dict, by (page size, slot), within a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.counters = TierCounters()
        self.budget = budget_bytes
        self.pages: dict[tuple[int, int], bytes] = {}
        self._used: dict[int, set[int]] = {}
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.budget

    @property
    def used_bytes(self) -> int:
        return sum(len(s) * size for size, s in self._used.items())

    def alloc(self, page_size: int, n: int) -> list[DiskSlot] | None:
        with self._lock:
            if self.used_bytes + n * page_size > self.budget:
                return None
            used = self._used.setdefault(page_size, set())
            free = (s for s in range(self.budget // page_size) if s not in used)
            out = [next(free) for _ in range(n)]
            used.update(out)
            return [DiskSlot(s) for s in out]

    def free(self, page_size: int, slots: Sequence[int]) -> None:
        with self._lock:
            for s in slots:
                self._used[page_size].remove(int(s))
                self.pages.pop((page_size, int(s)), None)

    def write(
        self, page_size: int, slots: Sequence[int], srcs: Sequence[torch.Tensor]
    ) -> Future[list[bool]]:
        for s, src in zip(slots, srcs, strict=True):
            self.pages[(page_size, int(s))] = src.numpy().tobytes()
        self.counters.bytes_written += len(slots) * page_size
        return _done([True] * len(slots))

    def read(
        self, page_size: int, slots: Sequence[int], dsts: Sequence[torch.Tensor]
    ) -> Future[list[bool]]:
        ok = []
        for s, dst in zip(slots, dsts, strict=True):
            data = self.pages.get((page_size, int(s)))
            if data is not None:
                dst.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            ok.append(data is not None)
        self.counters.bytes_read += sum(ok) * page_size
        return _done(ok)

    def close(self) -> None:
        self.pages.clear()


def _done(results: list[bool]) -> Future[list[bool]]:
    future: Future[list[bool]] = Future()
    future.set_result(results)
    return future


# -- the handler file --------------------------------------------------------------------------
class DictWrite(TransferHandler):
    direction = Direction.CPU_TO_DISK
    lane = "dict"  # its own lane, beside up, down and disk

    def __init__(self, host: HostArena, medium: DictMedium) -> None:
        self._host, self._medium = host, medium

    def run(self, batch: Moves) -> list[bool]:
        rows = self._host.rows(batch.page_size, batch.srcs.tolist())
        return self._medium.write(batch.page_size, batch.dsts.tolist(), rows).result()


class DictRead(DictWrite):
    direction = Direction.DISK_TO_CPU

    def run(self, batch: Moves) -> list[bool]:
        rows = self._host.rows(batch.page_size, batch.dsts.tolist())
        return self._medium.read(batch.page_size, batch.srcs.tolist(), rows).result()


# -- the registry lines ------------------------------------------------------------------------
OPENED: list[DictMedium] = []


def _open(config: OffloadConfig) -> DictMedium:
    OPENED.append(DictMedium(64 * config.page_size))
    return OPENED[-1]


def _medium(ctx: RouteContext) -> DictMedium:
    assert isinstance(ctx.lower, DictMedium)
    return ctx.lower


register_medium("dict", _open)
register_route("cpu", "dict", lambda ctx: DictWrite(ctx.host, _medium(ctx)))
register_route("dict", "cpu", lambda ctx: DictRead(ctx.host, _medium(ctx)))


def test_pages_go_down_to_a_dict_medium_and_come_back_exact(make_engine):
    engine = make_engine(
        disk=False,
        tier_chain=("gpu", "cpu", "dict"),
        cpu_memory_gb=8 * PAGE / 2**30,
        disk_admission="always",
    )
    medium = OPENED[-1]
    assert "dict" in engine._core.scheduler.lanes  # the lane its handlers name
    pool = engine.attach("t", 4)
    ids = []
    for _ in range(6):  # 24 pages through a 4-slot GPU and an 8-page CPU tier
        got = engine.allocate(pool.pool_id, 4)
        assert got is not None
        ids += [p for p, _ in got]
        engine.release(pool.pool_id, [p for p, _ in got])
    expected = fill(engine, pool, ids, seed=3)
    assert engine.wait_idle(10)
    below = [p for p in ids if engine.page_info(pool.pool_id, p).state is PageState.DISK]
    assert below and len(medium.pages) == len(below)  # the bytes are in the dict
    assert engine.stats().tiers[Tier.DISK].used_bytes == len(below) * PAGE
    moved = engine.stats().counters.moved
    assert moved[Direction.CPU_TO_DISK].pages >= len(below)
    verify(engine, pool, expected)  # each page read back through the CPU tier, bytes exact
    moved = engine.stats().counters.moved
    assert moved[Direction.DISK_TO_CPU].pages >= len(below)
    assert medium.counters.bytes_read >= len(below) * PAGE


def test_an_unknown_medium_in_the_chain_is_a_config_error_naming_the_variable(make_engine):
    with pytest.raises(ConfigError, match=r"KVCACHED_OFFLOAD_TIER_CHAIN.*'nowhere'"):
        make_engine(disk=False, tier_chain=("gpu", "cpu", "nowhere"))


def test_a_chain_ending_at_the_cpu_drops_what_the_cpu_cannot_hold(make_engine):
    engine = make_engine(tier_chain=("gpu", "cpu"), cpu_memory_gb=8 * PAGE / 2**30,
                         disk_admission="always")  # a disk budget, but not in the chain
    assert not engine._core.media
    pool = engine.attach("t", 4)
    for _ in range(6):
        got = engine.allocate(pool.pool_id, 4)
        assert got is not None
        engine.release(pool.pool_id, [p for p, _ in got])
    assert engine.wait_idle(10)
    assert engine.stats().counters.drops.get("cpu_full", 0) > 0
