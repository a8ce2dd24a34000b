"""Calls whose caller gave up while the daemon was paused (SIGSTOP: a debugger, a VM pause, a
swap storm) or slow: nothing the daemon does for them afterwards may touch memory the caller
has since reused. Real daemon, real socket, CPU mode (the pool is the caller's shared memory)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvtier.client import Attachment, KVTierClient
from kvtier.client.ipc import SharedMemory
from kvtier_daemon_fixture import PAGE, Daemon, serve_args

from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

N = 1024  # 64 MiB of 64 KiB pages: the copies take long enough to be paused halfway


def _paused_past_timeout(d: Daemon, call: grpc.Future, reuse: Callable[[], None]) -> None:
    """Pause the daemon 10 ms into ``call``, let the caller time out and reuse its memory
    (``reuse``), then resume the daemon and give it time to finish whatever it still does."""
    time.sleep(0.01)
    d.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as err:
            call.result()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        reuse()
    finally:
        d.proc.send_signal(signal.SIGCONT)
    time.sleep(2.0)


def _full_pool(c: KVTierClient, tag: bytes
               ) -> tuple[Attachment, list[int], list[bytes], pb.PoolRef]:
    """A pool of ``N`` acquired pages filled with 0xA1, its slots, ``N`` keys and its ref."""
    att = c.attach(N)
    got = c.allocate(att, N)
    assert got is not None and att.tensor is not None
    att.tensor.fill_(0xA1)
    ref = pb.PoolRef(tenant=att.tenant, pool_id=att.pool_id, instance=att.instance)
    return att, [s for _, s in got], [tag + b"-%d" % i for i in range(N)], ref


def test_a_load_its_caller_gave_up_on_writes_nothing_after_the_deadline(
        spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    """A Load paused past the caller's timeout, then resumed, went on copying stored blocks into
    the caller's slots after the caller had reused them (an engine hands a failed load's blocks
    back to be recomputed, or to another request): wrong KV there. Now a Load launches no copy
    once its caller is gone or its deadline has passed; only a chunk already under way when the
    pause came may still land."""
    d = spawn(args=serve_args(tmp_path, disk=tmp_path / "disk", pool_pages=N, cpu_pages=2 * N))
    with d.client("a") as c, grpc.insecure_channel(d.address) as ch:
        att, slots, keys, ref = _full_pool(c, b"late")
        assert c.store(att, keys, slots) == N
        att.tensor.fill_(0x00)  # type: ignore[union-attr]
        call = pb_grpc.KVTierStub(ch).Load.future(
            pb.LoadRequest(pool=ref, keys=keys, slots=slots), timeout=1.0)
        _paused_past_timeout(d, call, lambda: att.tensor.fill_(0xB2))  # type: ignore[union-attr]
        late = int((att.tensor.view(N, -1) != 0xB2).any(dim=1).sum())
        assert late <= 64, f"{late} of {N} slots written after the caller gave up"
    assert "Traceback" not in d.output()


def test_a_layer_group_load_its_caller_gave_up_on_writes_nothing_after_the_deadline(
        spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    """The same for LoadLayers (vLLM's layer-wise load): a registered pool of 64 segments, one
    group each; the stream paused past the caller's timeout went on group after group."""
    segs = 64
    d = spawn(args=serve_args(tmp_path, disk=tmp_path / "disk", pool_pages=N, cpu_pages=2 * N))
    with d.client("a") as c, grpc.insecure_channel(d.address) as ch:
        mem = SharedMemory(N * PAGE)
        kv = mem.tensor.view(segs, N, PAGE // segs)
        att = c.register(list(kv.unbind(0)), fds=[mem.fd] * segs)
        keys = [b"late-layers-%d" % i for i in range(N)]
        kv.fill_(0xA1)
        assert c.store(att, keys, list(range(N))) == N
        kv.fill_(0x00)
        ref = pb.PoolRef(tenant="a", pool_id=att.pool_id, instance=att.instance)
        stream = pb_grpc.KVTierStub(ch).LoadLayers(pb.LoadLayersRequest(
            pool=ref, keys=keys, slots=list(range(N)), segment_bounds=list(range(segs + 1))),
            timeout=1.0)  # a grpc.Future too: its result() raises once the stream has failed
        _paused_past_timeout(d, stream, lambda: kv.fill_(0xB2))
        late = int((kv != 0xB2).any(dim=2).sum())
        assert late <= N // 4, f"{late} of {N * segs} pieces written after the caller gave up"
        assert bool((kv[segs // 2 :] == 0xB2).all())
    assert "Traceback" not in d.output()


def test_a_store_its_caller_gave_up_on_is_never_a_hit(
        spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    """A Store paused past the caller's timeout, then resumed, went on copying the caller's
    slots after the caller had reused them: the keys held the new bytes (a later hit: wrong
    KV). Now a Store launches no copy once its caller is gone, and what it stored for a caller
    that gave up is dropped (counted ``abandoned``): those keys are misses."""
    d = spawn(args=serve_args(tmp_path, disk=tmp_path / "disk", pool_pages=N, cpu_pages=2 * N))
    with d.client("a") as c, grpc.insecure_channel(d.address) as ch:
        att, slots, keys, ref = _full_pool(c, b"gave-up")
        call = pb_grpc.KVTierStub(ch).Store.future(
            pb.StoreRequest(pool=ref, keys=keys, slots=slots), timeout=1.0)
        _paused_past_timeout(d, call, lambda: att.tensor.fill_(0xB2))  # type: ignore[union-attr]
        found = len(c.lookup(keys))
        if found:
            back = c.attach(8)
            page = c.allocate(back, 1)
            assert page is not None and back.tensor is not None
            for i in range(0, found, max(1, found // 16)):
                assert c.load(back, [keys[i]], [page[0][1]]) == 1
                assert bool((back.tensor[page[0][1]] == 0xA1).all()), f"key {i}: other bytes"
    assert "Traceback" not in d.output()
