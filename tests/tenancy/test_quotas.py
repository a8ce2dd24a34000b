"""Per-tenant quotas in the engine: caps, own-pages-first eviction, the byte ledger, the views.

Small real engines in CPU mode (host shared memory as the GPU tier), real bytes: a key that
survives must load back exactly the bytes stored.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier import Tier
from kvtier.errors import CapacityError
from tests.conftest import PAGE

CPU_PAGES = 64


def pages(n: int) -> str:
    return f"{n * PAGE}B"


def store(engine, pool, keys: list[bytes], value: int) -> int:
    """Store ``keys`` (bytes: ``value`` + position) through ``pool``, a pool-full at a time."""
    stored = 0
    for lo in range(0, len(keys), pool.num_slots):
        part = keys[lo : lo + pool.num_slots]
        got = engine.allocate(pool.pool_id, len(part))
        assert got is not None
        for i, (_, slot) in enumerate(got):
            pool.segments[0][slot].fill_((value + lo + i) % 251)
        stored += engine.store(pool.pool_id, part, [s for _, s in got])
        engine.free(pool.pool_id, [p for p, _ in got])
    return stored


def loads_exactly(engine, pool, keys: list[bytes], value: int) -> bool:
    """Every key is found and loads back exactly the bytes ``store`` wrote."""
    for lo in range(0, len(keys), pool.num_slots):
        part = keys[lo : lo + pool.num_slots]
        got = engine.allocate(pool.pool_id, len(part))
        assert got is not None
        slots = [s for _, s in got]
        try:
            if engine.load(pool.pool_id, part, slots) != len(part):
                return False
            for i, s in enumerate(slots):
                row = pool.segments[0][s]
                if not bool((row == (value + lo + i) % 251).all()):
                    return False
        finally:
            engine.free(pool.pool_id, [p for p, _ in got])
    return True


def ledger_matches_table(engine) -> None:
    """Settled bytes per tenant and tier equal what the page table says (after wait_idle)."""
    core = engine._core
    t, ledger = core.table, core.ledger
    assert engine.wait_idle(30)
    with core.cond:
        live = t.live_rows()
        for tier in (Tier.CPU, Tier.DISK, Tier.GPU):
            rows = live[t.at(live, tier)]
            want = np.bincount(t.owner[rows], weights=t.size[rows],
                               minlength=ledger.limit.shape[1])  # spare columns are 0
            assert ledger.settled[tier].tolist() == want.astype(np.int64).tolist(), tier
            assert not ledger.incoming[tier].any(), tier


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def test_flooding_tenant_evicts_only_its_own_keys(make_engine):
    engine = make_engine(
        disk=False, tenant_quotas=f"a=cpu:{pages(24)};b=cpu:{pages(24)}"
    )
    pa, pb = engine.attach("a", 8), engine.attach("b", 8)
    mine = keys("b", 20)
    assert store(engine, pb, mine, 3) == 20
    flood = keys("a", 400)  # ~6x the whole CPU tier
    store(engine, pa, flood, 5)
    assert engine.lookup("b", mine) == [Tier.CPU] * 20
    assert loads_exactly(engine, pb, mine, 3)
    core = engine._core
    a = core.ledger.find("a")
    assert core.ledger.used(Tier.CPU)[a] <= 24 * PAGE  # capped at its quota
    assert engine.lookup("a", flood[-8:]) == [Tier.CPU] * 8  # its newest keys stayed
    assert loads_exactly(engine, pa, flood[-8:], 5 + 392)
    ledger_matches_table(engine)


def test_without_quotas_the_flood_evicts_the_neighbour(make_engine):
    """The behaviour the quotas exist to prevent (so the test above can fail)."""
    engine = make_engine(disk=False)
    pa, pb = engine.attach("a", 8), engine.attach("b", 8)
    mine = keys("b", 20)
    assert store(engine, pb, mine, 3) == 20
    store(engine, pa, keys("a", 400), 5)
    assert engine.lookup("b", mine) == []


def test_offloaded_pool_pages_of_a_tenant_within_quota_survive(make_engine):
    """The flood here is GPU pages offloaded under pool pressure, not stored keys."""
    engine = make_engine(disk=False, tenant_quotas=f"*=cpu:{pages(16)}")
    pa, pb = engine.attach("a", 8), engine.attach("b", 8)
    got = engine.allocate(pb.pool_id, 8)
    ids = [p for p, _ in got]
    for i, (_, s) in enumerate(got):
        pb.segments[0][s].fill_(i + 1)
    engine.release(pb.pool_id, ids)
    assert engine.offload(pb.pool_id, ids) == 8
    assert engine.wait_idle(30)
    for _ in range(40):  # 320 pages through a's 8 slots: its old pages are pushed off the GPU
        more = engine.allocate(pa.pool_id, 8)
        if more is not None:
            engine.release(pa.pool_id, [p for p, _ in more])
    assert engine.wait_idle(30)
    assert {engine.page_info(pb.pool_id, p).tier for p in ids} == {Tier.CPU}
    for i, p in enumerate(ids):
        assert int(engine.read(pb.pool_id, p).min()) == i + 1
    a = engine._core.ledger.find("a")
    assert engine._core.ledger.used(Tier.CPU)[a] <= 16 * PAGE
    ledger_matches_table(engine)


def test_disk_quota_caps_the_flood_and_spares_the_neighbour(make_engine):
    engine = make_engine(
        cpu_memory_gb=8 * PAGE / 2**30,
        disk_admission="always",
        tenant_quotas=f"a=cpu:{pages(4)},disk:{pages(16)};b=cpu:{pages(4)},disk:{pages(32)}",
    )
    pa, pb = engine.attach("a", 4), engine.attach("b", 4)
    mine = keys("b", 24)  # more than b's CPU share: most of them go to disk
    assert store(engine, pb, mine, 7) == 24
    assert engine.wait_idle(30)
    store(engine, pa, keys("a", 200), 9)
    assert engine.wait_idle(30)
    assert set(engine.lookup("b", mine)) <= {Tier.CPU, Tier.DISK}
    assert len(engine.lookup("b", mine)) == 24
    assert loads_exactly(engine, pb, mine, 7)
    ledger = engine._core.ledger
    a = ledger.find("a")
    assert ledger.used(Tier.DISK)[a] <= 16 * PAGE and ledger.used(Tier.CPU)[a] <= 4 * PAGE
    assert engine.stats("a").counters.drops.get("tenant_quota", 0) > 0
    assert engine.stats("b").counters.drops == {}
    ledger_matches_table(engine)


def test_gpu_quota_at_attach_names_the_tenants_own_quota(make_engine):
    engine = make_engine(disk=False, tenant_quotas=f"a=gpu:{pages(8)}")
    engine.attach("a", 8)
    with pytest.raises(CapacityError) as err:
        engine.attach("a", 1)
    text = str(err.value)
    assert "'a'" in text and f"{8 * PAGE} B" in text and "free" not in text
    assert len(engine.pools("a")) == 1  # nothing changed
    engine.attach("b", 8)  # another tenant is not charged for a's pools
    names = len(engine._core.ledger.names)
    for i in range(20):  # refused attaches under made-up names leave no trace in the ledger
        with pytest.raises(CapacityError):
            engine.attach(f"made-up-{i}", 10_000)
    assert len(engine._core.ledger.names) == names


def test_a_tenant_holds_at_most_max_pools_per_tenant_pools(make_engine):
    """Quotas bound a tenant's bytes, not its pools: a thousand one-page pools cost the daemon
    a session connection and bookkeeping each. Attach and Register stop at
    ``max_pools_per_tenant``, naming the variable; other tenants are not counted."""
    engine = make_engine(disk=False, max_pools_per_tenant=3)
    held = [engine.attach("a", 1) for _ in range(2)]
    held.append(engine.register("a", [torch.zeros((4, 4096), dtype=torch.uint8)]))
    for make in (lambda: engine.attach("a", 1),
                 lambda: engine.register("a", [torch.zeros((4, 4096), dtype=torch.uint8)])):
        with pytest.raises(CapacityError) as err:
            make()
        assert "KVCACHED_OFFLOAD_MAX_POOLS_PER_TENANT=3" in str(err.value)
    assert len(engine.pools("a")) == 3  # nothing changed
    engine.attach("b", 1)  # another tenant's pools are its own count
    engine.detach(held[0].pool_id)
    engine.attach("a", 1)


def test_gpu_budget_message_reveals_no_free_bytes(make_engine):
    engine = make_engine(disk=False)  # 1 MiB budget: 256 pages of 4 KiB
    engine.attach("other", 200)
    with pytest.raises(CapacityError) as err:
        engine.attach("me", 100)
    assert "free" not in str(err.value) and str(56 * PAGE) not in str(err.value)


def test_gpu_quota_applies_to_registered_pools(make_engine):
    engine = make_engine(disk=False, tenant_quotas=f"a=gpu:{pages(4)}")
    with pytest.raises(CapacityError):
        engine.register("a", [torch.zeros(8, PAGE, dtype=torch.uint8)])
    assert engine.pools("a") == []
    engine.register("a", [torch.zeros(4, PAGE, dtype=torch.uint8)])


def test_tenant_stats_view_is_the_tenants_own(make_engine):
    engine = make_engine(disk=False, tenant_quotas=f"a=cpu:{pages(16)}")
    pa, pb = engine.attach("a", 8), engine.attach("b", 4)
    assert store(engine, pa, keys("a", 6), 1) == 6
    got = engine.allocate(pb.pool_id, 3)
    assert engine.lookup("b", [b"nothing"]) == []
    a, b = engine.stats("a"), engine.stats("b")
    assert (a.pools, a.tenants, a.keyed_pages, a.pinned_pages) == (1, 1, 6, 0)
    assert (b.pools, b.keyed_pages, b.pinned_pages) == (1, 0, 3)
    cpu_a = next(t for t in a.tiers if t.tier is Tier.CPU)
    assert (cpu_a.used_bytes, cpu_a.capacity_bytes, cpu_a.pages) == (6 * PAGE, 16 * PAGE, 6)
    gpu_b = next(t for t in b.tiers if t.tier is Tier.GPU)
    assert (gpu_b.used_bytes, gpu_b.capacity_bytes, gpu_b.pages) == (3 * PAGE, 4 * PAGE, 3)
    assert b.counters.misses == 1 and a.counters.misses == 0
    assert sum(m.pages for m in a.counters.moved.values()) == 6
    assert sum(m.pages for m in b.counters.moved.values()) == 0
    assert engine.stats("nobody").pools == 0 and engine.stats("nobody").tenants == 0
    whole = engine.stats()
    assert (whole.pools, whole.tenants, whole.keyed_pages) == (2, 2, 6)
    engine.free(pb.pool_id, [p for p, _ in got])
    ledger_matches_table(engine)


def test_restores_through_a_small_cpu_quota_complete(make_engine):
    """Pages pass through the CPU tier on their way up: a CPU quota smaller than what is
    restored at once must slow a restore down, never stall it."""
    engine = make_engine(
        cpu_memory_gb=16 * PAGE / 2**30,
        disk_admission="always",
        tenant_quotas=f"a=cpu:{pages(2)},disk:{pages(64)}",
    )
    pool = engine.attach("a", 8)
    ids = []
    for _ in range(4):  # 32 pages through 8 slots: most end on disk
        got = engine.allocate(pool.pool_id, 8)
        ids += [p for p, _ in got]
        for p, s in got:
            pool.segments[0][s].fill_(p % 251)
        engine.release(pool.pool_id, [p for p, _ in got])
    assert engine.wait_idle(30)
    on_disk = [p for p in ids if engine.page_info(pool.pool_id, p).tier is Tier.DISK][:8]
    assert len(on_disk) == 8
    slots = engine.acquire(pool.pool_id, on_disk, timeout=20)
    assert slots is not None
    for p, s in zip(on_disk, slots, strict=True):
        assert int(pool.segments[0][s].min()) == int(pool.segments[0][s].max()) == p % 251
    engine.release(pool.pool_id, on_disk)
    ledger_matches_table(engine)


def test_loading_a_prefix_longer_than_the_cpu_quota(make_engine):
    engine = make_engine(
        cpu_memory_gb=32 * PAGE / 2**30,
        disk_admission="always",
        tenant_quotas=f"a=cpu:{pages(3)},disk:{pages(64)}",
    )
    pool = engine.attach("a", 8)
    mine = keys("a", 8)
    assert store(engine, pool, mine, 11) == 8
    assert engine.wait_idle(30)
    assert set(engine.lookup("a", mine)) <= {Tier.CPU, Tier.DISK}
    assert loads_exactly(engine, pool, mine, 11)
    ledger_matches_table(engine)


def test_a_load_that_can_get_no_cpu_room_is_a_miss_not_a_wait(make_engine):
    """A tenant whose CPU quota is the whole CPU tier keeps every page there (within its
    quota, no other tenant displaces them): another tenant's blocks on disk can get no CPU slot,
    and its load used to wait for one until its deadline (DeadlineExceeded). Now it is the part
    already in the CPU tier (here none): a miss at once."""
    engine = make_engine(
        cpu_memory_gb=8 * PAGE / 2**30, disk_admission="always", restore_timeout_s=5.0,
        tenant_quotas=f"b=cpu:{pages(8)}",
    )
    pa, pb = engine.attach("a", 4), engine.attach("b", 4)
    theirs = keys("a", 4)
    assert store(engine, pa, theirs, 3) == 4
    assert store(engine, pb, keys("b", 8), 5) == 8  # fills the CPU tier within b's quota
    assert engine.wait_idle(30)
    assert set(engine.lookup("a", theirs)) == {Tier.DISK}
    (_, slot), = engine.allocate(pa.pool_id, 1)
    assert engine.load(pa.pool_id, theirs[:1], [slot]) == 0
    assert loads_exactly(engine, pb, keys("b", 8), 5)  # b's pages untouched
    ledger_matches_table(engine)


def test_blocks_of_many_page_sizes_within_a_quota_do_not_hold_the_whole_cpu_tier(make_engine):
    """Each page size has pinned chunks of its own, and a quota kept its tenant's pages: one
    block at each of four page sizes (40 KiB, within a 1 MiB quota) held all four 1 MiB chunks
    of the CPU tier, and another tenant within its 2 MiB quota stored 0 of 32 blocks. A chunk
    at most a quarter used now makes way whatever its tenants' quotas (its pages go down)."""
    mib = 1 << 20
    engine = make_engine(cpu_memory_gb=4 * mib / 2**30, gpu_memory_gb=4 * mib / 2**30,
                         disk_gb=16 * mib / 2**30, disk_admission="always",
                         tenant_quotas=f"a=cpu:{mib}B;b=cpu:{2 * mib}B")
    for i, size in enumerate((4096, 8192, 12288, 16384)):
        pool = engine.attach("a", 1, size)
        got = engine.allocate(pool.pool_id, 1)
        assert got is not None
        assert engine.store(pool.pool_id, [b"a%d" % i], [got[0][1]]) == 1
    pool = engine.attach("b", 32, 65536)  # a fifth page size: no chunk of its own yet
    got = engine.allocate(pool.pool_id, 32)
    assert got is not None
    keys = [b"b%d" % i for i in range(32)]
    assert engine.store(pool.pool_id, keys, [s for _, s in got]) == 32
    assert len(engine.lookup("b", keys)) == 32
    assert len(engine.lookup("a", [b"a%d" % i for i in range(4)])) == 4  # a's went to disk
