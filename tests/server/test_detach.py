"""Detach while the pool's keyed copies are under way, on a real daemon (sealed memfds, a real
CPU tier full of another tenant's blocks): a stored key holds the pool's bytes or is a miss."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from kvtier.client import Attachment, KVTierClient
from kvtier.client.ipc import SharedMemory
from kvtier_daemon_fixture import PAGE, Daemon, daemon_env

from kvtier.errors import NotFound
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

BLOCK = 1 << 20
N = 128  # blocks: the whole CPU tier


def registered(c: KVTierClient, fill: int) -> tuple[SharedMemory, object]:
    mem = SharedMemory(N * BLOCK)
    mem.tensor.fill_(fill)
    return mem, c.register([mem.tensor.view(N, BLOCK)], fds=[mem.fd])


def test_a_detach_during_a_store_never_stores_stale_bytes(
        spawn: Callable[..., Daemon]) -> None:
    """A Store's copies out of a registered pool ran after a Detach had closed the pool: they
    copied nothing and counted as done, so its keys held whatever their recycled CPU slots held
    before: here the victim's whole blocks, which the attacker then loaded as hits."""
    env = daemon_env()
    env.update(KVCACHED_OFFLOAD_BATCH_MB="64", KVCACHED_OFFLOAD_PINNED_CHUNK_MB="64",
               KVCACHED_OFFLOAD_MAX_INFLIGHT_MB="512")
    d = spawn(cpu_pages=N * BLOCK // PAGE, disk_pages=4 * N * BLOCK // PAGE, env=env)
    with d.client("victim") as v, d.client("attacker") as a:
        _, pool = registered(v, 0xBB)
        assert v.store(pool, [b"secret%d" % i for i in range(N)], list(range(N))) == N
        for trial in range(3):
            fill = 0x11 + trial
            _, mine = registered(a, fill)
            keys = [b"mine%d-%d" % (trial, i) for i in range(N)]
            stored: list[object] = []

            def store(mine: object = mine, keys: list[bytes] = keys,
                      out: list[object] = stored) -> None:
                try:
                    out.append(a.store(mine, keys, list(range(N))))
                except NotFound as exc:  # the Detach came first
                    out.append(exc)

            th = threading.Thread(target=store)
            th.start()
            a.detach(mine)
            th.join()
            mem, fresh = registered(a, 0)
            got = a.load(fresh, keys, list(range(N)))
            blocks = mem.tensor.view(N, BLOCK)[:got]
            assert bool((blocks == fill).all()), (
                f"trial {trial}: {got} blocks loaded, "
                f"{int((blocks == 0xBB).all(dim=1).sum())} of them the victim's")
            a.detach(fresh)
    assert "Traceback" not in d.output()


def _offloading(c: KVTierClient, n: int = 128) -> Attachment:
    """A pool whose ``n`` pages are on their way to the CPU tier (a Detach waits for them)."""
    att = c.attach(n)
    ids = [p for p, _ in c.allocate(att, n)]
    c.release(att, ids)
    c.offload(att, ids)
    return att


def test_nothing_new_comes_out_of_a_pool_being_detached(spawn: Callable[..., Daemon]) -> None:
    """An Allocate that arrived while a Detach waited for the pool's moves was granted: pinned
    pages the Detach then waited for, forever (while the client stayed)."""
    d = spawn(pool_pages=1024, cpu_pages=2048)
    with d.client("t", timeout=30) as c:
        for _ in range(8):  # the Allocate lands while the Detach waits in most rounds
            att = _offloading(c, 1024)  # 64 MiB on its way: the Detach waits for some ms
            done: list[object] = []
            th = threading.Thread(target=lambda att=att, done=done: done.append(c.detach(att)))
            th.start()
            time.sleep(0.005)
            try:
                got = c.allocate(att, 4)
            except NotFound:
                got = None
            th.join(20)
            assert done == [None], "the Detach never returned"
            if got is not None:  # it came before the Detach: freed with the pool
                assert len(got) == 4
        assert c.stats().pools == 0 and c.stats().pinned_pages == 0


def test_two_detaches_of_one_pool_answer_once_and_not_found(
        spawn: Callable[..., Daemon]) -> None:
    """Both passed the lookup before either removed the pool; the second then failed with
    INTERNAL (a KeyError and a traceback in the daemon's log)."""
    d = spawn(pool_pages=256, cpu_pages=512)
    with d.client("t", timeout=30) as c:
        for _ in range(4):
            att = _offloading(c)
            out: list[str] = []

            def detach(att: Attachment = att, out: list[str] = out) -> None:
                try:
                    c.detach(att)
                    out.append("ok")
                except NotFound:
                    out.append("not found")

            threads = [threading.Thread(target=detach) for _ in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(20)
            assert sorted(out) == ["not found", "ok"], out
    assert "Traceback" not in d.output()


def test_pools_attached_and_detached_without_redeeming_leave_no_descriptors(
        spawn: Callable[..., Daemon]) -> None:
    """Each Attach's ticket held a copy of the pool's memfd until it expired (30 s), Detach or
    not: a client attaching and detaching in a loop without redeeming held the daemon's
    descriptors by the thousand. Now a Detach closes its pool's unredeemed ticket."""
    d = spawn(pool_pages=64, cpu_pages=64)
    fds = Path(f"/proc/{d.proc.pid}/fd")
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.KVTierStub(ch)
        stub.Detach(pb.DetachRequest(pool=_attached(stub)), timeout=10)  # warm
        before = len(list(fds.iterdir()))
        for _ in range(200):
            stub.Detach(pb.DetachRequest(pool=_attached(stub)), timeout=10)
        assert len(list(fds.iterdir())) < before + 20
    assert "Traceback" not in d.output()


def _attached(stub: pb_grpc.KVTierStub) -> pb.PoolRef:
    reply = stub.Attach(pb.AttachRequest(tenant="t", num_pages=4), timeout=10)
    assert reply.lease.ticket  # issued, never redeemed
    return pb.PoolRef(tenant="t", pool_id=reply.pool_id, instance=reply.instance)
