"""Keyed store/load of engine-registered multi-segment pages through a real engine.

vLLM's flash-attention layout (``[2, blocks, block, heads, head]`` per layer: a K and a V
segment per layer) and an MLA layout (one latent tensor per layer), registered as the vLLM
connector registers them. Stored bytes come back exactly, into other blocks, after the sources
were overwritten; blocks not loaded keep their bytes. CPU mode runs the handlers' per-segment
path; the ``cuda`` variant the one-launch segment-table kernels.
"""

from __future__ import annotations

import threading

import pytest
import torch
from kvtier.client.block_rows import block_segments

from kvtier import OffloadConfig, TierEngine, prefix

BLOCKS = 48
LAYERS = 4


def engine_for(device: str, page: int, batch_pages: int) -> TierEngine:
    return TierEngine(
        OffloadConfig(
            device=device,
            page_size=4096,  # attach's default; registered pools bring their own size
            gpu_memory_gb=1 / 1024,
            cpu_memory_gb=4 * BLOCKS * page / 2**30,
            pinned_chunk_mb=1,
            batch_mb=max(1, batch_pages * page >> 20),
            max_inflight_mb=16,
            metrics_addr="",
        )
    )


def kv_layers(kind: str, device: str) -> list[torch.Tensor]:
    shape = (2, BLOCKS, 16, 2, 32) if kind == "flash" else (BLOCKS, 16, 72)
    return [
        torch.randint(-1000, 1000, shape, dtype=torch.int16, device=device).view(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def page_of(segments: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([s[block] for s in segments]).cpu()


def round_trip(kind: str, device: str) -> None:
    layers = kv_layers(kind, device)
    segments = [s for t in layers for s in block_segments(t, BLOCKS)]
    page = sum(s.shape[1] for s in segments)
    engine = engine_for(device, page, batch_pages=8)
    try:
        pool = engine.register("tenant-a", segments)
        src = list(range(0, 40, 2))  # 20 scattered blocks: several batches
        keys = [f"block-{i}".encode() for i in src]
        want = {k: page_of(segments, b) for k, b in zip(keys, src, strict=True)}
        assert engine.store(pool.pool_id, keys, src) == len(keys)
        for t in layers:  # the sources change after the store: the copies must not
            t.view(torch.int16).fill_(7)
        kept = page_of(segments, 47)
        dst = list(range(41, 1, -2))  # other blocks, reversed
        assert engine.load(pool.pool_id, keys, dst) == len(keys)
        for k, b in zip(keys, dst, strict=True):
            assert torch.equal(page_of(segments, b), want[k]), f"block {b} differs"
        assert torch.equal(page_of(segments, 47), kept)  # not loaded: untouched
        assert torch.equal(page_of(segments, 0), kept)  # a stored source, not a load target
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["flash", "mla"])
def test_registered_store_load_exact_bytes_cpu(kind: str) -> None:
    round_trip(kind, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["flash", "mla"])
def test_registered_store_load_exact_bytes_cuda(kind: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    round_trip(kind, "cuda:0")


def test_chunked_load_stops_at_the_first_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix, "FIRST_CHUNK", 2)  # chunks of 2, 3, 6, 8, 1 blocks
    layers = kv_layers("flash", "cpu")
    segments = [s for t in layers for s in block_segments(t, BLOCKS)]
    engine = engine_for("cpu", sum(s.shape[1] for s in segments), batch_pages=8)
    try:
        pool = engine.register("tenant-a", segments)
        keys = [f"k{i}".encode() for i in range(20)]
        want = [page_of(segments, b) for b in range(20)]
        assert engine.store(pool.pool_id, keys, list(range(20))) == 20
        keys[13] = b"never-stored"
        after = [page_of(segments, b) for b in range(40, 48)]
        assert engine.load(pool.pool_id, keys, list(range(27, 47))) == 13
        for i in range(13):
            assert torch.equal(page_of(segments, 27 + i), want[i]), f"block {27 + i}"
        for b, kept in zip(range(40, 48), after, strict=True):  # from the miss on: untouched
            assert torch.equal(page_of(segments, b), kept), f"block {b} written"
    finally:
        engine.close()


def racing_tenants(device: str) -> tuple[list[int], set[int | None]]:
    """Four tenants store and load their own blocks at once, over and over: each load gives
    back exactly its tenant's bytes. The ids of the threads that launched load batches, and
    of the up lane's thread."""
    engine = engine_for(device, 4 * 2 * 16 * 2 * 32 * 2, batch_pages=4)
    launched: list[int] = []
    for handler in engine._core.scheduler._lanes["up"].handlers.values():  # spy on launches
        real = handler.launch
        handler.launch = lambda b, real=real: (launched.append(threading.get_ident()), real(b))[1]
    errors: list[str] = []

    def tenant(name: str) -> None:
        layers = kv_layers("flash", device)
        segments = [s for t in layers for s in block_segments(t, BLOCKS)]
        pool = engine.register(name, segments)
        for round_ in range(6):
            keys = [f"{name}-{round_}-{b}".encode() for b in range(12)]
            want = [page_of(segments, b) for b in range(12)]
            if engine.store(pool.pool_id, keys, list(range(12))) != 12:
                errors.append(f"{name}: store {round_} short")
            for t in layers:
                t.view(torch.int16).add_(1)
            if engine.load(pool.pool_id, keys, list(range(20, 32))) != 12:
                errors.append(f"{name}: load {round_} short")
            for i in range(12):
                if not torch.equal(page_of(segments, 20 + i), want[i]):
                    errors.append(f"{name}: round {round_} block {20 + i} differs")

    try:
        threads = [threading.Thread(target=tenant, args=(f"t{i}",)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads) and not errors, errors[:5]
        lane = {t.ident for t in threading.enumerate() if t.name == "kvtier-up"}
        return launched, lane
    finally:
        engine.close()


def test_racing_tenants_keep_exact_bytes_cpu() -> None:
    racing_tenants("cpu")


@pytest.mark.cuda
def test_racing_tenants_keep_exact_bytes_cuda() -> None:
    """On CUDA an idle lane is lent to the caller (``kvtier/loan.py``): some loads launch on
    the calling threads, the rest on the lane's thread when the lane was busy."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    launched, lane = racing_tenants("cuda:0")
    assert lane and launched and any(t not in lane for t in launched)
