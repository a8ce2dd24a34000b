"""Scenario tests of the tier engine on small integer-sized pools (CPU mode, real bytes)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvtier import PageState, Tier
from kvtier.errors import FailedPrecondition, InvalidArgument, NotFound, PageLost
from kvtier.types import Direction
from tests.conftest import PAGE


def fill(engine, pool, pages: list[int], seed: int = 0) -> dict[int, torch.Tensor]:
    """Write a distinct random page into each page id; returns the expected bytes."""
    gen = torch.Generator().manual_seed(seed)
    expected = {}
    for pid in pages:
        data = torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=gen)
        engine.write(pool.pool_id, pid, data)
        expected[pid] = data
    return expected


def verify(engine, pool, expected: dict[int, torch.Tensor]) -> None:
    for pid, data in expected.items():
        assert torch.equal(engine.read(pool.pool_id, pid), data), f"page {pid} bytes differ"


def test_pressure_offloads_and_restores_exact_bytes(make_engine):
    engine = make_engine(disk=False)
    pool = engine.attach("t", 8)
    first = engine.allocate(pool.pool_id, 8)
    ids = [p for p, _ in first]
    engine.release(pool.pool_id, ids)
    expected = fill(engine, pool, ids)
    more = engine.allocate(pool.pool_id, 8)  # forces all 8 earlier pages off the GPU
    assert more is not None
    engine.release(pool.pool_id, [p for p, _ in more])
    states = {engine.page_info(pool.pool_id, p).state for p in ids}
    assert states == {PageState.CPU}
    verify(engine, pool, expected)
    assert engine.stats().counters.moved[next(iter(engine.stats().counters.moved))].pages > 0


def test_cpu_full_cascades_to_disk_and_back(make_engine):
    engine = make_engine(cpu_memory_gb=8 * PAGE / 2**30, disk_admission="always")
    pool = engine.attach("t", 4)
    ids = []
    for _ in range(6):  # 24 pages through a 4-slot GPU and an 8-page CPU tier
        got = engine.allocate(pool.pool_id, 4)
        assert got is not None
        ids += [p for p, _ in got]
        engine.release(pool.pool_id, [p for p, _ in got])
    expected = fill(engine, pool, ids, seed=1)
    tiers = [engine.page_info(pool.pool_id, p).tier for p in ids]
    on_disk = tiers.count(Tier.DISK)
    assert on_disk > 0
    moved = engine.stats().counters.moved
    assert moved[Direction.GPU_TO_CPU].pages >= 20  # 24 pages through 4 GPU slots
    assert moved[Direction.CPU_TO_DISK].pages >= on_disk
    verify(engine, pool, expected)  # reads each disk page back through the CPU tier
    moved = engine.stats().counters.moved
    assert moved[Direction.DISK_TO_CPU].pages >= on_disk
    assert moved[Direction.CPU_TO_GPU].pages >= on_disk
    assert engine.stats().tiers[1].used_bytes <= 8 * PAGE


def test_cpu_cascade_spares_the_pages_an_acquire_waits_for(make_engine):
    """The restore's own room-making pushes CPU victims out: never the pages it restores."""
    engine = make_engine(cpu_memory_gb=8 * PAGE / 2**30, disk=False)
    pool = engine.attach("t", 4)
    batches, expected = [], {}
    for seed in range(3):  # the first two end up filling the 8-page CPU tier, oldest first
        ids = [p for p, _ in engine.allocate(pool.pool_id, 4)]
        expected.update(fill(engine, pool, ids, seed=seed))
        engine.release(pool.pool_id, ids)
        batches.append(ids)
    oldest = batches[0]
    assert {engine.page_info(pool.pool_id, p).state for p in oldest} == {PageState.CPU}
    # Room on the GPU means offloading the third batch, room for it in the full CPU tier
    # means evicting the CPU's least recently used pages: the very ones acquired here.
    slots = engine.acquire(pool.pool_id, oldest)
    assert slots is not None
    verify(engine, pool, {p: expected[p] for p in oldest})
    states = {engine.page_info(pool.pool_id, p).state for p in batches[1]}
    assert states == {PageState.DROPPED}  # the cascade took the next oldest instead
    assert engine.stats().counters.drops["cpu_full"] == 4
    engine.release(pool.pool_id, oldest)


def test_a_page_freed_while_its_acquire_waits_fails_the_acquire_naming_it(make_engine):
    """The acquire waits on a disk read (held at a gate); a page it waits for is freed
    meanwhile: the acquire raises NotFound for that page and holds nothing."""
    engine = make_engine(cpu_memory_gb=8 * PAGE / 2**30, disk_admission="always")
    pool = engine.attach("t", 4)
    ids = []
    for _ in range(6):  # 24 pages through a 4-slot GPU and an 8-page CPU tier
        got = [p for p, _ in engine.allocate(pool.pool_id, 4)]
        engine.release(pool.pool_id, got)
        ids += got
    on_disk = [p for p in ids if engine.page_info(pool.pool_id, p).tier is Tier.DISK][:2]
    assert len(on_disk) == 2
    gate = threading.Event()
    reader = engine._core.scheduler._handlers[Direction.DISK_TO_CPU]
    real = reader.launch
    reader.launch = lambda batch: (gate.wait(10), real(batch))[1]  # the real read, held back
    errors: list[BaseException] = []

    def acquire() -> None:
        try:
            engine.acquire(pool.pool_id, on_disk)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=acquire)
    waiter.start()
    deadline = time.monotonic() + 10
    while engine.page_info(pool.pool_id, on_disk[0]).state is not PageState.MOVING_UP:
        assert time.monotonic() < deadline, "the disk read never started"
        time.sleep(0.001)
    engine.free(pool.pool_id, on_disk[:1])
    gate.set()
    waiter.join(10)
    assert len(errors) == 1 and isinstance(errors[0], NotFound), errors
    assert str(on_disk[0]) in str(errors[0]) and str(on_disk[1]) not in str(errors[0])
    assert engine.wait_idle(10)
    with pytest.raises(NotFound):
        engine.page_info(pool.pool_id, on_disk[0])
    assert engine.page_info(pool.pool_id, on_disk[1]).pins == 0  # the failed acquire held none


def test_pinned_pages_never_move(make_engine):
    engine = make_engine(disk=False)
    pool = engine.attach("t", 4)
    got = engine.allocate(pool.pool_id, 4)
    pinned = got[0][0]
    engine.release(pool.pool_id, [p for p, _ in got[1:]])
    slot = engine.page_info(pool.pool_id, pinned).slot
    for _ in range(5):
        more = engine.allocate(pool.pool_id, 3)
        assert more is not None
        engine.release(pool.pool_id, [p for p, _ in more])
    info = engine.page_info(pool.pool_id, pinned)
    assert info.state is PageState.GPU and info.slot == slot and info.pins == 1
    assert engine.allocate(pool.pool_id, 4) is None  # one slot is pinned: capacity shortfall


def test_acquire_more_than_free_slots_is_a_shortfall_not_an_error(make_engine):
    engine = make_engine(disk=False)
    pool = engine.attach("t", 2)
    got = engine.allocate(pool.pool_id, 2)
    assert engine.allocate(pool.pool_id, 1) is None
    assert engine.stats().pinned_pages == 2
    engine.release(pool.pool_id, [p for p, _ in got])


def test_bad_inputs_raise_and_change_nothing(make_engine):
    engine = make_engine(disk=False)
    pool = engine.attach("t", 4)
    got = engine.allocate(pool.pool_id, 2)
    before = engine.stats()
    with pytest.raises(InvalidArgument, match="n"):
        engine.allocate(pool.pool_id, 0)
    with pytest.raises(InvalidArgument, match="page_ids"):
        engine.acquire(pool.pool_id, [])
    with pytest.raises(NotFound):
        engine.acquire(pool.pool_id, [999])
    with pytest.raises(NotFound):
        engine.allocate(12345, 1)
    with pytest.raises(InvalidArgument, match="priority"):
        engine.set_priority(pool.pool_id, [got[0][0]], -1.0)
    with pytest.raises(InvalidArgument, match="tenant"):
        engine.attach("", 4)
    with pytest.raises(FailedPrecondition):
        engine.release(pool.pool_id, [got[0][0]]) or engine.release(pool.pool_id, [got[0][0]])
    after = engine.stats()
    assert after.tiers == before.tiers and after.pools == before.pools


def test_tenants_cannot_name_each_others_pages(make_engine):
    engine = make_engine(disk=False)
    a = engine.attach("alice", 4)
    b = engine.attach("bob", 4)
    pa = engine.allocate(a.pool_id, 1)[0][0]
    with pytest.raises(NotFound):
        engine.acquire(b.pool_id, [pa])
    with pytest.raises(NotFound):
        engine.free(b.pool_id, [pa])
    slot = engine.page_info(a.pool_id, pa).slot
    assert engine.store(a.pool_id, [b"block-0"], [slot]) == 1
    assert engine.lookup("alice", [b"block-0"]) == [Tier.CPU]
    assert engine.lookup("bob", [b"block-0"]) == []


def test_store_lookup_load_roundtrip_and_prefix(make_engine):
    engine = make_engine()
    pool = engine.attach("t", 4)
    got = engine.allocate(pool.pool_id, 3)
    slots = [s for _, s in got]
    expected = []
    for i, s in enumerate(slots):
        pool.segments[0][s].fill_(i + 7)
        expected.append(pool.segments[0][s].clone())
    keys = [b"h0", b"h1", b"h2"]
    assert engine.store(pool.pool_id, keys, slots) == 3
    assert (
        engine.store(pool.pool_id, keys[:1], slots[:1]) == 1
    )  # already stored: counted, not rewritten
    assert engine.lookup("t", [b"h0", b"h1", b"zz", b"h2"]) == [Tier.CPU, Tier.CPU]
    for s in slots:
        pool.segments[0][s].zero_()
    assert engine.load(pool.pool_id, [*keys, b"missing"], [*slots, slots[0]]) == 3
    for s, data in zip(slots, expected, strict=True):
        assert torch.equal(pool.segments[0][s], data)


def test_free_returns_every_slot(make_engine):
    engine = make_engine()
    pool = engine.attach("t", 4)
    ids = []
    for _ in range(4):
        got = engine.allocate(pool.pool_id, 4)
        ids += [p for p, _ in got]
        engine.release(pool.pool_id, [p for p, _ in got])
    engine.free(pool.pool_id, ids)
    stats = engine.stats()
    assert [t.used_bytes for t in stats.tiers] == [0, 0, 0]
    assert all(t.pages == 0 for t in stats.tiers)


def test_dropped_page_raises_page_lost(make_engine):
    engine = make_engine(disk=False, cpu_memory_gb=4 * PAGE / 2**30)
    pool = engine.attach("t", 2)
    ids = []
    for _ in range(5):
        got = engine.allocate(pool.pool_id, 2)
        ids += [p for p, _ in got]
        engine.release(pool.pool_id, [p for p, _ in got])
    lost = [p for p in ids if engine.page_info(pool.pool_id, p).state is PageState.DROPPED]
    assert lost, "a 2-slot GPU and 4-page CPU tier cannot hold 10 pages without a disk"
    with pytest.raises(PageLost):
        engine.acquire(pool.pool_id, lost[:1])
    assert engine.stats().counters.drops.get("cpu_full", 0) == len(lost)


def test_offload_hint_and_prefetch(make_engine):
    engine = make_engine(disk=False)
    pool = engine.attach("t", 8)
    got = engine.allocate(pool.pool_id, 4)
    ids = [p for p, _ in got]
    engine.release(pool.pool_id, ids)
    expected = fill(engine, pool, ids, seed=7)
    assert engine.offload(pool.pool_id, ids) == 4
    slots = engine.acquire(pool.pool_id, ids[:1])  # waits for the in-flight offload or cancels it
    assert slots is not None and len(slots) == 1
    assert engine.page_info(pool.pool_id, ids[0]).state is PageState.GPU
    engine.release(pool.pool_id, ids[:1])
    assert engine.wait_idle(10)
    assert [engine.page_info(pool.pool_id, p).state for p in ids[1:]] == [PageState.CPU] * 3
    assert engine.prefetch(pool.pool_id, ids) == 3  # the three on the CPU tier; not the GPU one
    assert engine.wait_idle(10)
    assert {engine.page_info(pool.pool_id, p).state for p in ids} == {PageState.GPU}
    assert engine.stats().pinned_pages == 0  # prefetch does not pin
    verify(engine, pool, expected)


def test_acquire_a_whole_pool_spread_over_cpu_and_disk(make_engine):
    """Restoring disk pages must not push the other requested CPU pages back down (no livelock)."""
    engine = make_engine(
        cpu_memory_gb=16 * PAGE / 2**30, disk_admission="always", restore_timeout_s=20
    )
    pool = engine.attach("t", 8)
    expected = {}
    for _ in range(6):
        got = engine.allocate(pool.pool_id, 8)
        for pid, slot in got:
            pool.segments[0][slot].fill_(pid % 251)
            expected[pid] = pid % 251
        engine.release(pool.pool_id, [p for p, _ in got])
    assert {engine.page_info(pool.pool_id, p).tier for p in expected} >= {Tier.CPU, Tier.DISK}
    ids = list(expected)
    for i in range(0, len(ids), 8):
        slots = engine.acquire(pool.pool_id, ids[i : i + 8])
        for pid, slot in zip(ids[i : i + 8], slots, strict=True):
            assert (
                int(pool.segments[0][slot].min())
                == int(pool.segments[0][slot].max())
                == expected[pid]
            )
        engine.release(pool.pool_id, ids[i : i + 8])


def test_store_into_a_full_cpu_tier_waits_for_the_disk_cascade(make_engine):
    engine = make_engine(cpu_memory_gb=4 * PAGE / 2**30, disk_admission="always")
    pool = engine.attach("t", 8)
    got = engine.allocate(pool.pool_id, 8)
    slots = [s for _, s in got]
    for i, s in enumerate(slots):
        pool.segments[0][s].fill_(i + 1)
    keys = [f"k{i}".encode() for i in range(8)]
    assert engine.store(pool.pool_id, keys, slots) == 8  # twice what the CPU tier holds
    assert set(engine.lookup("t", keys)) == {Tier.CPU, Tier.DISK}
    pool.segments[0].zero_()
    assert engine.load(pool.pool_id, keys, slots) == 8
    for i, s in enumerate(slots):
        assert int(pool.segments[0][s].min()) == int(pool.segments[0][s].max()) == i + 1


def test_concurrent_acquires_of_overlapping_pages_pin_each_page_once_per_acquire(make_engine):
    """Restores past the inline limit are queued, so the second acquire waits on pages the
    first is already waiting for."""
    engine = make_engine(disk=False, gpu_memory_gb=16 / 1024, cpu_memory_gb=16 / 1024)
    pool = engine.attach("t", 3072)
    ids = [p for p, _ in engine.allocate(pool.pool_id, 2816)]
    engine.release(pool.pool_id, ids)
    expected = fill(engine, pool, ids[::64], seed=3)
    engine.offload(pool.pool_id, ids)
    assert engine.wait_idle(10)
    first, second = ids[:2560], ids[256:]  # 2304 pages wanted by both, 10 MiB each
    results: dict[str, list[int] | None] = {}
    threads = [
        threading.Thread(
            target=lambda k=k, w=w: results.__setitem__(k, engine.acquire(pool.pool_id, w))
        )
        for k, w in (("a", first), ("b", second))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results["a"] is not None and results["b"] is not None
    for pid in ids:
        info = engine.page_info(pool.pool_id, pid)
        assert info.state is PageState.GPU
        assert info.pins == (pid in first) + (pid in second)
    for pid, slot in zip(first, results["a"], strict=True):
        if pid in expected:
            assert torch.equal(pool.segments[0][slot], expected[pid])
    engine.release(pool.pool_id, first)
    engine.release(pool.pool_id, second)
    assert all(engine.page_info(pool.pool_id, p).pins == 0 for p in ids)
    engine.free(pool.pool_id, ids)
    assert engine.wait_idle(10)  # pages the watermark was offloading are freed as they land
    assert engine.stats().tiers[0].used_bytes == 0


def test_free_of_pages_in_every_state_at_once(make_engine):
    """GPU and CPU pages are released in bulk; moving, disk and dropped ones page by page."""
    engine = make_engine(disk=False, cpu_memory_gb=4 * PAGE / 2**30)
    pool = engine.attach("t", 2)
    ids = []
    for _ in range(5):
        got = engine.allocate(pool.pool_id, 2)
        ids += [p for p, _ in got]
        engine.release(pool.pool_id, [p for p, _ in got])
    states = {engine.page_info(pool.pool_id, p).state for p in ids}
    assert PageState.DROPPED in states and PageState.CPU in states, states
    on_gpu = [p for p in ids if engine.page_info(pool.pool_id, p).state is PageState.GPU]
    engine.offload(pool.pool_id, on_gpu[:1])  # queued or in flight while it is freed
    events = engine.subscribe()
    engine.free(pool.pool_id, ids)
    assert engine.wait_idle(10)
    for pid in ids:
        with pytest.raises(NotFound):
            engine.page_info(pool.pool_id, pid)
    stats = engine.stats()
    assert [t.used_bytes for t in stats.tiers] == [0, 0, 0]
    freed = set()
    while (event := events.get(timeout=1)) is not None:
        if event.kind == "freed":
            freed.add(event.page_id)
    assert freed == set(ids)
    again = engine.allocate(pool.pool_id, 2)  # every GPU slot came back
    assert again is not None


def test_round_trips_across_pools_page_sizes_and_directions(make_engine):
    """Batches of two pools and page sizes, both ways, repeatedly: every byte comes back."""
    engine = make_engine(disk=False, gpu_memory_gb=4 / 1024, cpu_memory_gb=8 / 1024)
    small, large = engine.attach("t", 64, PAGE), engine.attach("t", 32, 2 * PAGE)
    pages = {}
    for pool in (small, large):
        ids = [p for p, _ in engine.allocate(pool.pool_id, pool.num_slots)]
        engine.release(pool.pool_id, ids)
        for pid in ids:
            data = torch.full((pool.page_size,), pid % 251, dtype=torch.uint8)
            engine.write(pool.pool_id, pid, data)
        pages[pool.pool_id] = (pool, ids)
    for _ in range(3):
        for pool, ids in pages.values():
            engine.offload(pool.pool_id, ids)
        assert engine.wait_idle(10)
        for pool, ids in pages.values():
            assert {engine.page_info(pool.pool_id, p).state for p in ids} == {PageState.CPU}
            pool.segments[0].zero_()  # restored bytes must come from the CPU tier
            slots = engine.acquire(pool.pool_id, ids)
            for pid, slot in zip(ids, slots, strict=True):
                row = pool.segments[0][slot]
                assert int(row.min()) == int(row.max()) == pid % 251
            engine.release(pool.pool_id, ids)


def test_page_ids_may_be_a_numpy_array(make_engine):
    engine = make_engine(disk=False)
    pool = engine.attach("t", 4)
    got = engine.allocate(pool.pool_id, 3)
    ids = np.array([p for p, _ in got], dtype=np.int64)
    engine.release(pool.pool_id, ids)
    assert engine.offload(pool.pool_id, ids) == 3
    assert engine.wait_idle(10)
    slots = engine.acquire(pool.pool_id, ids[::-1])
    # Array in, array out: the same slots a list of the same ids gets.
    assert isinstance(slots, np.ndarray) and slots.dtype == np.int64
    assert slots.tolist() == engine.acquire(pool.pool_id, ids[::-1].tolist())
    assert engine.stats().pinned_pages == 3
    engine.release(pool.pool_id, ids)
    engine.release(pool.pool_id, ids)
    assert engine.stats().pinned_pages == 0


def test_errors_about_many_pages_name_a_few_and_count_the_rest(make_engine):
    engine = make_engine(disk=False)
    pool = engine.attach("t", 64)
    ids = np.array([p for p, _ in engine.allocate(pool.pool_id, 40)], dtype=np.int64)
    engine.release(pool.pool_id, ids)
    with pytest.raises(FailedPrecondition, match=r"\.\.\. and 32 more\] are not acquired") as err:
        engine.release(pool.pool_id, ids)
    assert str(int(ids[0])) in str(err.value) and str(int(ids[-1])) not in str(err.value)
    assert engine.stats().pinned_pages == 0
