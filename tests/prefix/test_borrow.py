"""kvtier/prefix/borrow.py: a stored prefix lent in place (real engines in CPU mode, real bytes,
a real disk tier)."""

from __future__ import annotations

import pytest
import torch

from kvtier import Tier
from kvtier.errors import InvalidArgument, NotFound
from tests.conftest import PAGE


def _stored(engine, tenant: str, n: int, *, first: int = 1):
    """A pool of ``tenant`` and ``n`` keyed blocks stored from it: (pool, keys, bytes)."""
    pool = engine.attach(tenant, n)
    slots = [s for _, s in engine.allocate(pool.pool_id, n)]
    gen = torch.Generator().manual_seed(first)
    want = []
    for s in slots:
        pool.segments[0][s] = torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=gen)
        want.append(pool.segments[0][s].clone())
    keys = [f"{tenant}-k{i}".encode() for i in range(n)]
    assert engine.store(pool.pool_id, keys, slots) == n
    return pool, keys, want


def test_borrow_lends_the_stored_bytes_of_the_longest_prefix(make_engine):
    engine = make_engine(disk=False)
    pool, keys, want = _stored(engine, "t", 5)
    with engine.borrow(pool.pool_id, [*keys[:3], b"missing", keys[4]]) as held:
        assert len(held) == 3
        assert held.tiers == [Tier.CPU] * 3
        for view, data in zip(held.views, want, strict=False):
            assert torch.equal(view, data)
    assert engine.lookup("t", keys) == [Tier.CPU] * 5  # nothing moved or dropped


def test_borrowed_pages_stay_put_until_released(make_engine, tmp_path):
    # A 6-page CPU tier over a disk: storing 12 more blocks demotes whatever is not protected.
    engine = make_engine(cpu_memory_gb=6 * PAGE / 2**30, disk_admission="always")
    pool, keys, want = _stored(engine, "t", 3)
    held = engine.borrow(pool.pool_id, keys)
    addresses = [v.data_ptr() for v in held.views]
    _stored(engine, "u", 12, first=2)
    assert engine.lookup("t", keys) == [Tier.CPU] * 3  # protected: not demoted
    for view, data, addr in zip(held.views, want, addresses, strict=True):
        assert view.data_ptr() == addr and torch.equal(view, data)
    held.release()
    held.release()  # idempotent
    _stored(engine, "v", 12, first=3)
    assert Tier.DISK in engine.lookup("t", keys)  # released: demoted like any page


def test_borrow_brings_disk_blocks_up_checked(make_engine):
    engine = make_engine(cpu_memory_gb=4 * PAGE / 2**30, disk_admission="always")
    pool, keys, want = _stored(engine, "t", 8)  # twice what the CPU tier holds
    before = engine.lookup("t", keys)
    assert Tier.DISK in before
    with engine.borrow(pool.pool_id, keys[:2]) as held:
        assert held.tiers == before[:2]
        assert [bool(torch.equal(v, d)) for v, d in zip(held.views, want, strict=False)] == [
            True, True]
        assert engine.lookup("t", keys[:2]) == [Tier.CPU, Tier.CPU]


def test_only_blocks_below_the_cpu_tier_count_against_half_of_it(make_engine):
    engine = make_engine(cpu_memory_gb=4 * PAGE / 2**30, disk_admission="always")
    pool, keys, want = _stored(engine, "t", 8)
    tiers = engine.lookup("t", keys)
    with engine.borrow(pool.pool_id, keys) as held:
        # Up to (not past) the third block below the CPU: half the 4-page tier brought up.
        below = [i for i, t in enumerate(tiers) if t is not Tier.CPU]
        assert len(held) == below[2]
        assert all(torch.equal(v, d) for v, d in zip(held.views, want, strict=False))
    roomy = make_engine(disk=False, cpu_memory_gb=6 * PAGE / 2**30)
    pool, keys, want = _stored(roomy, "t", 5)
    with roomy.borrow(pool.pool_id, keys) as held:
        assert len(held) == 5  # all in the CPU tier already: more than half of it, lent
        assert all(torch.equal(v, d) for v, d in zip(held.views, want, strict=True))


def test_borrow_never_lends_another_tenants_blocks(make_engine):
    engine = make_engine(disk=False)
    _, keys, _ = _stored(engine, "a", 3)
    other = engine.attach("b", 1)
    with engine.borrow(other.pool_id, keys) as held:
        assert len(held) == 0 and held.views == []


def test_borrow_checks_its_arguments_and_changes_nothing(make_engine):
    engine = make_engine(disk=False)
    pool, keys, _ = _stored(engine, "t", 2)
    with pytest.raises(NotFound):
        engine.borrow(9999, keys)
    with pytest.raises(InvalidArgument) as bad:
        engine.borrow(pool.pool_id, [b""])
    assert bad.value.field == "keys"
    with pytest.raises(InvalidArgument):
        engine.borrow(pool.pool_id, ["not bytes"])  # type: ignore[list-item]
    assert engine.lookup("t", keys) == [Tier.CPU] * 2


def test_the_plan_sees_the_tiers_and_keeps_its_cut(make_engine):
    engine = make_engine(cpu_memory_gb=4 * PAGE / 2**30, disk_admission="always")
    pool, keys, want = _stored(engine, "t", 8)
    told: list[list[Tier]] = []

    def plan(tiers: list[Tier]) -> int:
        told.append(list(tiers))
        return 1

    with engine.borrow(pool.pool_id, keys[:3], plan) as held:
        assert len(held) == 1 and torch.equal(held.views[0], want[0])
    assert len(told) == 1 and len(told[0]) == 2  # the window: half the 4-page CPU tier
    assert set(told[0]) <= {Tier.CPU, Tier.DISK}
    with engine.borrow(pool.pool_id, keys[:3], lambda tiers: -5) as none:
        assert len(none) == 0
