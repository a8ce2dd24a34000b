"""The vLLM connector's parts without vLLM: block planning, page views and the block mover."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from kvtier.client._backend import as_backend
from kvtier.client._blocks import chain_keys
from kvtier.client.block_mover import BlockMover
from kvtier.client.block_rows import BlockRows, block_segments

from kvtier import OffloadConfig, TierEngine
from kvtier.integrations.vllm.plan import BlockTransfer, LoadStorePlanner

BS = 4


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def planner(stored: set[bytes]) -> LoadStorePlanner:
    def lookup(keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in stored:
            n += 1
        return n

    return LoadStorePlanner(lookup, BS, b"ns", use_engine_hashes=False)


def cached(req_ids=(), new_block_ids=(), computed=(), resumed=()) -> SimpleNamespace:
    return SimpleNamespace(req_ids=list(req_ids), new_block_ids=list(new_block_ids),
                           num_computed_tokens=list(computed), resumed_req_ids=set(resumed))


def test_matched_tokens_never_covers_the_last_token() -> None:
    req = FakeRequest("r", list(range(12)))  # 3 full blocks
    p = planner(set(chain_keys(req.all_token_ids, BS, ns=b"ns")))
    assert p.matched_tokens(req, 0) == 8  # 2 blocks: the last token must be computed
    assert p.matched_tokens(req, 4) == 4  # beyond the local hit only


def test_plan_loads_then_stores_new_full_blocks() -> None:
    tokens = list(range(14))
    keys = chain_keys(tokens, BS, ns=b"ns")
    p = planner(set(keys[:2]))
    req = FakeRequest("r", tokens)
    assert p.matched_tokens(req, 0) == 8
    p.after_alloc(req, [10, 11, 12, 13], 8)
    nr = SimpleNamespace(req_id="r", block_ids=([10, 11, 12, 13],), num_computed_tokens=8)
    loads, stores = p.build([nr], cached(), {"r": 6}, {})
    assert loads == [BlockTransfer("r", keys[:2], [10, 11])]
    assert stores == [BlockTransfer("r", keys[2:3], [12], [10, 11])]  # block 3 is not full
    req.all_token_ids.append(99)  # one output token: 15 tokens, still 3 full blocks
    loads, stores = p.build([], cached(["r"], [None], [14]), {"r": 1}, {})
    assert loads == [] and stores == []


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_async_stores_delay_the_finish_and_lookups_wait_for_them() -> None:
    stored: set[bytes] = set()
    clock = Clock()

    def lookup(keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in stored:
            n += 1
        return n

    p = LoadStorePlanner(lookup, BS, b"ns", use_engine_hashes=False, async_stores=True,
                         store_wait_s=1.0, clock=clock)
    tokens = list(range(13))
    keys = chain_keys(tokens, BS, ns=b"ns")
    a = FakeRequest("a", tokens)
    assert p.matched_tokens(a, 0) == 0
    p.after_alloc(a, [1, 2, 3, 4], 0)
    nr = SimpleNamespace(req_id="a", block_ids=([1, 2, 3, 4],), num_computed_tokens=0)
    _, stores = p.build([nr], cached(), {"a": 13}, {})
    assert stores == [BlockTransfer("a", keys[:3], [1, 2, 3], [])]
    # Another request with the same prefix while a's stores are in flight: ask again later.
    b = FakeRequest("b", [*tokens[:12], 77])
    assert p.matched_tokens(b, 0) is None
    stored.update(keys[:2])  # two of the three have landed
    assert p.matched_tokens(b, 0) is None
    stored.add(keys[2])
    assert p.matched_tokens(b, 0) == 12
    # Past the wait (a store that failed or was refused): a miss, not an endless wait.
    c = FakeRequest("c", [5] * 13)
    p.after_alloc(c, [6, 7, 8, 9], 0)
    p.build([SimpleNamespace(req_id="c", block_ids=([6, 7, 8, 9],), num_computed_tokens=0)],
            cached(), {"c": 13}, {})
    assert p.matched_tokens(FakeRequest("d", [5] * 13), 0) is None
    clock.now += 1.5
    assert p.matched_tokens(FakeRequest("d", [5] * 13), 0) == 0
    # Requests with stores planned are finished later, through the workers.
    assert p.finished("a") is True and p.finished("b") is False and p.finished("c") is True
    assert p.take_delayed() == ["a", "c"] and p.take_delayed() == []


def test_sync_stores_free_at_once_and_an_absent_daemon_is_not_waited_for() -> None:
    p = LoadStorePlanner(lambda k: None, BS, b"ns", use_engine_hashes=False)
    req = FakeRequest("r", list(range(9)))
    assert p.matched_tokens(req, 0) == 0  # daemon away: a miss
    p.after_alloc(req, [1, 2, 3], 0)
    _, stores = p.build([SimpleNamespace(req_id="r", block_ids=([1, 2, 3],),
                                         num_computed_tokens=0)], cached(), {"r": 9}, {})
    assert len(stores) == 1 and p.finished("r") is False and p.take_delayed() == []


def test_local_hit_loads_only_the_rest() -> None:
    tokens = list(range(13))
    keys = chain_keys(tokens, BS, ns=b"ns")
    p = planner(set(keys))
    req = FakeRequest("r", tokens)
    assert p.matched_tokens(req, 4) == 8
    p.after_alloc(req, [7, 8, 9, 5], 8)
    loads, _ = p.build([SimpleNamespace(req_id="r", block_ids=([7, 8, 9, 5],),
                                        num_computed_tokens=12)], cached(), {"r": 1}, {})
    assert loads == [BlockTransfer("r", keys[1:3], [8, 9])]


def test_engine_hashes_are_used_when_reproducible() -> None:
    p = LoadStorePlanner(lambda k: 0, BS, b"ns", use_engine_hashes=True)
    req = FakeRequest("r", list(range(8)), [b"h0", b"h1"])
    keys = p.keys(req, 2)
    assert keys != chain_keys(req.all_token_ids, BS, ns=b"ns") and len(set(keys)) == 2


@pytest.fixture
def engine():
    with TierEngine(OffloadConfig(device="cpu", cpu_memory_gb=0.05, gpu_memory_gb=0.05,
                                  pinned_chunk_mb=1)) as eng:
        yield eng


def kv(num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, 2, BS, 64, generator=g) for _ in range(3)]


def mover(engine, tensors: list[torch.Tensor], **kw) -> BlockMover:
    n = tensors[0].shape[0]
    rows = BlockRows([s for t in tensors for s in block_segments(t, n)])
    return BlockMover(as_backend(engine, "t"), rows, **kw)


def test_mover_round_trip_and_partial_load(engine) -> None:
    src, dst = kv(8, 0), kv(8, 1)
    before = [t.clone() for t in dst]
    keys = [bytes([i]) * 16 for i in range(4)]
    a = mover(engine, src, register=False, staging_slots=3)
    b = mover(engine, dst, register=False, staging_slots=3)
    assert a.store(BlockTransfer("r", keys[:3], [5, 1, 7])) == 3
    # key 3 was never stored: the load ends after three blocks and leaves block 6 untouched
    assert b.load(BlockTransfer("r", keys, [0, 2, 4, 6])) == 3
    for s, d, old in zip(src, dst, before, strict=True):
        assert torch.equal(d[[0, 2, 4]], s[[5, 1, 7]])
        assert torch.equal(d[[1, 3, 5, 6, 7]], old[[1, 3, 5, 6, 7]])
    assert b.counters.loaded_blocks == 3 and b.counters.load_failed_blocks == 1
    a.close()
    b.close()


def test_mover_register_mode(engine) -> None:
    src = kv(6, 2)
    dst = kv(6, 3)
    keys = [bytes([9, i]) * 8 for i in range(2)]
    a = mover(engine, src, register=True)
    b = mover(engine, dst, register=True)
    assert a.store(BlockTransfer("r", keys, [2, 3])) == 2
    assert b.load(BlockTransfer("r", keys, [0, 5])) == 2
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[0, 5]], s[[2, 3]])
