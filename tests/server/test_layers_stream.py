"""server/layers.py in process, on a real engine (CPU mode) and a real executor: the load runs
to its end without waiting for the reader (a stalled reader holds nothing protected), replies
come in group order, and a stream closed early closes the engine's generator."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from kvtier import OffloadConfig, TierEngine
from kvtier.caller import Caller
from kvtier.types import PoolId
from kvtier.v1 import kvtier_pb2 as pb
from server import layers

BLOCKS, SEGMENTS = 8, 6


@pytest.fixture
def engine() -> Iterator[TierEngine]:
    with TierEngine(OffloadConfig(
            device="cpu", page_size=4096, gpu_memory_gb=1 / 1024, cpu_memory_gb=0.01,
            pinned_chunk_mb=1, batch_mb=1, max_inflight_mb=8, metrics_addr="")) as e:
        yield e


def owned(req: Any) -> PoolId:
    return PoolId(req.pool.pool_id)  # the tenancy rule is test_load_layers.py's


def watch(engine: TierEngine) -> list[str]:
    """Record each count the engine's generator yields and when it ends (``"closed"``)."""
    seen: list[str] = []
    real = engine.load_layers

    def watched(*args: Any) -> Iterator[int]:
        try:
            for n in real(*args):
                seen.append(f"yield {n}")
                yield n
        finally:
            seen.append("closed")

    engine.load_layers = watched  # type: ignore[method-assign]
    return seen


def stored(engine: TierEngine, keys: list[bytes]) -> tuple[PoolId, list[torch.Tensor]]:
    segs = [torch.randint(0, 256, (BLOCKS, 512), dtype=torch.uint8) for _ in range(SEGMENTS)]
    pool = engine.register("t", segs)
    assert engine.store(pool.pool_id, keys, list(range(len(keys)))) == len(keys)
    return pool.pool_id, segs


def request(pool: PoolId, keys: list[bytes], slots: list[int], bounds: list[int]
            ) -> pb.LoadLayersRequest:
    return pb.LoadLayersRequest(pool=pb.PoolRef(tenant="t", pool_id=pool), keys=keys,
                                slots=slots, segment_bounds=bounds)


def test_a_stalled_reader_holds_nothing(engine: TierEngine) -> None:
    keys = [f"s{i}".encode() for i in range(3)]
    pool, segs = stored(engine, keys)
    seen = watch(engine)
    req = request(pool, keys, [4, 5, 6], [0, 2, 3, 6])

    async def drive() -> list[tuple[int, int]]:
        ex = ThreadPoolExecutor(2)
        stream = layers.stream(engine, ex, owned, req, None, Caller())
        first = await stream.__anext__()
        ex.shutdown(wait=True)  # the load ends with two replies still unread
        assert seen == ["yield 3"] * 3 + ["closed"]
        return [(first.group, first.count)] + [(r.group, r.count) async for r in stream]

    assert asyncio.run(drive()) == [(0, 3), (1, 3), (2, 3)]
    assert all(torch.equal(s[4:7], s[0:3]) for s in segs)


def test_a_stream_closed_early_closes_the_engine_generator(engine: TierEngine) -> None:
    keys = [b"a", b"b"]
    pool, _ = stored(engine, keys)
    seen = watch(engine)
    req = request(pool, keys, [4, 5], list(range(SEGMENTS + 1)))

    async def drive() -> None:
        with ThreadPoolExecutor(2) as ex:  # its exit waits for the worker
            stream = layers.stream(engine, ex, owned, req, None, Caller())
            assert (await stream.__anext__()).count == 2
            await stream.aclose()

    asyncio.run(drive())
    assert seen[-1] == "closed" and 1 <= seen.count("yield 2") <= SEGMENTS
