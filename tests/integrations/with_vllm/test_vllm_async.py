"""The connector's worker side off the engine's step, driven the way vLLM drives it, without vLLM.

A real daemon subprocess, real torch tensors in vLLM's paged layout (one tensor per layer, block
dim first): loads wait per layer (layer k's wait never waits for a later layer's copy) and land
exactly the stored bytes; stores end on their own thread, requests are reported finished once
their stores have ended, and shutdown waits for the stores in flight.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
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

BS, LAYERS = 4, 3
log = logging.getLogger("test.vllm.async")
KEYS = [bytes([9, i]) * 8 for i in range(8)]
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv(num_blocks: int, seed: int | None) -> list[torch.Tensor]:
    """vLLM's CPU layout per layer: ``[num_blocks, 2 (K|V), block_size, heads * head_dim]``."""
    if seed is None:
        return [torch.zeros(num_blocks, 2, BS, 32) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, 2, BS, 32, generator=g) for _ in range(LAYERS)]


def worker(address: str, tensors: list[torch.Tensor], **kw: object) -> WorkerSteps:
    n = tensors[0].shape[0]
    segs = [block_segments(t, n) for t in tensors]
    layers, first = {}, 0
    for name, s in zip(NAMES, segs, strict=True):
        layers[name], first = range(first, first + len(s)), first + len(s)
    link = DaemonLink(lambda: connect(address, tenant="t", timeout=3.0), "worker", log)
    kw.setdefault("staging_slots", 4)
    return WorkerSteps(link, BlockRows([x for s in segs for x in s]), log, rank=Rank(),
                       register=False, layers=layers, **kw)  # type: ignore[arg-type]


def held(address: str, keys: list[bytes]) -> int:
    with connect(address, tenant="t") as c:
        return len(c.lookup(rank_keys(keys, Rank())))


@pytest.fixture
def daemon(tmp_path: Path):
    sock = tmp_path / "k.sock"
    proc = start_daemon(sock, cpu_gb=0.05)
    try:
        yield f"unix://{sock}"
    finally:
        stop_daemon(proc)


def test_layer_wait_does_not_wait_for_later_layers(daemon: str) -> None:
    src = kv(8, 0)
    a = worker(daemon, src)
    a.end([BlockTransfer("a", KEYS[:3], [0, 1, 2])])
    a.close()
    assert held(daemon, KEYS[:3]) == 3
    gates = [threading.Event() for _ in range(LAYERS)]
    gates[0].set()
    dst = kv(8, None)
    b = worker(daemon, dst, before_layer=lambda i: gates[i].wait(30))
    b.start([BlockTransfer("b", KEYS[:3], [5, 6, 7])])  # returns at once: loads run beside
    for i in range(LAYERS):
        waiter = threading.Thread(target=b.wait_layer, args=(NAMES[i],))
        waiter.start()
        waiter.join(10)
        assert not waiter.is_alive(), f"layer {i}'s wait waited for a later layer"
        assert torch.equal(dst[i][5:8], src[i][0:3])  # exactly the stored bytes
        for later in dst[i + 1 :]:
            assert not later[5:8].any()  # later layers: not copied yet
        if i + 1 < LAYERS:
            gates[i + 1].set()
    b.join_loads()
    assert b.take_invalid() == set()
    assert b.counters.loaded_blocks == 3 and b.counters.load_failed_blocks == 0
    b.close()


def test_layer_loads_in_rounds_stop_at_the_first_missing_block(daemon: str) -> None:
    src = kv(8, 1)
    a = worker(daemon, src)
    a.end([BlockTransfer("a", KEYS[:2], [0, 1]), BlockTransfer("a", KEYS[3:6], [3, 4, 5])])
    a.close()
    dst = kv(16, None)
    b = worker(daemon, dst, staging_slots=2)  # 8 blocks to load: four rounds of two
    b.start([BlockTransfer("x", KEYS[:4], [8, 9, 10, 11]),  # KEYS[2] was never stored
             BlockTransfer("y", KEYS[3:7], [12, 13, 14, 15])])  # KEYS[6] neither
    for name in NAMES:
        b.wait_layer(name)
    b.join_loads()
    assert b.take_invalid() == {10, 11, 15}
    for layer_src, layer_dst in zip(src, dst, strict=True):
        assert torch.equal(layer_dst[8:10], layer_src[0:2])
        assert torch.equal(layer_dst[12:15], layer_src[3:6])
        assert not layer_dst[10:12].any() and not layer_dst[15].any()  # never written
    # The step's stores stop where their chains meet a block that did not load.
    b.end([BlockTransfer("x", KEYS[4:5], [12], [8, 9, 10, 11]),
           BlockTransfer("z", [bytes([1, i]) * 8 for i in range(2)], [8, 9])])
    b.flush_stores()
    assert b.counters.unsafe_store_blocks == 1 and b.counters.stored_blocks == 2
    b.close()


def test_stores_end_off_the_step_and_finished_requests_are_reported_once(daemon: str) -> None:
    src = kv(8, 2)
    stored = threading.Event()
    release = threading.Event()

    def on_stored() -> None:
        release.wait(30)
        stored.set()

    w = worker(daemon, src, on_stored=on_stored)
    w.end([BlockTransfer("a", KEYS[:2], [0, 1]), BlockTransfer("b", KEYS[4:5], [4])])
    assert not stored.is_set()  # the step did not wait for its stores
    assert w.finished({"a", "idle"}) == {"idle"}  # "a" still has a store in flight
    flush = threading.Thread(target=w.flush_stores)  # a preemption: blocks about to be reused
    flush.start()
    flush.join(0.5)
    assert flush.is_alive()  # it waits for the store in flight
    release.set()
    flush.join(30)
    assert not flush.is_alive() and stored.is_set()
    assert held(daemon, KEYS[:2]) == 2 and held(daemon, KEYS[4:5]) == 1
    assert w.finished(set()) == {"a"}  # reported once its stores ended
    assert w.finished({"b"}) == {"b"} and w.finished({"x"}) == {"x"}
    assert w.finished(set()) == set()
    w.close()


def test_shutdown_waits_for_the_stores_in_flight(daemon: str) -> None:
    src = kv(8, 3)
    w = worker(daemon, src)
    w.end([BlockTransfer("a", KEYS[:4], [0, 1, 2, 3])])  # more blocks than staging slots
    w.close()
    assert held(daemon, KEYS[:4]) == 4
    dst = kv(8, None)
    r = worker(daemon, dst)
    assert r.begin([BlockTransfer("r", KEYS[:4], [4, 5, 6, 7])]) == set()
    assert all(torch.equal(d[4:8], s[0:4]) for d, s in zip(dst, src, strict=True))
    r.close()


def test_a_store_that_fails_after_the_daemon_left_drops_the_pool(tmp_path: Path) -> None:
    sock = tmp_path / "k.sock"
    proc = start_daemon(sock, cpu_gb=0.05)
    w = worker(f"unix://{sock}", kv(8, 4))
    try:
        assert w.mover() is not None
        stop_daemon(proc)
        w.end([BlockTransfer("a", KEYS[:2], [0, 1])])  # fails on the store thread
        w.flush_stores()
        assert w.link.outages == 1 and w.counters.stored_blocks == 0
        assert w.finished({"a"}) == {"a"}  # a failed store still lets vLLM free the blocks
    finally:
        w.close()
        stop_daemon(proc)


def test_a_hung_daemon_costs_a_flush_one_timeout_not_one_per_store(tmp_path: Path) -> None:
    """Stores queued behind one that timed out each waited out their own timeout (a daemon
    stopped with SIGSTOP: a preemption's flush took 45 s, 9 stores x 5 s). Now a failed store
    skips the rest of its attach's queue: the pool is dropped and re-attached anyway."""
    sock = tmp_path / "k.sock"
    proc = start_daemon(sock, cpu_gb=0.05)
    w = worker(f"unix://{sock}", kv(8, 4))  # client timeout 3 s
    try:
        assert w.mover() is not None
        proc.send_signal(signal.SIGSTOP)
        w.end([BlockTransfer(f"r{i}", KEYS[2 * i : 2 * i + 2], [2 * i, 2 * i + 1])
               for i in range(4)])
        t0 = time.monotonic()
        w.flush_stores()
        assert time.monotonic() - t0 < 5.0  # was 6 timeouts of 3 s: 4 stores, 2 detaches
        assert w.counters.stored_blocks == 0 and w.counters.store_failed_blocks == 8
        assert w.finished({f"r{i}" for i in range(4)}) == {f"r{i}" for i in range(4)}
    finally:
        proc.send_signal(signal.SIGCONT)
        w.close()
        stop_daemon(proc)


def test_inference_tensors_are_written_from_the_connector_threads(daemon: str) -> None:
    """vLLM's KV tensors, and pools attached during its steps, are inference tensors; the
    store and load threads do not inherit the engine thread's inference mode."""
    with torch.inference_mode():
        src, dst = kv(8, 5), kv(8, None)
        a = worker(daemon, src)
        a.end([BlockTransfer("a", KEYS[:2], [0, 1])])  # attaches now, in inference mode
    a.flush_stores()
    assert a.counters.stored_blocks == 2 and a.link.outages == 0
    with torch.inference_mode():
        b = worker(daemon, dst)
        b.start([BlockTransfer("b", KEYS[:2], [6, 7])])
        for name in NAMES:
            b.wait_layer(name)
        b.join_loads()
    assert b.take_invalid() == set() and b.link.outages == 0
    assert all(torch.equal(d[6:8], s[0:2]) for d, s in zip(dst, src, strict=True))
    a.close()
    b.close()
