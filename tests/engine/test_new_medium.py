"""Adding a medium is one tier file, one handler file and the registry lines: a dict-backed
medium (``tests/tiers/dict_medium.py``: what a remote page store would start from), named in
the tier chain below the CPU (one or two levels deep),
takes the pages the CPU tier has no room for and gives them back, bytes exact, through the
whole engine (offload, cascade, restore, acquire), on a lane its handlers name."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from kvtier import PageState, Tier
from kvtier.engine import TierEngine
from kvtier.errors import ConfigError
from kvtier.metrics import DaemonMetrics
from kvtier.types import Direction
from tests.conftest import PAGE, small_config
from tests.engine.test_engine import fill, verify
from tests.tiers.dict_medium import OPENED


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


def _allocate(engine, pool, rounds: int) -> list[int]:
    ids = []
    for _ in range(rounds):
        got = engine.allocate(pool.pool_id, 4)
        assert got is not None
        ids += [p for p, _ in got]
        engine.release(pool.pool_id, [p for p, _ in got])
    return ids


def _levels(engine, pool, ids: list[int]) -> dict[int, int]:
    """Page id -> chain level of the pages settled below the CPU."""
    t = engine._core.table
    return {p: int(t.tier[t.row(pool.pool_id, p)]) for p in ids
            if engine.page_info(pool.pool_id, p).state is PageState.DISK}


def _check_one_state_each(engine, pool, ids: list[int]) -> None:
    """Every page in exactly one state, every level within its budget, counts agree, and no
    move down out of a medium is still counted as under way."""
    assert not any(engine._core.leaving.values())
    states = [engine.page_info(pool.pool_id, p).state for p in ids]
    assert PageState.MOVING_UP not in states and PageState.MOVING_DOWN not in states
    s = engine.stats()
    for m in s.media:
        assert m.used_bytes == m.pages * PAGE <= m.capacity_bytes
    below = sum(m.pages for m in s.media)
    assert states.count(PageState.DISK) == below == s.tiers[Tier.DISK].pages
    assert s.tiers[Tier.DISK].used_bytes == sum(m.used_bytes for m in s.media)
    assert states.count(PageState.CPU) == s.tiers[Tier.CPU].pages


@pytest.mark.parametrize("last", ["dictb", "disk"])
def test_a_chain_of_two_media_demotes_through_both_restores_from_each_and_drops_at_its_end(
    make_engine, last
):
    engine = make_engine(
        disk=last == "disk",
        tier_chain=("gpu", "cpu", "dicta", last),
        cpu_memory_gb=8 * PAGE / 2**30,
        disk_gb=8 * PAGE / 2**30 if last == "disk" else 0.0,
        disk_admission="always",
        threshold=1.0,  # no background offload: idle means no page moves
    )
    first = OPENED[-1] if last == "disk" else OPENED[-2]
    s = engine.stats()
    assert [(m.name, m.level, m.tier) for m in s.media] == [
        ("dicta", 2, Tier.DISK), (last, 3, Tier.DISK)]
    pool = engine.attach("t", 4)
    # 24 pages through a 4-slot GPU, an 8-page CPU tier and two 8-page media: nothing dropped.
    ids = _allocate(engine, pool, 6)
    expected = fill(engine, pool, ids, seed=5)
    assert engine.wait_idle(10)
    levels = _levels(engine, pool, ids)
    assert set(levels.values()) == {2, 3}  # pages on both levels below the CPU
    assert len(first.pages) == list(levels.values()).count(2)  # the bytes are in the dict
    moved = engine.stats().counters.moved
    assert moved[Direction((2, 3))].pages >= list(levels.values()).count(3)  # medium -> medium
    _check_one_state_each(engine, pool, ids)
    scraped = generate_latest(DaemonMetrics(engine, "test").registry).decode()
    for m in engine.stats().media:  # per medium on /metrics too
        assert f'kvtier_medium_pages{{medium="{m.name}"}} {float(m.pages)}' in scraped
        assert f'kvtier_medium_used_bytes{{medium="{m.name}"}} {float(m.used_bytes)}' in scraped
    for level, up in ((2, Direction.DISK_TO_CPU), (3, Direction((3, 1)))):
        page = next(p for p, at in levels.items() if at == level and _levels(engine, pool, [p]))
        counted = engine.stats().counters.moved.get(up)
        before = counted.pages if counted else 0
        verify(engine, pool, {page: expected[page]})  # read straight up from that level
        assert engine.stats().counters.moved[up].pages >= 1 + before
    verify(engine, pool, expected)  # every page read back, from whichever level held it
    assert not engine.stats().counters.drops
    # 12 more: 36 pages in 28 slots. The last medium's victims are dropped, nothing above it.
    more = _allocate(engine, pool, 3)
    assert engine.wait_idle(10)
    states = [engine.page_info(pool.pool_id, p).state for p in ids + more]
    # At least the 8 that do not fit (more while room made below is still in flight), all of
    # them victims of the last level.
    dropped = states.count(PageState.DROPPED)
    assert dropped >= 8 and engine.stats().counters.drops == {"disk_full": dropped}
    assert engine.stats().media[1].evictions >= dropped
    alive = [p for p, st in zip(ids + more, states, strict=True) if st is not PageState.DROPPED]
    _check_one_state_each(engine, pool, alive)
    # Room again (a full chain drops at its end to restore a page): the survivors read exact.
    engine.free(pool.pool_id, [p for p in ids + more if p not in expected or p not in alive])
    verify(engine, pool, {p: expected[p] for p in alive if p in expected})


def test_bad_chains_are_config_errors_naming_the_variable(make_engine):
    for chain in (("gpu", "cpu", "dicta", "dicta"), ("cpu", "gpu", "dicta"), ("gpu", "dicta")):
        with pytest.raises(ConfigError, match="KVCACHED_OFFLOAD_TIER_CHAIN"):
            make_engine(disk=False, tier_chain=chain)
    with pytest.raises(ConfigError, match=r"KVCACHED_OFFLOAD_TIER_CHAIN.*'nowhere'"):
        make_engine(disk=False, tier_chain=("gpu", "cpu", "dicta", "nowhere"))


def test_keyed_pages_on_the_disk_below_another_medium_survive_a_restart(tmp_path):
    from tests.prefix.test_flush import loaded, stored

    def engine_on_disk():
        return TierEngine(small_config(
            tmp_path, tier_chain=("gpu", "cpu", "dicta", "disk"),
            cpu_memory_gb=8 * PAGE / 2**30, disk_admission="always", threshold=1.0))

    engine = engine_on_disk()
    keys, data = stored(engine, 24)  # 8 stay in the CPU tier, 8 in the dict, the rest on disk
    assert engine.wait_idle(10)
    assert [m.pages for m in engine.stats().media] == [8, 8]
    engine.close(grace=5)
    again = engine_on_disk()
    try:
        s = again.stats()
        # The dict keeps nothing; the disk keeps its 8 and the CPU's 8, which the shutdown flush
        # wrote straight to it (the first medium whose records survive), past the dict.
        assert [(m.name, m.pages) for m in s.media] == [("dicta", 0), ("disk", 16)]
        found = [i for i, k in enumerate(keys) if again.lookup("t", [k]) == [Tier.DISK]]
        assert found == [*range(8), *range(16, 24)]  # oldest (pushed down) and newest (flushed)
        for i in found:
            assert torch.equal(loaded(again, [keys[i]])[0], data[i])
    finally:
        again.close(grace=5)
