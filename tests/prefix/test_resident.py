"""kvtier/prefix/resident.py: a stored prefix brought up to the CPU tier, waited for only while a
``patience`` says it pays (real engines in CPU mode, a real disk tier, real bytes), through the
borrow that uses it."""

from __future__ import annotations

import math

import torch

from kvtier import Tier
from tests.conftest import PAGE
from tests.prefix.test_borrow import _stored


def _mixed(make_engine):
    """An engine whose 4-page CPU tier holds 4 of 8 stored blocks (the rest on disk), and keys
    ordered two in the CPU tier, then two on disk: (engine, pool, keys, their bytes)."""
    engine = make_engine(cpu_memory_gb=4 * PAGE / 2**30, disk_admission="always")
    pool, keys, want = _stored(engine, "t", 8)
    tiers = engine.lookup("t", keys)
    cpu = [i for i, t in enumerate(tiers) if t is Tier.CPU]
    disk = [i for i, t in enumerate(tiers) if t is Tier.DISK]
    assert len(cpu) >= 2 and len(disk) >= 2
    order = [cpu[0], cpu[1], disk[0], disk[1]]
    return engine, pool, [keys[i] for i in order], [want[i] for i in order]


def test_out_of_patience_lends_the_blocks_already_in_the_cpu_tier(make_engine):
    engine, pool, keys, want = _mixed(make_engine)
    asked: list[int] = []

    def patience(landed: int) -> float:
        asked.append(landed)
        return 0.0  # waiting never pays

    with engine.borrow(pool.pool_id, keys, patience=patience) as held:
        assert len(held) == 2 and held.cut
        assert held.tiers == [Tier.CPU, Tier.CPU]
        assert all(torch.equal(v, d) for v, d in zip(held.views, want, strict=False))
    assert asked == [2]
    # Nothing stays protected or half moved: a borrow that waits gets them all.
    with engine.borrow(pool.pool_id, keys) as held:
        assert len(held) == 4 and not held.cut
        assert all(torch.equal(v, d) for v, d in zip(held.views, want, strict=True))


def test_patience_waits_while_it_lasts(make_engine):
    engine, pool, keys, want = _mixed(make_engine)
    with engine.borrow(pool.pool_id, keys, patience=lambda landed: math.inf) as held:
        assert len(held) == 4 and not held.cut
        assert held.tiers == [Tier.CPU, Tier.CPU, Tier.DISK, Tier.DISK]
        assert all(torch.equal(v, d) for v, d in zip(held.views, want, strict=True))
    # Patience for three landed blocks: it stops at three or more, never fewer.
    engine, pool, keys, want = _mixed(make_engine)
    with engine.borrow(pool.pool_id, keys,
                       patience=lambda landed: math.inf if landed < 3 else 0.0) as held:
        assert len(held) >= 3
        assert all(torch.equal(v, d) for v, d in zip(held.views, want, strict=False))


def test_a_prefix_already_in_the_cpu_tier_never_asks(make_engine):
    engine = make_engine(disk=False)
    pool, keys, _ = _stored(engine, "t", 3)

    def patience(landed: int) -> float:
        raise AssertionError("asked although nothing is below the CPU tier")

    with engine.borrow(pool.pool_id, keys, patience=patience) as held:
        assert len(held) == 3 and not held.cut
