"""Registered-mode loads of the connector's worker side, layer by layer, without vLLM.

vLLM's KV tensors (its CPU paged layout, one tensor per layer) live in a sealed memfd here, so a
real daemon subprocess in CPU mode can register them as the CUDA path registers GPU memory; the
only stand-in is the adapter that hands the memfd over with the segments (the connector's own
``ClientBackend`` sends CUDA IPC handles, which need no descriptor). Loads go through
``LoadLayers``: layer ``i`` is ready once every transfer passed it, with exactly the stored
bytes; missing blocks, a daemon restart and a pool lost between groups are recomputes; in
staging mode, a pool lost in the middle of a round confirms none of the round's blocks.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from integration_daemon import start_daemon, stop_daemon
from kvtier.client import connect
from kvtier.client._backend import ClientBackend, EngineBackend
from kvtier.client.block_mover import BlockMover, BlockTransfer
from kvtier.client.block_rows import BlockRows, block_segments
from kvtier.client.ipc import SharedMemory

from kvtier import OffloadConfig, TierEngine
from kvtier.integrations.vllm import steps as steps_module
from kvtier.integrations.vllm.groups import (
    LOAD_GROUPS,
    MPS_LOAD_GROUPS,
    MPS_PID_FILE,
    auto_groups,
    layer_groups,
    mps_running,
)
from kvtier.integrations.vllm.identity import Rank
from kvtier.integrations.vllm.link import DaemonLink
from kvtier.integrations.vllm.loads import LoadJob
from kvtier.integrations.vllm.steps import WorkerSteps

BS, LAYERS, HIDDEN = 4, 4, 32
log = logging.getLogger("test.vllm.layers")
KEYS = [bytes([5, i]) * 8 for i in range(8)]
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class KV:
    """Per-layer ``[blocks, 2, BS, HIDDEN]`` float32 tensors in one sealed memfd."""

    def __init__(self, blocks: int, seed: int | None) -> None:
        per = blocks * 2 * BS * HIDDEN * 4
        self.mem = SharedMemory(LAYERS * per)
        self.layers = [self.mem.tensor[i * per : (i + 1) * per].view(torch.float32)
                       .view(blocks, 2, BS, HIDDEN) for i in range(LAYERS)]
        g = torch.Generator().manual_seed(seed or 0)
        for t in self.layers:
            t.copy_(torch.randn(t.shape, generator=g) if seed is not None else 0)
        segs = [block_segments(t, blocks) for t in self.layers]
        self.ranges, first = {}, 0
        for name, s in zip(NAMES, segs, strict=True):
            self.ranges[name], first = range(first, first + len(s)), first + len(s)
        self.rows = BlockRows([x for s in segs for x in s])


class MemfdBackend(ClientBackend):
    """The connector's adapter, registering memfd-backed CPU segments (their descriptor)."""

    fds: dict[int, int] = {}  # data_ptr of the memfd's first byte -> its descriptor

    def register(self, segments: list[torch.Tensor]) -> Any:
        base = segments[0].untyped_storage().data_ptr()
        return self.client.register(segments, fds=[self.fds[base]] * len(segments))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    sock = tmp_path / "k.sock"
    procs = [start_daemon(sock, cpu_gb=0.05)]

    def restart() -> None:
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        sock.unlink(missing_ok=True)
        procs[0] = start_daemon(sock, cpu_gb=0.05)

    yield f"unix://{sock}", restart
    stop_daemon(procs[0])


def worker(address: str, kv: KV, monkeypatch: pytest.MonkeyPatch, clock: Clock | None = None,
           **kw: Any) -> WorkerSteps:
    MemfdBackend.fds[kv.mem.tensor.untyped_storage().data_ptr()] = kv.mem.fd
    monkeypatch.setattr(steps_module, "ClientBackend", MemfdBackend)
    link = DaemonLink(lambda: connect(address, tenant="t", timeout=3.0), "worker", log,
                      clock=clock or Clock())
    kw.setdefault("load_groups", LAYERS)  # a group per layer (the connector's default is 1)
    return WorkerSteps(link, kv.rows, log, rank=Rank(), register=True, staging_slots=4,
                       layers=kv.ranges, **kw)


def stored(w: WorkerSteps, stores: list[BlockTransfer]) -> None:
    w.end(stores)
    w.flush_stores()


def test_layer_groups_follow_layer_boundaries() -> None:
    assert layer_groups([range(0, 2), range(2, 4), range(4, 5)], 5, most=9) == (
        [0, 2, 4, 5], [0, 1, 2])
    assert layer_groups([range(0, 0), range(0, 2), range(2, 2)], 2, most=9) == ([0, 2], [0, 0, 0])
    whole = ([0, 4], [0, 0])
    assert layer_groups([range(2, 4), range(0, 2)], 4) == whole  # not in forward order
    assert layer_groups([range(0, 2), range(2, 3)], 4) == ([0, 4], [0, 0])  # not all segments
    eight = [range(2 * i, 2 * i + 2) for i in range(8)]  # 8 layers of a K and a V segment
    assert layer_groups(eight, 16) == ([0, 16], [0] * 8)  # the default: one group
    assert layer_groups(eight, 16, most=4) == ([0, 4, 8, 12, 16], [0, 0, 1, 1, 2, 2, 3, 3])
    assert layer_groups(eight, 16, most=3) == ([0, 6, 12, 16], [0, 0, 0, 1, 1, 1, 2, 2])
    assert layer_groups(eight, 16, most=1) == ([0, 16], [0] * 8)
    assert layer_groups(eight, 16, most=8)[1] == list(range(8))


def test_auto_groups_follow_a_running_mps_control_daemon(tmp_path: Path) -> None:
    """``auto``: 8 groups only while the pid file of the pipe directory names a live process."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert (mps_running(env), auto_groups(env)) == (False, LOAD_GROUPS)  # no MPS daemon there
    pid_file = tmp_path / MPS_PID_FILE
    pid_file.write_text(f"{os.getpid()}\n")  # a live process
    assert (mps_running(env), auto_groups(env)) == (True, MPS_LOAD_GROUPS)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    pid_file.write_text(str(gone.pid))
    assert auto_groups(env) == LOAD_GROUPS
    for junk in ("", "not a pid", "-1", "0"):
        pid_file.write_text(junk)
        assert not mps_running(env), junk
    (tmp_path / "control").touch()  # the sockets a daemon that quit leaves behind
    assert auto_groups(env) == LOAD_GROUPS


def test_each_layer_is_ready_before_later_layers_are_confirmed(
        daemon: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    address, _ = daemon
    src = KV(8, 1)
    a = worker(address, src, monkeypatch)
    stored(a, [BlockTransfer("a", KEYS[:3], [0, 1, 2]), BlockTransfer("a", KEYS[4:6], [4, 5])])
    a.close()
    dst = KV(16, None)
    gates = [threading.Event() for _ in range(LAYERS)]
    gates[0].set()
    b = worker(address, dst, monkeypatch, before_layer=lambda i: gates[i].wait(30))
    b.start([BlockTransfer("x", KEYS[:3], [9, 10, 11]),  # two transfers, side by side
             BlockTransfer("y", KEYS[4:6], [13, 12])])
    for i in range(LAYERS):
        waiter = threading.Thread(target=b.wait_layer, args=(NAMES[i],))
        waiter.start()
        waiter.join(10)
        assert not waiter.is_alive(), f"layer {i}'s wait waited for a later layer"
        assert torch.equal(dst.layers[i][9:12], src.layers[i][0:3])
        assert torch.equal(dst.layers[i][[13, 12]], src.layers[i][[4, 5]])
        if i + 1 < LAYERS:  # the next layer waits for its group's replies, held back here
            later = threading.Thread(target=b.wait_layer, args=(NAMES[i + 1],))
            later.start()
            later.join(0.2)
            assert later.is_alive(), f"layer {i + 1} was ready before its group was read"
            gates[i + 1].set()
            later.join(10)
    b.join_loads()
    assert b.take_invalid() == set()
    assert b.counters.loaded_blocks == 5 and b.counters.load_failed_blocks == 0
    assert b.counters.load_calls == 2
    b.close()


def test_missing_blocks_and_a_restart_are_recomputes(
        daemon: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    address, restart = daemon
    src = KV(8, 2)
    a = worker(address, src, monkeypatch)
    stored(a, [BlockTransfer("a", KEYS[:2], [0, 1]), BlockTransfer("a", KEYS[3:5], [3, 4])])
    dst, clock = KV(16, None), Clock()
    b = worker(address, dst, monkeypatch, clock)
    invalid = b.begin([BlockTransfer("x", KEYS[:4], [8, 9, 10, 11]),  # KEYS[2] never stored
                       BlockTransfer("y", KEYS[3:6], [12, 13, 14])])  # KEYS[5] neither
    assert invalid == {10, 11, 14}
    for s, d in zip(src.layers, dst.layers, strict=True):
        assert torch.equal(d[8:10], s[0:2]) and torch.equal(d[12:14], s[3:5])
    restart()  # the pool and every stored block are gone; the step must not fail
    assert b.begin([BlockTransfer("z", KEYS[:2], [8, 9])]) == {8, 9}
    a.close()
    a = worker(address, src, monkeypatch)  # a fresh writer on the new daemon
    stored(a, [BlockTransfer("a", KEYS[:2], [0, 1])])
    clock.now += 10  # b's back-off has passed: its next step registers again
    dst.layers[0][8:10].zero_()
    assert b.begin([BlockTransfer("z", KEYS[:2], [8, 9])]) == set()  # b too
    assert all(torch.equal(d[8:10], s[0:2]) for s, d in zip(src.layers, dst.layers, strict=True))
    assert b.counters.attaches == 2
    a.close()
    b.close()


def engine_mover(kv: KV) -> tuple[TierEngine, BlockMover]:
    engine = TierEngine(OffloadConfig(
        device="cpu", page_size=4096, gpu_memory_gb=1 / 1024, cpu_memory_gb=0.01,
        pinned_chunk_mb=1, batch_mb=1, max_inflight_mb=8, metrics_addr=""))
    return engine, BlockMover(EngineBackend(engine, "t"), kv.rows, register=True)


def test_an_empty_transfer_asks_nothing_and_loads_the_others(
        daemon: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon refuses a load of no keys: asking it would drop the pool for nothing."""
    address, _ = daemon
    src, dst = KV(8, 4), KV(8, None)
    a = worker(address, src, monkeypatch)
    stored(a, [BlockTransfer("a", KEYS[:2], [0, 1])])
    b = worker(address, dst, monkeypatch)
    assert b.begin([BlockTransfer("e", [], []), BlockTransfer("x", KEYS[:2], [4, 5])]) == set()
    assert all(torch.equal(d[4:6], s[0:2]) for s, d in zip(src.layers, dst.layers, strict=True))
    assert b.counters.attaches == 1 and not b.link.down
    a.close()
    b.close()


def test_a_pool_lost_between_groups_confirms_no_block() -> None:
    """In process (the engine's generator copies a group only when asked): the pool is detached
    after layer 0's group; the job fails, no block counts as loaded, every layer is released."""
    kv = KV(8, 3)
    engine, mover = engine_mover(kv)
    with engine:
        assert mover.store(BlockTransfer("a", KEYS[:2], [0, 1])) == 2

        def lose(i: int) -> None:
            if i == 1:
                mover.close()  # detach: the next group finds no pool

        job = LoadJob(mover, [BlockTransfer("b", KEYS[:2], [4, 5])],
                      list(kv.ranges.values()), before_layer=lose, groups=LAYERS)
        job.run()
        assert job.result() == [0] and job.error is not None
        assert torch.equal(kv.layers[0][4:6], kv.layers[0][0:2])  # group 0 had landed
        for name in range(LAYERS):
            job.wait_layer(name)  # released, not hanging
        assert mover.counters.load_failed_blocks == 2


def test_staging_a_daemon_lost_mid_round_confirms_no_block_of_the_round() -> None:
    """Staging mode: blocks were counted as loaded when staged, before the round's copies into
    vLLM's tensors; a daemon that died while a later piece of the round was staged skipped
    those copies, and the blocks counted as loaded held the old bytes (wrong tokens, found by
    killing a real daemon after a step's first Load). Now a round's blocks count once every
    layer of it is copied in."""
    kv = KV(8, 3)
    engine = TierEngine(OffloadConfig(
        device="cpu", page_size=4096, gpu_memory_gb=1 / 1024, cpu_memory_gb=0.01,
        pinned_chunk_mb=1, batch_mb=1, max_inflight_mb=8, metrics_addr=""))
    with engine:
        mover = BlockMover(EngineBackend(engine, "t"), kv.rows, register=False)
        assert mover.store(BlockTransfer("a", KEYS[:4], [0, 1, 2, 3])) == 4
        before = [t.clone() for t in kv.layers]
        real_stage = mover.stage

        def stage_then_lose(keys: list[bytes]) -> Any:
            staged = real_stage(keys)
            mover.close()  # the daemon's side is gone: the next piece's stage fails
            return staged

        mover.stage = stage_then_lose  # type: ignore[method-assign]
        job = LoadJob(mover, [BlockTransfer("b", KEYS[:2], [4, 5]),
                              BlockTransfer("c", KEYS[2:4], [6, 7])], list(kv.ranges.values()))
        job.run()
        assert job.error is not None and job.result() == [0, 0]
        assert all(torch.equal(a, b) for a, b in zip(kv.layers, before, strict=True))
        assert mover.counters.load_failed_blocks == 4
