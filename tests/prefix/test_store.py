"""kvtier/prefix/store.py: how stores and loads are cut into chunks (``chunks.py``), and keys
that repeat or were stored at another page size (real engines in CPU mode, real bytes)."""

from __future__ import annotations

import time
from itertools import pairwise

import pytest

from kvtier.caller import Caller
from kvtier.errors import Unavailable
from kvtier.prefix.chunks import FIRST_CHUNK, chunk_sizes
from kvtier.types import Tier
from tests.conftest import PAGE


def test_chunks_start_small_grow_and_cover_every_block() -> None:
    page, batch = 256 << 10, 64 << 20  # 256 blocks a batch
    sizes = chunk_sizes(1024, page, batch)
    assert sizes == [96, 120, 150, 187, 233, 238] and sum(sizes) == 1024  # a quarter more each
    assert FIRST_CHUNK == 96
    big = chunk_sizes(4096, page, batch)
    assert max(big) == 256 and big.count(256) >= 10 and sum(big) == 4096  # up to a batch's worth
    small = chunk_sizes(64 * FIRST_CHUNK, page // 16, batch)  # 4,096 blocks a batch
    quarter = [b == a + a // 4 for a, b in pairwise(small)]
    doubled = [b == 2 * a for a, b in pairwise(small)]
    k = next(i for i, a in enumerate(small) if a >= 4 * FIRST_CHUNK)
    assert all(quarter[:k]) and all(doubled[k : len(small) - 2])  # the last chunk: the rest
    assert len(small) < 15 and sum(small) == 64 * FIRST_CHUNK
    assert chunk_sizes(10, page, 2 * page) == [2, 2, 2, 2, 2]  # the first is a batch's worth
    assert chunk_sizes(0, page, batch) == []
    assert chunk_sizes(5, page, batch) == [5]
    assert chunk_sizes(3, 128 << 20, batch) == [1, 1, 1]  # a page larger than a batch


def test_a_key_repeated_in_a_load_ends_its_prefix_and_leaks_nothing(make_engine):
    """A load naming one disk block twice restored it twice (the CPU policy refused the second
    landing inside the lane, a CPU slot leaked per call, later loads hung): the prefix of a
    load, a layered load or a borrow now ends at a repeated key."""
    engine = make_engine(cpu_memory_gb=4 * PAGE / 2**30, disk_admission="always")
    pool = engine.attach("t", 8)
    slots = [s for _, s in engine.allocate(pool.pool_id, 8)]
    for i, s in enumerate(slots):
        pool.segments[0][s].fill_(i + 1)
    keys = [f"k{i}".encode() for i in range(8)]
    assert engine.store(pool.pool_id, keys, slots) == 8
    on_disk = [k for k, t in zip(keys, engine.lookup("t", keys), strict=True) if t is Tier.DISK]
    assert on_disk
    for rounds in range(6):
        key = on_disk[rounds % len(on_disk)]
        pool.segments[0][slots[0]].zero_()
        assert engine.load(pool.pool_id, [key, key, keys[0]], slots[:3]) == 1
        assert int(pool.segments[0][slots[0]].max()) == keys.index(key) + 1
        assert engine.wait_idle(10)
        cpu = next(t for t in engine.stats().tiers if t.tier is Tier.CPU)
        assert cpu.used_bytes == cpu.pages * PAGE, rounds  # no slot without its page
    with engine.borrow(pool.pool_id, [keys[1], keys[1]]) as held:
        assert len(held) == 1
    pool.segments[0].zero_()
    assert engine.load(pool.pool_id, keys, slots) == 8  # everything still loads, exactly
    for i, s in enumerate(slots):
        assert int(pool.segments[0][s].min()) == int(pool.segments[0][s].max()) == i + 1


def test_a_key_stored_at_another_page_size_is_replaced_not_counted_as_stored(make_engine):
    """A key stored from a pool of another page size (another layout; or records a daemon of
    another page size left on disk) counted as stored, so a store at this size stored nothing
    and every load at this size missed it for good."""
    engine = make_engine()
    big = engine.attach("t", 4, page_size=2 * PAGE)
    small = engine.attach("t", 4)
    b_slots = [s for _, s in engine.allocate(big.pool_id, 3)]
    s_slots = [s for _, s in engine.allocate(small.pool_id, 3)]
    for i, (b, s) in enumerate(zip(b_slots, s_slots, strict=True)):
        big.segments[0][b].fill_(10 + i)
        small.segments[0][s].fill_(20 + i)
    keys = [b"a", b"b", b"c"]
    assert engine.store(big.pool_id, keys, b_slots) == 3
    assert engine.store(small.pool_id, keys, s_slots) == 3
    assert engine.store(small.pool_id, keys, s_slots) == 3  # now present at this size
    small.segments[0].zero_()
    assert engine.load(small.pool_id, keys, s_slots) == 3
    for i, s in enumerate(s_slots):
        assert int(small.segments[0][s].min()) == int(small.segments[0][s].max()) == 20 + i
    assert engine.load(big.pool_id, keys, b_slots) == 0  # the other layout's pages are gone
    assert engine.stats().counters.drops.get("replaced") == 3


def test_copies_that_could_not_be_handed_over_are_not_counted(make_engine):
    """A Store whose batch the lanes refused (a closed scheduler) left its pool counted as
    copying, and a later Detach would have waited for those copies forever."""
    engine = make_engine(disk=False)
    pool = engine.attach("t", 4)
    slots = [s for _, s in engine.allocate(pool.pool_id, 2)]
    engine._core.scheduler.close()
    with pytest.raises(Unavailable):
        engine.store(pool.pool_id, [b"a", b"b"], slots)
    assert pool.dev.copying == 0


def test_stores_of_one_key_at_once_keep_one_page_of_it(make_engine):
    """A store that waited for CPU slots (the engine lock released) then added the keys it had
    found new before the wait, though another store had added them meanwhile (at its page size
    or another): one key held several pages, each with slots and a disk record (the others out
    of reach; the same key twice in the disk index after a restart). Keys stored meanwhile are
    now left to the store that added them, also those of a later part of the same chunk (a
    CPU tier too small for a chunk: the wait came before its first part, the duplicate in the
    next; 0-6 keys in 5 of 6 runs of this test before)."""
    import random
    import threading
    from collections import Counter

    engine = make_engine(cpu_memory_gb=24 * PAGE / 2**30, gpu_memory_gb=32 / 1024,
                         disk_gb=60 * PAGE / 2**30, disk_admission="always")
    sizes, keys = (PAGE, 2 * PAGE, 3 * PAGE), [b"k%d" % i for i in range(16)]
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        pools = {size: engine.attach("t", 16, size) for size in sizes}
        try:
            for _ in range(400):
                pool = pools[rng.choice(sizes)]
                n = rng.randrange(1, 12)
                got = engine.allocate(pool.pool_id, n)
                if got is None:
                    continue
                first = rng.randrange(len(keys) - n + 1)
                engine.store(pool.pool_id, keys[first : first + n], [s for _, s in got])
                engine.free(pool.pool_id, [p for p, _ in got])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors
    core = engine._core
    with core.cond:
        repeated = [k for k, n in Counter(core.table.key_of.values()).items() if n > 1]
    assert repeated == []


def test_a_load_for_a_caller_gone_copies_nothing(make_engine):
    """``engine.load(.., caller)``: no copy once the caller is gone (``kvtier/caller.py``), for
    blocks in the CPU tier and on disk alike, by give_up or by deadline; a caller still
    waiting gets every block."""
    engine = make_engine(cpu_memory_gb=4 * PAGE / 2**30, disk_admission="always")
    pool = engine.attach("t", 16)
    slots = [s for _, s in engine.allocate(pool.pool_id, 16)]
    seg = pool.segments[0]
    for i, s in enumerate(slots[:8]):
        seg[s].fill_(i + 1)
    keys = [f"gone{i}".encode() for i in range(8)]
    assert engine.store(pool.pool_id, keys, slots[:8]) == 8
    assert Tier.DISK in engine.lookup("t", keys) and Tier.CPU in engine.lookup("t", keys)
    gave_up = Caller()
    gave_up.give_up()
    for caller in (gave_up, Caller(time.monotonic() - 1)):
        for s in slots[8:]:
            seg[s].fill_(0xEE)
        assert engine.load(pool.pool_id, keys, slots[8:], caller) == 0
        assert all(bool((seg[s] == 0xEE).all()) for s in slots[8:])
    assert engine.load(pool.pool_id, keys, slots[8:], Caller(time.monotonic() + 60)) == 8
    assert all(bool((seg[s] == i + 1).all()) for i, s in enumerate(slots[8:]))


def test_hits_and_misses_count_blocks_and_acquires_are_not_lookups(make_engine):
    """A lookup of 104 keys with 4 stored counted 4 hits and 1 miss (a miss per call, a hit per
    block: a hit ratio of 80% for 4% found), and Acquires counted as hits too (1 per call when
    resident). Now both count blocks, and acquired pages have a counter of their own."""
    engine = make_engine()
    pool = engine.attach("t", 8)
    got = engine.allocate(pool.pool_id, 4)
    keys = [f"ratio{i}".encode() for i in range(104)]
    assert engine.store(pool.pool_id, keys[:4], [s for _, s in got]) == 4
    before = engine.stats().counters
    hits, misses = sum(before.hits.values()), before.misses
    assert engine.lookup("t", keys) == [Tier.CPU] * 4
    after = engine.stats().counters
    assert (sum(after.hits.values()) - hits, after.misses - misses) == (4, 100)
    found, acquired = sum(after.hits.values()), after.acquired[Tier.GPU]
    assert engine.acquire(pool.pool_id, [p for p, _ in got]) is not None
    again = engine.stats().counters  # (the live counters, not a copy)
    assert sum(again.hits.values()) == found
    assert again.acquired[Tier.GPU] - acquired == 4
