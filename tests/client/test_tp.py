"""A tensor-parallel prefix: a hit only when every rank holds it; one rank's failed load makes
every rank recompute. Real engines (CPU mode) and a real daemon; one pool per rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier_daemon_fixture import Daemon

from client._backend import Backend, Staging, as_backend
from client.tp import TensorParallelPrefix
from kvtier.errors import InvalidArgument
from kvtier.types import Tier

PAGE = 4096
RANKS = 2


def keys_of(rank: int, n: int, prompt: str = "p") -> list[bytes]:
    """Rank-local keys: the same prefix gives different keys on different ranks."""
    return [f"{prompt}-block{i}-rank{rank}".encode() for i in range(n)]


def block(rank: int, i: int) -> torch.Tensor:
    return torch.full((PAGE,), (rank * 64 + i + 1) % 256, dtype=torch.uint8)


def fill(backend: Backend, pool: Staging, rank: int, n: int) -> list[int]:
    """``n`` pinned pages written with rank ``rank``'s blocks 0..n-1; their slots."""
    got = backend.allocate(pool.handle, n)
    assert got is not None
    slots = [slot for _, slot in got]
    for i, slot in enumerate(slots):
        pool.rows[slot].copy_(block(rank, i))
    return slots


def empty_slots(backend: Backend, pool: Staging, n: int) -> list[int]:
    got = backend.allocate(pool.handle, n)
    assert got is not None
    slots = [slot for _, slot in got]
    for slot in slots:
        pool.rows[slot].zero_()
    return slots


def ranks(backend: Backend, slots: int = 32) -> list[Staging]:
    return [backend.attach(slots, PAGE) for _ in range(RANKS)]


def check_loaded(pools: list[Staging], slots: list[list[int]], n: int) -> None:
    for rank, pool in enumerate(pools):
        for i in range(n):
            assert torch.equal(pool.rows[slots[rank][i]], block(rank, i)), (rank, i)


def test_the_common_hit_is_the_shortest_rank_prefix_and_loads_exact_bytes(make_engine) -> None:
    backend = as_backend(make_engine(disk=False), "tp")
    pools = ranks(backend)
    backend.store(pools[0].handle, keys_of(0, 6), fill(backend, pools[0], 0, 6))
    backend.store(pools[1].handle, keys_of(1, 4), fill(backend, pools[1], 1, 4))
    keys = [keys_of(r, 6) for r in range(RANKS)]
    with TensorParallelPrefix(backend, [p.handle for p in pools]) as tp:
        assert tp.lookup(keys) == 4
        dst = [empty_slots(backend, p, 6) for p in pools]
        assert tp.load(keys, dst) == 4
        check_loaded(pools, dst, 4)
        for rank, pool in enumerate(pools):  # nothing loaded past the common hit
            assert not pool.rows[dst[rank][4]].any(), rank


def test_store_reports_the_least_any_rank_stored(make_engine) -> None:
    backend = as_backend(make_engine(disk=False), "tp")
    pools = ranks(backend)
    with TensorParallelPrefix(backend, [p.handle for p in pools]) as tp:
        src = [fill(backend, p, r, 3) for r, p in enumerate(pools)]
        assert tp.store([keys_of(r, 3) for r in range(RANKS)], src) == 3
        assert tp.lookup([keys_of(r, 3) for r in range(RANKS)]) == 3
        assert tp.lookup([keys_of(r, 3, "other") for r in range(RANKS)]) == 0


def test_one_rank_failing_to_load_makes_every_rank_recompute(make_engine, tmp_path: Path) -> None:
    """Rank 1's blocks are cascaded to disk and rot there; rank 0's stay in CPU memory. The
    lookup still finds both (the disk index is intact), but rank 1's load fails its checksums:
    the answer is 0 for every rank, though rank 0 alone could have loaded all."""
    engine = make_engine(cpu_memory_gb=8 * PAGE / 2**30, disk_admission="always")
    backend = as_backend(engine, "tp")
    pools = ranks(backend)
    n = 8
    backend.store(pools[1].handle, keys_of(1, n), fill(backend, pools[1], 1, n))
    backend.store(pools[0].handle, keys_of(0, n), fill(backend, pools[0], 0, n))
    assert engine.wait_idle(10)
    keys = [keys_of(r, n) for r in range(RANKS)]
    assert set(backend.lookup(keys[1])) == {Tier.DISK}
    assert set(backend.lookup(keys[0])) == {Tier.CPU}
    for data in (tmp_path / "disk").glob("pages-*.dat"):
        data.write_bytes(bytes(data.stat().st_size))  # every disk byte zeroed
    with TensorParallelPrefix(backend, [p.handle for p in pools]) as tp:
        assert tp.lookup(keys) == n
        dst = [empty_slots(backend, p, n) for p in pools]
        assert tp.load(keys, dst) == 0
    assert backend.load(pools[0].handle, keys[0], dst[0]) == n  # rank 0 alone had them all


@pytest.mark.parametrize(
    ("keys", "slots", "field"),
    [
        ([[b"a"]], [[0]], "keys"),  # one rank's keys for two ranks
        ([[b"a"], [b"b", b"c"]], [[0], [0, 1]], "keys"),  # different lengths
        ([[b"a"], [b"b"]], [[0]], "slots"),
        ([[b"a"], [b"b"]], [[0], []], "slots[1]"),
    ],
)
def test_mismatched_ranks_are_refused_before_any_load(
    make_engine, keys: Any, slots: Any, field: str
) -> None:
    backend = as_backend(make_engine(disk=False), "tp")
    pools = ranks(backend, slots=4)
    with TensorParallelPrefix(backend, [p.handle for p in pools]) as tp:
        with pytest.raises(InvalidArgument) as err:
            tp.load(keys, slots)
        assert err.value.field == field


def test_ranks_attached_to_one_daemon_share_the_prefix_rule(spawn: Callable[..., Daemon]) -> None:
    d = spawn(cpu_pages=64)
    with d.client("tp-daemon") as client:
        backend = as_backend(client)
        pools = ranks(backend, slots=16)
        backend.store(pools[0].handle, keys_of(0, 5), fill(backend, pools[0], 0, 5))
        backend.store(pools[1].handle, keys_of(1, 3), fill(backend, pools[1], 1, 3))
        keys = [keys_of(r, 5) for r in range(RANKS)]
        with TensorParallelPrefix(backend, [p.handle for p in pools]) as tp:
            assert tp.lookup(keys) == 3
            dst = [empty_slots(backend, p, 5) for p in pools]
            assert tp.load(keys, dst) == 3
            check_loaded(pools, dst, 3)
