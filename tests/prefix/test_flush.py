"""Closing an engine with a disk tier writes its keyed CPU-tier pages to disk; a new engine on the
same directory finds them with exact bytes. What the disk can't take is counted, never faked."""

from __future__ import annotations

import torch

from kvtier import Tier, TierEngine
from tests.conftest import PAGE, small_config


def stored(engine: TierEngine, n: int, tenant: str = "t") -> tuple[list[bytes], list[torch.Tensor]]:
    """``n`` keyed pages of random bytes stored through a pool; (keys, their bytes)."""
    pool = engine.attach(tenant, n)
    got = engine.allocate(pool.pool_id, n)
    assert got is not None
    slots = [s for _, s in got]
    g = torch.Generator().manual_seed(n)
    data = [torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g) for _ in slots]
    for s, d in zip(slots, data, strict=True):
        pool.segments[0][s].copy_(d)
    keys = [f"{tenant}-{i}".encode() for i in range(n)]
    assert engine.store(pool.pool_id, keys, slots) == n
    return keys, data


def loaded(engine: TierEngine, keys: list[bytes], tenant: str = "t") -> list[torch.Tensor]:
    pool = engine.attach(tenant, len(keys))
    got = engine.allocate(pool.pool_id, len(keys))
    assert got is not None
    slots = [s for _, s in got]
    assert engine.load(pool.pool_id, keys, slots) == len(keys)
    return [pool.segments[0][s].clone() for s in slots]


def test_close_writes_keyed_cpu_pages_to_disk(tmp_path) -> None:
    engine = TierEngine(small_config(tmp_path))
    keys, data = stored(engine, 12)
    assert engine.lookup("t", keys) == [Tier.CPU] * 12
    engine.close(grace=5)
    assert engine.stats().counters.drops.get("shutdown", 0) == 0
    again = TierEngine(small_config(tmp_path))
    try:
        assert again.lookup("t", keys) == [Tier.DISK] * 12
        assert again.lookup("other", keys) == []
        for got, want in zip(loaded(again, keys), data, strict=True):
            assert torch.equal(got, want)
    finally:
        again.close(grace=5)


def test_what_the_disk_cannot_hold_is_counted(tmp_path) -> None:
    engine = TierEngine(small_config(tmp_path, disk_gb=4 * PAGE / 2**30))
    keys, data = stored(engine, 10)
    engine.close(grace=5)
    assert engine.stats().counters.drops["shutdown"] == 6
    again = TierEngine(small_config(tmp_path, disk_gb=4 * PAGE / 2**30))
    try:
        found = again.lookup("t", keys)
        tiers = [again.lookup("t", [k]) for k in keys]
        assert sum(t == [Tier.DISK] for t in tiers) == 4
        assert len(found) <= 4
        for i, key in enumerate(keys):
            if tiers[i]:
                assert torch.equal(loaded(again, [key])[0], data[i])
    finally:
        again.close(grace=5)


def test_without_a_disk_close_has_nothing_to_flush(tmp_path) -> None:
    engine = TierEngine(small_config(None))
    stored(engine, 4)
    engine.close(grace=5)
    assert "shutdown" not in engine.stats().counters.drops


def test_admission_never_writes_nothing_at_close(tmp_path) -> None:
    engine = TierEngine(small_config(tmp_path, disk_admission="never"))
    keys, _ = stored(engine, 4)
    engine.close(grace=5)
    again = TierEngine(small_config(tmp_path, disk_admission="never"))
    try:
        assert again.lookup("t", keys) == []
    finally:
        again.close(grace=5)
