"""One engine, two GPUs: pools on each, per-GPU lanes and handlers, one CPU/disk budget.

Skipped unless torch sees two CUDA devices. Bytes are checked exactly after every move; a page
written on a GPU's own current stream must be read by the engine only after that write (the
readiness event is recorded on the pool's GPU, not on the default one).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvtier import OffloadConfig, PageState, TierEngine
from kvtier.errors import InvalidArgument

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]
PAGE = 64 << 10
GPUS = ("cuda:0", "cuda:1")


def two_gpu_engine(tmp_path, device: str = "cuda:0,cuda:1", **kw) -> TierEngine:
    base = dict(
        device=device, page_size=PAGE, gpu_memory_gb=0.5, cpu_memory_gb=0.25,
        pinned_chunk_mb=8, batch_mb=2, metrics_addr="", threshold=1.0, low_watermark=0.99,
        disk_path=str(tmp_path / "d"), disk_gb=64 * PAGE / 2**30, disk_admission="always",
    )
    base.update(kw)
    return TierEngine(OffloadConfig(**base))


def filled(engine: TierEngine, device: str, n: int, tenant: str = ""):
    """A pool on ``device`` with ``n`` released pages of random bytes; (pool, ids, bytes by id)."""
    pool = engine.attach(tenant or f"rank{device[-1]}", n, device=device)
    assert pool.segments[0].device == torch.device(device)
    got = engine.allocate(pool.pool_id, n)
    assert got is not None
    expected = {}
    for pid, slot in got:
        data = torch.randint(0, 256, (PAGE,), dtype=torch.uint8, device=device)
        pool.segments[0][slot].copy_(data)  # on the GPU's current stream, not synchronised
        expected[pid] = data.cpu()
    ids = np.array([p for p, _ in got], dtype=np.int64)
    engine.release(pool.pool_id, ids)
    return pool, ids, expected


def check(engine: TierEngine, pool, ids: np.ndarray, expected: dict) -> None:
    slots = engine.acquire(pool.pool_id, ids)
    assert slots is not None
    seg = pool.segments[0]
    for pid, slot in zip(ids.tolist(), slots.tolist(), strict=True):
        assert torch.equal(seg[slot].cpu(), expected[pid]), (str(seg.device), pid)
    engine.release(pool.pool_id, ids)


def test_cuda_is_every_gpu_with_lanes_per_gpu(tmp_path) -> None:
    engine = two_gpu_engine(tmp_path, device="cuda")
    try:
        assert engine.devices[:2] == GPUS
        assert {"up@cuda:1", "down@cuda:1"} <= set(engine._core.scheduler.lanes)
        assert engine.attach("t", 4).segments[0].device == torch.device("cuda:0")
    finally:
        engine.close()


def test_pools_on_both_gpus_offload_and_restore_exact_bytes_at_once(tmp_path) -> None:
    engine = two_gpu_engine(tmp_path)
    try:
        pools = [filled(engine, d, 512) for d in GPUS]
        for pool, ids, _ in pools:
            engine.offload(pool.pool_id, ids)
        assert engine.wait_idle(60)
        for pool, ids, _ in pools:
            assert {engine.page_info(pool.pool_id, int(p)).state for p in ids} == {PageState.CPU}
            pool.segments[0].zero_()
            torch.cuda.synchronize(pool.segments[0].device)
        with ThreadPoolExecutor(len(pools)) as ex:  # both GPUs restore at once
            for done in [ex.submit(check, engine, *p) for p in pools]:
                done.result(60)  # re-raises a failed check
    finally:
        engine.close()


def test_gpu0_restores_exactly_while_gpu1_drains_a_backlog(tmp_path) -> None:
    engine = two_gpu_engine(tmp_path)
    try:
        small, small_ids, small_bytes = filled(engine, "cuda:0", 16)
        big, big_ids, big_bytes = filled(engine, "cuda:1", 1024)
        engine.offload(small.pool_id, small_ids)
        assert engine.wait_idle(60)
        engine.offload(big.pool_id, big_ids)  # gpu1's backlog, 64 MiB
        for i in range(0, 16, 4):
            check(engine, small, small_ids[i : i + 4], small_bytes)
        assert engine.wait_idle(60)
        check(engine, big, big_ids, big_bytes)
    finally:
        engine.close()


def test_a_block_stored_from_one_gpu_loads_exactly_on_the_other(tmp_path) -> None:
    engine = two_gpu_engine(tmp_path)
    try:
        src, src_ids, src_bytes = filled(engine, "cuda:0", 8, tenant="tp")
        slots = engine.acquire(src.pool_id, src_ids)
        keys = [f"block{i}".encode() for i in range(8)]
        assert engine.store(src.pool_id, keys, slots.tolist()) == 8
        engine.release(src.pool_id, src_ids)
        dst = engine.attach("tp", 8, device="cuda:1")  # same tenant, other GPU
        got = engine.allocate(dst.pool_id, 8)
        assert got is not None
        assert engine.load(dst.pool_id, keys, [s for _, s in got]) == 8
        for (_, slot), pid in zip(got, src_ids.tolist(), strict=True):
            assert torch.equal(dst.segments[0][slot].cpu(), src_bytes[pid])
    finally:
        engine.close()


def test_register_takes_segments_on_a_served_gpu_only(tmp_path) -> None:
    engine = two_gpu_engine(tmp_path, device="cuda:0")
    try:
        with pytest.raises(InvalidArgument) as err:
            engine.register("t", [torch.zeros(4, PAGE, dtype=torch.uint8, device="cuda:1")])
        assert err.value.field == "segments"
        assert engine.pools() == []
        with pytest.raises(InvalidArgument) as err:
            engine.attach("t", 4, device="cuda:1")
        assert err.value.field == "device"
    finally:
        engine.close()
    engine = two_gpu_engine(tmp_path)
    try:
        pool = engine.register("t", [torch.zeros(4, PAGE, dtype=torch.uint8, device="cuda:1")])
        assert pool.dev.device == "cuda:1"
    finally:
        engine.close()
