"""Keyed pages read back from the disk keep their disk copy (``Placement``'s copies), on real
engines in CPU mode with a real disk tier: a second engine on the directory (what a restart
after a crash sees) finds them, going back down costs no write and no second slot, and a disk
full of copies still takes new pages."""

from __future__ import annotations

import shutil
import time

import torch

from kvtier import Tier, TierEngine
from kvtier.types import Direction
from tests.conftest import PAGE, small_config
from tests.prefix.test_flush import loaded, stored


def config(tmp_path, **overrides):
    return small_config(tmp_path, disk_admission="always", **overrides)


def settle(engine: TierEngine, tenant: str, keys: list[bytes], tier: Tier) -> None:
    deadline = time.monotonic() + 10
    while engine.lookup(tenant, keys) != [tier] * len(keys):
        assert time.monotonic() < deadline, engine.lookup(tenant, keys)
        time.sleep(0.01)


def quiet(engine: TierEngine) -> None:
    deadline = time.monotonic() + 10
    while (s := engine.stats()).inflight_bytes or s.queued_offloads or s.queued_restores:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def disk_pages(engine: TierEngine) -> int:
    used = next(s for s in engine.stats().tiers if s.tier == Tier.DISK).used_bytes
    return used // PAGE


def written(engine: TierEngine) -> int:
    return engine.stats().counters.moved[Direction.CPU_TO_DISK].pages


def read_back(engine: TierEngine) -> tuple[list[bytes], list[torch.Tensor]]:
    """16 keys stored, pushed to disk by 100 others, then loaded (up into the CPU tier)."""
    hot, data = stored(engine, 16, "hot")
    stored(engine, 100, "fill")
    settle(engine, "hot", hot, Tier.DISK)
    for got, want in zip(loaded(engine, hot, "hot"), data, strict=True):
        assert torch.equal(got, want)
    assert engine.lookup("hot", hot) == [Tier.CPU] * 16
    quiet(engine)
    return hot, data


def test_a_key_read_back_is_still_found_by_the_next_engine(tmp_path) -> None:
    """Before, the read freed its disk slot and record: a crash lost exactly the keys just
    read (0 of 32 came back after a kill -9). The engine is left open here, as a crash would
    leave it (no shutdown flush); the next one reads the directory's index and journal."""
    engine = TierEngine(config(tmp_path))
    hot, data = read_back(engine)
    time.sleep(0.3)  # the journal's sync (every 50 ms)
    snapshot = tmp_path / "snapshot"  # the directory as a kill -9 now would leave it
    shutil.copytree(tmp_path / "disk", snapshot)
    engine.close(grace=5)
    after = TierEngine(config(tmp_path, disk_path=str(snapshot)))
    try:
        assert after.lookup("hot", hot) == [Tier.DISK] * 16
        for got, want in zip(loaded(after, hot, "hot"), data, strict=True):
            assert torch.equal(got, want)
    finally:
        after.close(grace=5)


def test_going_back_down_costs_no_write_and_no_second_slot(tmp_path) -> None:
    engine = TierEngine(config(tmp_path))
    try:
        hot, data = read_back(engine)
        fill = [f"fill-{i}".encode() for i in range(100)]
        before, pages, fill_before = written(engine), disk_pages(engine), on_disk(
            engine, "fill", fill)
        more = stored(engine, 60, "more")[0]  # the CPU tier's victims: hot among them
        settle(engine, "hot", hot, Tier.DISK)
        quiet(engine)
        others = on_disk(engine, "more", more) + on_disk(engine, "fill", fill) - fill_before
        assert written(engine) - before == others  # hot went down without a write
        assert disk_pages(engine) == pages + others  # onto the slots it had kept
        for got, want in zip(loaded(engine, hot, "hot"), data, strict=True):
            assert torch.equal(got, want)
    finally:
        engine.close(grace=5)


def on_disk(engine: TierEngine, tenant: str, keys: list[bytes]) -> int:
    return sum(engine.lookup(tenant, [k]) == [Tier.DISK] for k in keys)


def test_a_full_disk_takes_its_room_from_copies_first(tmp_path) -> None:
    """Copies hold disk slots no policy sees: a disk full of them must still make room, and
    from them first (losing one costs only a crash's durability; a disk page's loss is a miss)."""
    engine = TierEngine(config(tmp_path))
    core = engine._core
    try:
        read_back(engine)
        level = core.record_level
        assert level is not None
        disk = core.media[level]
        with core.cond:
            assert len(core.copies[PAGE]) == 16
            filler = []
            while (one := disk.alloc(PAGE, 1)) is not None:  # the disk full
                filler += one
            drops = sum(engine.stats().counters.drops.values())
            got = core.cascade.slots(level, PAGE, 8, None)
            assert len(got) == 8 and len(core.copies[PAGE]) == 8  # the 8 oldest gave way
            assert sum(engine.stats().counters.drops.values()) == drops  # no disk page lost
            disk.free(PAGE, [*filler, *got.tolist()])
    finally:
        engine.close(grace=5)


def test_a_clean_close_leaves_one_slot_per_key(tmp_path) -> None:
    engine = TierEngine(config(tmp_path))
    hot, data = read_back(engine)
    engine.close(grace=5)  # the flush: hot settles on its copies
    again = TierEngine(config(tmp_path))
    try:
        keys = hot + [f"fill-{i}".encode() for i in range(100)]
        on_disk = sum(len(again.lookup(t, [k])) for t, k in
                      [("hot", k) for k in hot] + [("fill", k) for k in keys[16:]])
        assert disk_pages(again) == on_disk == 116
        for got, want in zip(loaded(again, hot, "hot"), data, strict=True):
            assert torch.equal(got, want)
    finally:
        again.close(grace=5)
