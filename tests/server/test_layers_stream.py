"""server/layers.py in process, on a real engine (CPU mode) and a real executor: the stream steps
the engine one group per reply, so a later group's segments are untouched until it is asked for
(through gRPC the daemon asks at once; test_load_layers.py checks the bytes end to end)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from kvtier import OffloadConfig, TierEngine
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


def test_each_reply_is_pulled_before_the_next_group_is_copied(engine: TierEngine) -> None:
    segs = [torch.randint(0, 256, (BLOCKS, 512), dtype=torch.uint8) for _ in range(SEGMENTS)]
    pool = engine.register("t", segs)
    keys = [f"s{i}".encode() for i in range(3)]
    assert engine.store(pool.pool_id, keys, [0, 1, 2]) == 3
    want = [s[0:3].clone() for s in segs]
    for s in segs:
        s[4:7].fill_(0xEE)
    bounds = [0, 2, 3, 6]
    req = pb.LoadLayersRequest(pool=pb.PoolRef(tenant="t", pool_id=pool.pool_id), keys=keys,
                               slots=[4, 5, 6], segment_bounds=bounds)

    async def drive() -> list[int]:
        counts = []
        with ThreadPoolExecutor(2) as ex:
            async for reply in layers.stream(engine, ex, owned, req, None):
                g = reply.group
                counts.append(reply.count)
                for i, s in enumerate(segs):
                    if i < bounds[g + 1]:
                        assert torch.equal(s[4:7], want[i]), (g, i)
                    else:
                        assert bool((s[4:7] == 0xEE).all()), (g, i, "written early")
                await asyncio.sleep(0.05)  # a stream that ran ahead would have copied by now
        return counts

    assert asyncio.run(drive()) == [3, 3, 3]


def test_a_stream_closed_early_closes_the_engine_generator(engine: TierEngine) -> None:
    segs = [torch.randint(0, 256, (BLOCKS, 512), dtype=torch.uint8) for _ in range(SEGMENTS)]
    pool = engine.register("t", segs)
    keys = [b"a", b"b"]
    assert engine.store(pool.pool_id, keys, [0, 1]) == 2
    req = pb.LoadLayersRequest(pool=pb.PoolRef(tenant="t", pool_id=pool.pool_id), keys=keys,
                               slots=[4, 5], segment_bounds=list(range(SEGMENTS + 1)))
    closed: list[bool] = []
    held: list[Iterator[int]] = []  # kept alive: only the stream's own close may end it
    real = engine.load_layers

    def watch(groups: Iterator[int]) -> Iterator[int]:
        try:
            yield from groups
        finally:
            closed.append(True)

    def watched(*args: Any) -> Iterator[int]:
        held.append(watch(real(*args)))
        return held[-1]

    async def drive() -> None:
        with ThreadPoolExecutor(2) as ex:  # its exit waits for the queued close
            stream = layers.stream(engine, ex, owned, req, None)
            assert (await stream.__anext__()).count == 2
            await stream.aclose()

    engine.load_layers = watched  # type: ignore[method-assign]
    asyncio.run(drive())
    assert closed == [True]
