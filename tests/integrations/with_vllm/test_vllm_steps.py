"""The connector's worker steps against a real daemon subprocess, without vLLM.

A daemon that is away, restarts (SIGTERM or kill -9) or comes up late never fails a step:
loads become recomputes, stores are skipped, and stores resume on a fresh pool once it answers.
A store never covers a block whose chain met a block that failed to load.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest
import torch
from integration_daemon import start_daemon, stop_daemon
from kvtier.client import connect
from kvtier.client.block_mover import BlockTransfer
from kvtier.client.block_rows import BlockRows, block_segments

from kvtier.integrations.vllm.identity import Rank, rank_keys
from kvtier.integrations.vllm.link import DaemonLink
from kvtier.integrations.vllm.steps import WorkerSteps

BS = 4
log = logging.getLogger("test.vllm.steps")
ONE = Rank()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def kv(num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, 2, BS, 64, generator=g) for _ in range(2)]


def steps(address: str, tensors: list[torch.Tensor], clock: Clock, rank: Rank = ONE
          ) -> WorkerSteps:
    n = tensors[0].shape[0]
    rows = BlockRows([s for t in tensors for s in block_segments(t, n)])
    link = DaemonLink(lambda: connect(address, tenant="t", timeout=3.0), "worker", log,
                      clock=clock)
    return WorkerSteps(link, rows, log, rank=rank, register=False, staging_slots=4)


def stored(w: WorkerSteps, stores: list[BlockTransfer]) -> None:
    """One step's stores, then wait for them (they end off the step, on the store thread)."""
    w.end(stores)
    w.flush_stores()


def held(address: str, keys: list[bytes], rank: Rank = ONE) -> int:
    with connect(address, tenant="t") as c:
        return len(c.lookup(rank_keys(keys, rank)))


KEYS = [bytes([7, i]) * 8 for i in range(4)]


def test_store_stops_where_the_chain_met_a_failed_load(tmp_path: Path) -> None:
    sock = tmp_path / "k.sock"
    proc = start_daemon(sock, cpu_gb=0.05)
    try:
        addr, clock = f"unix://{sock}", Clock()
        src, dst = kv(8, 0), kv(8, 1)
        a = steps(addr, src, clock)
        stored(a, [BlockTransfer("a", KEYS[:1], [0]), BlockTransfer("a2", KEYS[2:3], [2])])
        b = steps(addr, dst, clock)
        # Block 0 loads, block 1 is not stored: blocks 1 and 2 of the load are garbage.
        invalid = b.begin([BlockTransfer("b", KEYS[:3], [4, 5, 6])])
        assert invalid == {5, 6}
        assert torch.equal(dst[0][4], src[0][0])
        other = [bytes([8, i]) * 8 for i in range(3)]
        stored(b, [BlockTransfer("b", KEYS[3:4], [7], [4, 5, 6]),  # computed from garbage
               BlockTransfer("c", other[:2], [1, 5], [0]),  # its chain meets 5 at its 2nd block
               BlockTransfer("d", other[2:], [2], [])])
        assert held(addr, KEYS[3:4]) == 0 and held(addr, other[:2]) == 1
        assert held(addr, other[2:]) == 1
        assert b.counters.unsafe_store_blocks == 2 and b.counters.stored_blocks == 2
        # The next step is clean again: the recomputed blocks are stored.
        b.begin([])
        stored(b, [BlockTransfer("b", KEYS[1:4], [5, 6, 7], [4])])
        assert held(addr, KEYS) == 4
    finally:
        stop_daemon(proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_daemon_away_then_restarted(tmp_path: Path, sig: int) -> None:
    sock = tmp_path / "k.sock"
    addr, clock = f"unix://{sock}", Clock()
    src = kv(8, 0)
    w = steps(addr, src, clock)
    assert w.mover() is None  # no daemon yet: the engine starts anyway
    assert w.begin([BlockTransfer("r", KEYS[:2], [0, 1])]) == {0, 1}
    stored(w, [BlockTransfer("r", KEYS[:2], [0, 1])])
    assert w.counters.stored_blocks == 0 and w.link.outages == 1
    assert w.counters.load_failed_blocks == 2
    proc = start_daemon(sock, cpu_gb=0.05)
    try:
        stored(w, [BlockTransfer("r", KEYS[:1], [0])])
        assert w.counters.attaches == 0  # still backing off
        clock.now += 1.0
        stored(w, [BlockTransfer("r", KEYS[:1], [0])])
        assert w.counters.attaches == 1 and held(addr, KEYS[:1]) == 1
        proc.send_signal(sig)
        proc.wait(timeout=20)
        sock.unlink(missing_ok=True)
        proc = start_daemon(sock, cpu_gb=0.05)
        stored(w, [BlockTransfer("r", KEYS[1:2], [1], [0])])  # the old pool is gone: dropped
        assert held(addr, KEYS[:2]) == 0 and w.link.outages == 2
        clock.now += 1.0
        stored(w, [BlockTransfer("r", KEYS[:2], [0, 1])])
        assert held(addr, KEYS[:2]) == 2 and w.counters.attaches == 2
        dst = kv(8, 1)
        r = steps(addr, dst, clock)
        assert r.begin([BlockTransfer("r", KEYS[:2], [3, 4])]) == set()
        assert torch.equal(dst[1][3:5], src[1][0:2])
    finally:
        stop_daemon(proc)


def test_ranks_store_under_their_own_keys(tmp_path: Path) -> None:
    sock = tmp_path / "k.sock"
    proc = start_daemon(sock, cpu_gb=0.05)
    try:
        addr, clock = f"unix://{sock}", Clock()
        r0, r1 = Rank(0, 2), Rank(1, 2)
        s0 = kv(4, 0)
        stored(steps(addr, s0, clock, r0), [BlockTransfer("r", KEYS[:2], [0, 1])])
        assert held(addr, KEYS[:2], r0) == 2 and held(addr, KEYS[:2], r1) == 0
        d1 = kv(4, 2)
        assert steps(addr, d1, clock, r1).begin([BlockTransfer("r", KEYS[:2], [0, 1])]) == {0, 1}
        assert not torch.equal(d1[0][0], s0[0][0])  # rank 1 never reads rank 0's shard
    finally:
        stop_daemon(proc)
