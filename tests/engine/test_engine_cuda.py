"""The engine on a real CUDA device: batched handlers, stream ordering, exact bytes."""

from __future__ import annotations

import pytest
import torch

from kvtier import OffloadConfig, PageState, TierEngine
from kvtier.types import Tier

pytestmark = pytest.mark.cuda
PAGE = 64 << 10


def cuda_config(tmp_path, **kw) -> OffloadConfig:
    base = dict(
        device="cuda:0",
        page_size=PAGE,
        gpu_memory_gb=0.25,
        cpu_memory_gb=16 * PAGE / 2**30,
        pinned_chunk_mb=1,
        batch_mb=1,
        metrics_addr="",
        disk_path=str(tmp_path / "d"),
        disk_gb=256 * PAGE / 2**30,
        disk_admission="always",
    )
    base.update(kw)
    return OffloadConfig(**base)


def cuda_engine(tmp_path, **kw) -> TierEngine:
    return TierEngine(cuda_config(tmp_path, **kw))


def test_pressure_cycle_keeps_exact_bytes_on_cuda(tmp_path):
    engine = cuda_engine(tmp_path)
    try:
        pool = engine.attach("t", 8)
        assert pool.segments[0].is_cuda
        expected = {}
        for _ in range(6):  # 48 pages through 8 GPU slots and 16 CPU pages: spills to disk
            got = engine.allocate(pool.pool_id, 8)
            for pid, slot in got:
                data = torch.randint(0, 256, (PAGE,), dtype=torch.uint8, device="cuda")
                pool.segments[0][slot].copy_(data)
                expected[pid] = data.cpu()
            engine.release(pool.pool_id, [p for p, _ in got])
        assert {engine.page_info(pool.pool_id, p).tier for p in expected} >= {Tier.CPU, Tier.DISK}
        ids = list(expected)
        for i in range(0, len(ids), 8):
            slots = engine.acquire(pool.pool_id, ids[i : i + 8])
            for pid, slot in zip(ids[i : i + 8], slots, strict=True):
                assert torch.equal(pool.segments[0][slot].cpu(), expected[pid]), pid
            engine.release(pool.pool_id, ids[i : i + 8])
    finally:
        engine.close()


@pytest.mark.parametrize("pages,batch_mb", [(256, 1), (2048, 16)])
def test_many_batches_in_flight_each_way_keep_every_page_exact(tmp_path, pages, batch_mb):
    """Half of the pool's pages, scattered, down and back in one call each: several batches in
    flight on both streams of each handler (gather/DMA down, DMA/scatter up). With 16 MiB
    batches the host launches the next batch while the copy engine still runs the last one,
    the case where memory one stream made and another reads must be kept from reuse."""
    engine = cuda_engine(
        tmp_path,
        gpu_memory_gb=1.0,
        cpu_memory_gb=pages * PAGE / 2**30,
        pinned_chunk_mb=64,
        batch_mb=batch_mb,
        max_inflight_mb=4 * batch_mb,
        # a full pool is above the watermark: background offloads of the kept (released) pages
        # would free their slots to the restores, a legitimate move this test does not expect
        threshold=1.0,
        low_watermark=0.99,
    )
    try:
        pool = engine.attach("t", pages)
        got = engine.allocate(pool.pool_id, pages)
        seg = pool.segments[0]
        seg.copy_(torch.randint(0, 256, seg.shape, dtype=torch.uint8, device=seg.device))
        expected = seg.cpu()
        ids = [p for p, _ in got]
        engine.release(pool.pool_id, ids)
        moved = ids[::2]
        engine.offload(pool.pool_id, moved)
        assert engine.wait_idle(30)
        assert {engine.page_info(pool.pool_id, p).tier for p in moved} == {Tier.CPU}
        seg[torch.tensor([s for _, s in got[::2]], device=seg.device)] = 0  # freed slots
        slots = engine.acquire(pool.pool_id, moved)
        old = torch.tensor([s for _, s in got[::2]])
        assert torch.equal(seg[torch.tensor(slots, device=seg.device)].cpu(), expected[old])
        kept = torch.tensor([s for _, s in got[1::2]])
        where = [engine.page_info(pool.pool_id, p) for p, _ in got[1::2]]
        moved_away = [(i.page_id, i.tier, i.slot) for i, (_, s) in zip(where, got[1::2],
                                                                      strict=True)
                      if i.tier is not Tier.GPU or i.slot != s]
        assert not moved_away, f"kept pages left their slots: {moved_away[:8]}"
        assert not set(slots) & set(kept.tolist()), "a restore was given a kept page's slot"
        now = seg[kept.to(seg.device)].cpu()
        bad = (now != expected[kept]).any(1).nonzero().flatten()
        assert not len(bad), f"{len(bad)} kept pages changed, slots {kept[bad][:16].tolist()}"
    finally:
        engine.close()


def test_offload_waits_for_the_engines_last_write(tmp_path):
    """A write still running on the compute stream at release must land before the copy."""
    engine = cuda_engine(tmp_path)
    try:
        pool = engine.attach("t", 8)
        got = engine.allocate(pool.pool_id, 8)
        ids = [p for p, _ in got]
        torch.cuda._sleep(200_000_000)  # keeps the current stream busy ~0.1 s
        for i, (_, slot) in enumerate(got):
            pool.segments[0][slot].fill_(i + 1)  # queued behind the sleep
        engine.release(pool.pool_id, ids)  # records the ready event
        engine.offload(pool.pool_id, ids)
        for i, pid in enumerate(ids):
            page = engine.read(pool.pool_id, pid)
            assert int(page.min()) == int(page.max()) == i + 1
    finally:
        engine.close()


def test_slot_reused_right_after_offload_does_not_corrupt_the_copy(tmp_path):
    engine = cuda_engine(tmp_path)
    try:
        pool = engine.attach("t", 4)
        got = engine.allocate(pool.pool_id, 4)
        for i, (_, slot) in enumerate(got):
            pool.segments[0][slot].fill_(10 + i)
        engine.release(pool.pool_id, [p for p, _ in got])
        newer = engine.allocate(pool.pool_id, 4)  # takes the slots as soon as the copies land
        for _, slot in newer:
            pool.segments[0][slot].fill_(255)  # overwrite the source slots at once
        engine.release(pool.pool_id, [p for p, _ in newer])
        for i, (pid, _) in enumerate(got):
            assert engine.page_info(pool.pool_id, pid).state in (PageState.CPU, PageState.DISK)
            page = engine.read(pool.pool_id, pid)
            assert int(page.min()) == int(page.max()) == 10 + i
    finally:
        engine.close()


def test_store_and_load_on_cuda(tmp_path):
    engine = cuda_engine(tmp_path)
    try:
        pool = engine.attach("t", 4)
        got = engine.allocate(pool.pool_id, 2)
        slots = [s for _, s in got]
        for s in slots:
            pool.segments[0][s].copy_(
                torch.randint(0, 256, (PAGE,), dtype=torch.uint8, device="cuda")
            )
        want = [pool.segments[0][s].cpu() for s in slots]
        assert engine.store(pool.pool_id, [b"a", b"b"], slots) == 2
        pool.segments[0].zero_()
        assert engine.load(pool.pool_id, [b"a", b"b"], slots) == 2
        for s, w in zip(slots, want, strict=True):
            assert torch.equal(pool.segments[0][s].cpu(), w)
    finally:
        engine.close()


def _filled(engine: TierEngine, pool, n: int) -> tuple[list[int], list[torch.Tensor]]:
    slots = [s for _, s in engine.allocate(pool.pool_id, n)]
    want = []
    for s in slots:
        pool.segments[0][s].copy_(torch.randint(0, 256, (PAGE,), dtype=torch.uint8, device="cuda"))
        want.append(pool.segments[0][s].cpu())
    return slots, want


def test_load_of_keys_pushed_to_disk_on_cuda(tmp_path):
    """More keys than the CPU tier holds: the older ones are on disk when loaded back."""
    engine = cuda_engine(tmp_path)
    try:
        pool = engine.attach("t", 64)
        slots, want = _filled(engine, pool, 48)
        keys = [b"k%d" % i for i in range(48)]
        assert engine.store(pool.pool_id, keys, slots) == 48
        assert engine.lookup("t", keys[:4]) == [Tier.DISK] * 4
        pool.segments[0].zero_()
        assert engine.load(pool.pool_id, keys, slots) == 48
        for s, w in zip(slots, want, strict=True):
            assert torch.equal(pool.segments[0][s].cpu(), w)
    finally:
        engine.close()


def test_load_of_keys_from_the_remote_medium_on_cuda(tmp_path):
    """Keys another engine wrote to the shared store: fetched, staged in the CPU tier, copied up."""
    import os

    pytest.importorskip("blake3")  # the remote tier's frames need it (a dev dependency)

    from kvtier.tiers.keyed import DictMedium

    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef-cluster-secret")
    os.chmod(secret, 0o600)
    medium = DictMedium()
    kw = dict(disk_path="", disk_gb=0.0, remote_secret_file=str(secret))
    a = TierEngine(cuda_config(tmp_path, **kw), remote_medium=medium)
    b = TierEngine(cuda_config(tmp_path, **kw), remote_medium=medium)
    try:
        pa, pb = a.attach("t", 16), b.attach("t", 16)
        slots_a, want = _filled(a, pa, 8)
        slots_b = [s for _, s in b.allocate(pb.pool_id, 8)]
        keys = [b"r%d" % i for i in range(8)]
        assert a.store(pa.pool_id, keys, slots_a) == 8
        assert a.prefix._core.remote.flush(10)
        assert b.lookup("t", keys) == [Tier.REMOTE] * 8
        assert b.load(pb.pool_id, keys, slots_b) == 8
        for s, w in zip(slots_b, want, strict=True):
            assert torch.equal(pb.segments[0][s].cpu(), w)
    finally:
        a.close()
        b.close()
