"""kvtier/moves/demotion.py: the cascade, against real engines in CPU mode (real bytes)."""

from __future__ import annotations

import torch

from kvtier.types import Tier

KIB = 1024


def test_a_few_blocks_of_many_page_sizes_cannot_keep_another_size_out_of_the_cpu_tier(
        make_engine):
    """Each page size has chunks of its own in the CPU tier: one block each of four sizes held
    a 4-chunk tier's whole budget (a tenant using 40 KiB of 4 MiB), and every store or offload
    of a fifth size got no slot. Now the sparsest chunk of another size is emptied down the
    chain for it, and the blocks sent down still load exactly."""
    # A 4-chunk CPU tier over a disk with room for what is sent down.
    engine = make_engine(cpu_memory_gb=4 / 1024, pinned_chunk_mb=1, disk_gb=16 / 1024,
                         disk_admission="always")
    sizes = [4 * KIB, 8 * KIB, 12 * KIB, 16 * KIB]
    evil = []
    for i, size in enumerate(sizes):
        pool = engine.attach("evil", 2, page_size=size)
        (_, slot), = engine.allocate(pool.pool_id, 1)
        pool.segments[0][slot].fill_(i + 1)
        assert engine.store(pool.pool_id, [f"e{i}".encode()], [slot]) == 1
        evil.append((pool, slot))
    victim = engine.attach("victim", 8, page_size=20 * KIB)
    slots = [s for _, s in engine.allocate(victim.pool_id, 8)]
    for i, s in enumerate(slots):
        victim.segments[0][s].fill_(100 + i)
    keys = [f"v{i}".encode() for i in range(8)]
    assert engine.store(victim.pool_id, keys, slots) == 8
    assert set(engine.lookup("victim", keys)) == {Tier.CPU}
    assert Tier.DISK in [t for i in range(4) for t in engine.lookup("evil", [f"e{i}".encode()])]
    for i, (pool, slot) in enumerate(evil):  # what went down comes back exactly
        pool.segments[0][slot].zero_()
        assert engine.load(pool.pool_id, [f"e{i}".encode()], [slot]) == 1
        assert int(pool.segments[0][slot].min()) == int(pool.segments[0][slot].max()) == i + 1


def test_blocks_of_a_page_size_not_a_multiple_of_4k_go_down_to_disk_and_back(make_engine):
    """A registered pool's page size need not be a multiple of 4 KiB (a layer count times an
    odd per-layer size, e.g. MLA latents). Such pages were refused a disk slot (dropped as for
    a full disk: an MLA model had no disk tier). They are now padded on disk: they cascade
    down when the CPU tier fills and load back exactly."""
    engine = make_engine(cpu_memory_gb=1 / 1024, pinned_chunk_mb=1, disk_gb=16 / 1024,
                         disk_admission="always")
    layers = [torch.randint(0, 256, (16, 3000), dtype=torch.uint8) for _ in range(3)]
    odd = engine.register("odd", layers)
    keys = [f"o{i}".encode() for i in range(16)]
    assert engine.store(odd.pool_id, keys, list(range(16))) == 16
    victim = engine.attach("victim", 8, page_size=4 * KIB)
    slots = [s for _, s in engine.allocate(victim.pool_id, 8)]
    assert engine.store(victim.pool_id, [f"v{i}".encode() for i in range(8)], slots) == 8
    assert engine.wait_idle(10)
    assert engine.stats().counters.drops.get("disk_full", 0) == 0
    assert Tier.DISK in engine.lookup("odd", keys)
    want = [t.clone() for t in layers]
    for t in layers:
        t.zero_()
    assert engine.load(odd.pool_id, keys, list(range(16))) == 16
    assert all(torch.equal(t, w) for t, w in zip(layers, want, strict=True))
    engine.close(grace=5)
