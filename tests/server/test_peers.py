"""What a peer without the token costs a daemon with a TCP listener (``server/interceptors.py``,
``server/app.py``): no request body is read before admission, Health Watch needs the token,
and a bad Health body is an INVALID_ARGUMENT, not a logged traceback. Real daemon, real TCP."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtier_daemon_fixture import (
    Daemon,
    free_port,
    health_status,
    serve_args,
    with_fd_limit,
)

from kvtier.errors import KVTierError
from kvtier.types import Tier
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"


@pytest.fixture
def tcp(spawn: Callable[..., Daemon], tmp_path: Path) -> tuple[Daemon, str]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    args = serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=free_port())
    i = args.index("--listen")
    unix = args[i + 1]
    args[i + 1] = f"{unix},127.0.0.1:{port}"
    d = spawn(args=[*args, "--token-file", str(token_file)], address=unix)
    return d, f"127.0.0.1:{port}"


def peak_rss_mib(d: Daemon) -> float:
    for line in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_peer_without_the_token_gets_no_body_read(tcp: tuple[Daemon, str]) -> None:
    """Bodies of up to the message limit (64 MiB) sent without the token were received and
    parsed in full before the token check refused them: a few such peers took the daemon's
    memory by gigabytes (and killed it under a memory limit). Now the call is refused before
    its body is read; unix peers (no token needed) and peers with the token are served."""
    d, addr = tcp
    keys = [bytes([i % 251]) * 64 for i in range(48 << 10)] * 16  # ~50 MiB of keys
    big = pb.LookupRequest(tenant="t", keys=keys)
    before = peak_rss_mib(d)
    codes: list[grpc.StatusCode] = []

    def attack() -> None:
        with grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", -1)]) as ch:
            for _ in range(3):
                try:
                    pb_grpc.KVTierStub(ch).Lookup(big, timeout=30)
                except grpc.RpcError as exc:
                    codes.append(exc.code())

    threads = [threading.Thread(target=attack) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 18
    # Bodies read and parsed (the same calls with the token): +1.1-1.3 GiB of peak RSS. Refused
    # unread: +20-230 MiB (gRPC's transport buffers what is in flight; 120 was passed in CI).
    assert peak_rss_mib(d) - before < 400, "the daemon read bodies it refused"
    with d.client("t") as c:  # a unix peer: read and served, unary and streamed replies
        assert c.lookup([b"nothing-stored"]) == []
        att = c.attach(2)
        got = c.allocate(att, 1)
        assert got is not None and att.tensor is not None
        att.tensor[got[0][1]].fill_(9)
        assert c.store(att, [b"block"], [got[0][1]]) == 1
        assert list(c.load_layers(att, [b"block"], [got[0][1]], [0, 1])) == [1]
        events = c.watch_events(att, duration=2.0)
        time.sleep(0.5)
        c.free(att, [got[0][0]])
        assert "freed" in {e.kind for e in events}
    with grpc.insecure_channel(addr) as ch:  # a peer with the token: served
        md = [("authorization", f"Bearer {TOKEN}")]
        reply = pb_grpc.KVTierStub(ch).Lookup(pb.LookupRequest(tenant="t", keys=[b"k"]),
                                              metadata=md, timeout=10)
        assert list(reply.tiers) == []  # nothing stored
        with pytest.raises(grpc.RpcError) as err:  # a malformed body, read once admitted
            ch.unary_unary("/kvtier.v1.KVTier/Lookup")(b"\xff\xff", metadata=md, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_check_is_open_its_watch_needs_the_token(tcp: tuple[Daemon, str]) -> None:
    """Check answers anyone (probes); Watch, a stream a peer could hold by the thousand, needs
    the token on TCP; a body Check can't parse is INVALID_ARGUMENT, with no traceback logged
    per call (a flood of them wrote ~44 MB a minute of log)."""
    d, addr = tcp
    assert health_status(addr) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(watch))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        md = [("authorization", f"Bearer {TOKEN}")]
        first = next(iter(stub.Watch(health_pb2.HealthCheckRequest(service=""), metadata=md,
                                     timeout=10)))
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        bad = ch.unary_unary("/grpc.health.v1.Health/Check")
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as err:
                bad(b"\x01\x02\x03", timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in d.output()


def test_a_call_cancelled_before_its_reply_leaves_nothing_held(
        spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    """An Acquire whose caller cancelled (closed the channel, or was killed) while the daemon
    restored its pages still pinned them all: pins nobody held, until the pool was detached (a
    retry stacked a second level). Now what such a call handed out is taken back (Acquire's
    pins, Allocate's pages, Attach's pool). (A call past its deadline: the engine waits no
    longer than the deadline, and a result the daemon has after it is taken back too; a reply
    the daemon sends just before its deadline can still reach a caller that gave up a moment
    earlier, the network's time apart.)"""
    end = "cancel"
    n = 256
    d = spawn(args=serve_args(tmp_path, disk=tmp_path / "disk", pool_pages=n, cpu_pages=2 * n))
    with d.client("a") as owner, grpc.insecure_channel(d.address) as ch:
        att = owner.attach(n)
        got = owner.allocate(att, n)
        assert got is not None
        ids = [p for p, _ in got]
        owner.release(att, ids)
        # The pool is full, so the watermarks may have queued its coldest fifth already
        # (52 of 256 in one CI run): offload queues the rest; all of them reach the CPU tier.
        assert 0 < owner.offload(att, ids) <= n
        deadline = time.monotonic() + 30
        while set(owner.page_tiers(att, ids)) != {Tier.CPU}:
            assert time.monotonic() < deadline, "the pages never reached the CPU tier"
            time.sleep(0.05)
        stub = pb_grpc.KVTierStub(ch)
        ref = pb.PoolRef(tenant="a", pool_id=att.pool_id, instance=att.instance)
        calls: list[tuple[Callable[..., object], object]] = [
            (stub.Acquire, pb.AcquireRequest(pool=ref, page_ids=ids, timeout_s=30)),
            (stub.Allocate, pb.AllocateRequest(pool=ref, count=1)),
            (stub.Attach, pb.AttachRequest(tenant="a", num_pages=4)),
        ]
        pools = owner.stats().pools
        for i, (method, request) in enumerate(calls):
            future = method.future(request, timeout=0.004 if end == "deadline" else 30)
            if end == "cancel":
                future.cancel()
            try:
                reply = future.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                continue
            assert i > 0, "the Acquire of 256 pages off the GPU answered within 4 ms"
            if isinstance(reply, pb.AllocateReply):  # it reached us: ours to give back
                stub.Free(pb.PagesRequest(pool=ref, page_ids=[p.page_id for p in reply.pages]))
            else:
                stub.Detach(pb.DetachRequest(pool=pb.PoolRef(
                    tenant="a", pool_id=reply.pool_id, instance=reply.instance)))
        # A reply the daemon sent before the cancel reached it is dropped by the caller's
        # channel, unknown to the daemon (8-14% of Attaches cancelled 0-4 ms after the call):
        # that pool's ticket expires unredeemed after 30 s, and the pool is detached then.
        deadline = time.monotonic() + 45
        while owner.stats().pinned_pages or owner.stats().pools != pools:
            assert time.monotonic() < deadline, (
                f"{owner.stats().pinned_pages} pages pinned, {owner.stats().pools} pools")
            time.sleep(0.1)
        time.sleep(1.0)  # and they stay so
        assert owner.stats().pinned_pages == 0 and owner.stats().pools == pools


def test_an_acquire_its_caller_saw_time_out_holds_no_pin(
        spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    """The caller's deadline passes before the daemon's (by the time the request took to
    arrive): an Acquire whose restore finished between the two was answered OK to a caller that
    had already raised DEADLINE_EXCEEDED, and its 92 pins stayed until the pool was detached
    (2 to 3 of 40 such calls). A result ready that close to its deadline is taken back now; no
    traceback either (aborting a call gRPC had just ended logged one)."""
    d = spawn(args=serve_args(tmp_path, disk=tmp_path / "disk", pool_pages=512, cpu_pages=8,
                              disk_pages=512, metrics_port=free_port()))
    with d.client("a") as owner, grpc.insecure_channel(d.address) as ch:
        att = owner.attach(96)
        got = owner.allocate(att, 92)
        assert got is not None
        ids = [p for p, _ in got]
        owner.release(att, ids)
        stub = pb_grpc.KVTierStub(ch)
        ref = pb.PoolRef(tenant="a", pool_id=att.pool_id, instance=att.instance)
        for i in range(40):
            owner.offload(att, ids)
            time.sleep(0.3)  # on disk (8 CPU pages): the restore takes a few ms
            try:
                stub.Acquire(pb.AcquireRequest(pool=ref, page_ids=ids),
                             timeout=0.0015 + 0.0035 * (i % 8) / 7)
                owner.release(att, ids)  # it was answered: ours to give back
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
            deadline = time.monotonic() + 5
            while pinned := owner.stats().pinned_pages:
                assert time.monotonic() < deadline, f"round {i}: {pinned} pinned"
                time.sleep(0.02)
    assert "Traceback" not in d.output()


def test_a_connection_flood_stays_within_a_share_of_the_descriptor_limit(
        spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    """Raw connections to the gRPC socket (an HTTP/2 preface each, no token or tenant needed)
    took a descriptor each up to the process limit: the daemon logged "File descriptor limit
    reached" in a loop and nothing could attach until keepalive dropped them (~40 s). Now the
    gRPC listeners take at most a quarter of the limit; open channels keep working; the
    daemon is itself again as soon as the flood ends."""
    limit = 512  # gRPC connections: 128
    d = spawn(args=with_fd_limit(serve_args(tmp_path, disk=tmp_path / "disk",
                                            metrics_port=free_port()), limit))
    fds = Path(f"/proc/{d.proc.pid}/fd")
    with d.client("owner") as owner:
        owner.stats()  # its channel is open
        base = len(list(fds.iterdir()))
        flood = []
        for _ in range(limit):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(d.address[len("unix://"):])
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            except OSError:
                s.close()
                continue
            flood.append(s)
        time.sleep(1.0)
        assert len(list(fds.iterdir())) - base <= limit // 4 + 8
        assert owner.stats().pools == 0  # an open channel is served
        for s in flood:
            s.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                with d.client("late", timeout=2) as late:
                    late.attach(2)
                break
            except (grpc.RpcError, KVTierError):
                assert time.monotonic() < deadline, "no new client served after the flood"
    assert "File descriptor limit reached" not in d.output() and d.proc.poll() is None
