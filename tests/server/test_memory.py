"""Memory no client can break and no tenant can name: clients that attack a real daemon.

Every pool (and every registered buffer) is a sealed memfd that travels over the session socket.
The clients here do what an attacker would: truncate or grow the descriptor they got, register
an unsealed memfd, a plain file or a path, and name another tenant's memory by ticket.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from kvtier.client import Attachment, KVTierClient
from kvtier.client.fdpass import Session
from kvtier.client.ipc import SharedMemory
from kvtier_daemon_fixture import PAGE, Daemon

from kvtier.errors import FailedPrecondition, NotFound
from kvtier.tiers import memfd
from kvtier.types import Tier
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

SLOTS = 4


def session(d: Daemon) -> Session:
    return Session(d.address[len("unix://"):] + ".fd")


def attach_raw(d: Daemon, tenant: str) -> pb.AttachReply:
    """Attach over plain gRPC: the reply's lease ticket is not redeemed yet."""
    with grpc.insecure_channel(d.address) as ch:
        return pb_grpc.KVTierStub(ch).Attach(
            pb.AttachRequest(tenant=tenant, num_pages=SLOTS), timeout=10)


def held_pool(d: Daemon, tenant: str, s: Session) -> tuple[Attachment, int]:
    """A pool whose memfd this test holds (as an attacking client would)."""
    reply = attach_raw(d, tenant)
    assert reply.handle.kind == pb.HANDLE_KIND_MEMFD and len(reply.lease.ticket) == 32
    fd = s.redeem(reply.lease.ticket, tenant)
    from kvtier.client.attachment import map_pool

    tensor = map_pool(reply.handle, reply.num_slots, reply.page_size, fd)
    att = Attachment(reply.pool_id, tenant, reply.page_size, reply.num_slots, reply.instance,
                     reply.handle.device, tensor, request=None)
    return att, fd


def register_raw(d: Daemon, tenant: str, seg: pb.Segment) -> grpc.RpcError:
    with grpc.insecure_channel(d.address) as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.KVTierStub(ch).Register(
            pb.RegisterRequest(tenant=tenant, segments=[seg]), timeout=10)
    return err.value


def assert_cannot_resize(fd: int) -> None:
    for size in (0, PAGE, 64 * SLOTS * PAGE):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size)
    with pytest.raises(PermissionError):
        os.posix_fallocate(fd, 0, 64 * SLOTS * PAGE)  # growing by allocation


def test_truncating_the_pool_fd_cannot_kill_the_daemon(spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    s = session(d)
    with d.client("evil") as c:
        att, fd = held_pool(d, "evil", s)
        got = c.allocate(att, 2)
        assert got is not None and att.tensor is not None
        for page, slot in got:
            att.tensor[slot].fill_(page % 200 + 1)
        ids = [p for p, _ in got]
        c.release(att, ids)
        assert_cannot_resize(fd)
        again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # a second open: the same sealed inode
        try:
            assert_cannot_resize(again)
            with pytest.raises(PermissionError):  # seals can't be lifted or changed
                fcntl.fcntl(again, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        finally:
            os.close(again)
        assert c.offload(att, ids) == 2  # the daemon reads every slot of the pool
        _wait_tier(c, att, ids, Tier.CPU)
        slots = c.acquire(att, ids)
        assert slots is not None
        for page, slot in zip(ids, slots, strict=True):
            assert bool((att.tensor[slot] == page % 200 + 1).all())
        assert d.proc.poll() is None
        os.close(fd)
    s.close()


def test_truncating_a_registered_memfd_cannot_kill_the_daemon(
        spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    mem = SharedMemory(SLOTS * PAGE)
    rows = mem.tensor.view(SLOTS, PAGE)
    with d.client("vllm") as c:
        att = c.register([rows], fds=[mem.fd])
        rows[1].fill_(7)
        assert_cannot_resize(mem.fd)
        assert c.store(att, [b"blk"], [1]) == 1  # the daemon reads the registered memory
        rows.zero_()
        assert c.load(att, [b"blk"], [2]) == 1
        assert bool((rows[2] == 7).all()) and d.proc.poll() is None
    mem.close()


def _unsealed(nbytes: int, seals: int) -> int:
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize("kind", ["no seals", "shrink only", "no seal-seal", "sealed too small",
                                  "write sealed", "hugetlb", "plain file", "pipe"])
def test_register_refuses_memory_that_is_not_a_sealed_memfd(
        spawn: Callable[..., Daemon], tmp_path: Path, kind: str) -> None:
    d = spawn()
    need = SLOTS * PAGE
    if kind == "plain file":
        fd = os.open(f"{tmp_path}/kv", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, need)
    elif kind == "pipe":
        fd, w = os.pipe()
        os.close(w)
    elif kind == "hugetlb":  # sealable, but a punched hole could SIGBUS the daemon later
        fd = os.memfd_create("huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
        os.ftruncate(fd, 2 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    else:
        all3 = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        seals = {"no seals": 0, "shrink only": fcntl.F_SEAL_SHRINK,
                 "no seal-seal": fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW,
                 "sealed too small": all3, "write sealed": all3 | fcntl.F_SEAL_WRITE}[kind]
        fd = _unsealed(need // 2 if kind == "sealed too small" else need, seals)
    t = torch.zeros(SLOTS, PAGE, dtype=torch.uint8)
    with d.client("vllm") as c:
        with pytest.raises(FailedPrecondition) as err:
            c.register([t], fds=[fd])
        assert str(err.value).startswith("segments[0].memfd_ticket: ")
        assert c.stats().pools == 0 and d.proc.poll() is None
    os.close(fd)


def test_register_by_path_is_not_a_thing(spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    with d.client("owner") as a:
        a.attach(SLOTS)
    # Field 2 of Segment used to be a /dev/shm path: now an unknown field, never read.
    base = pb.Segment(num_slots=SLOTS, slot_stride=PAGE, slot_bytes=PAGE).SerializeToString()
    path = b"/dev/shm/anything"
    seg = pb.Segment.FromString(base + b"\x12" + bytes([len(path)]) + path)
    err = register_raw(d, "intruder", seg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "segments[0]: set exactly one of ipc and memfd_ticket"


def test_another_tenant_cannot_name_a_pools_memory(spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    sa, sb = session(d), session(d)
    # A pool's ticket: B can't redeem it before A (bound to A's tenant), nor after (single use).
    reply = attach_raw(d, "alpha")
    with pytest.raises(FailedPrecondition):
        sb.redeem(reply.lease.ticket, "beta")
    fd = sa.redeem(reply.lease.ticket, "alpha")  # unaffected by B's attempt
    os.close(fd)
    for tenant in ("beta", "alpha"):
        with pytest.raises(FailedPrecondition):
            sb.redeem(reply.lease.ticket, tenant)
    with pytest.raises(FailedPrecondition):
        sb.redeem(secrets.token_bytes(32), "beta")  # guessing
    # Memory A deposited for Register: B can't register it by its ticket.
    mem = SharedMemory(SLOTS * PAGE)
    ticket = sa.deposit(mem.fd, "alpha")
    seg = pb.Segment(num_slots=SLOTS, slot_stride=PAGE, slot_bytes=PAGE, memfd_ticket=ticket)
    err = register_raw(d, "beta", seg)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("segments[0].memfd_ticket: ")
    with grpc.insecure_channel(d.address) as ch:  # A still can, once
        pb_grpc.KVTierStub(ch).Register(pb.RegisterRequest(tenant="alpha", segments=[seg]))
    assert register_raw(d, "alpha", seg).code() == grpc.StatusCode.FAILED_PRECONDITION
    # And by pool id B gets NOT_FOUND, as for every pool-scoped call.
    with KVTierClient(d.address, "beta") as b:
        att = Attachment(reply.pool_id, "alpha", PAGE, SLOTS, reply.instance, "cpu", None, None)
        for call in (lambda: b.store(att, [b"k"], [0]), lambda: b.load(att, [b"k"], [0])):
            with pytest.raises(NotFound):
                call()
    mem.close()
    sa.close()
    sb.close()


def test_pool_memory_is_no_file_and_kill_9_leaves_nothing(spawn: Callable[..., Daemon]) -> None:
    from kvtier.client._backend import as_backend
    from kvtier.client.block_mover import BlockMover, BlockTransfer
    from kvtier.client.block_rows import BlockRows

    d = spawn()
    with d.client("vllm") as c:
        kv = torch.arange(8 * PAGE, dtype=torch.int64).to(torch.uint8).view(8, PAGE)
        mover = BlockMover(as_backend(c), BlockRows([kv]), register=False, staging_slots=4)
        assert mover.store(BlockTransfer("r", [b"a", b"b"], [3, 5])) == 2
        c.attach(SLOTS)
        pid = d.proc.pid
        held = open_files(pid)
        with open(f"/proc/{pid}/maps") as fh:
            maps = fh.read()
        pools = {ino for h, ino in held if h.startswith("/memfd:kvtier-pool")}
        assert len(pools) == 2  # the staging pool and the attached one, as memfds
        assert "/memfd:kvtier-pool" in maps
        # Nothing the daemon holds or maps has a name another process could open or that
        # could outlive it: no /dev/shm file at all.
        assert not [h for h, _ in held if h.startswith("/dev/shm")]
        assert "/dev/shm" not in maps
    d.stop(signal.SIGKILL)


def open_files(pid: int) -> list[tuple[str, int]]:
    """(link target, inode) of each descriptor ``pid`` holds (ones closing meanwhile skipped)."""
    out = []
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append((os.readlink(f"/proc/{pid}/fd/{n}"), os.stat(f"/proc/{pid}/fd/{n}").st_ino))
        except FileNotFoundError:
            continue
    return out


def _wait_tier(c: KVTierClient, att: Attachment, ids: list[int], tier: Tier) -> None:
    import time

    deadline = time.monotonic() + 20
    while c.page_tiers(att, ids) != [tier] * len(ids):
        assert time.monotonic() < deadline, c.page_tiers(att, ids)
        time.sleep(0.05)


def test_tcp_clients_get_no_cpu_mode_memory(spawn: Callable[..., Daemon], tmp_path: Path
                                           ) -> None:
    from kvtier_daemon_fixture import free_port, serve_args

    port = free_port()
    token = f"{tmp_path}/token"
    with open(token, "w") as fh:
        fh.write("s3cret\n")
    args = serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=free_port())
    i = args.index("--listen")
    args[i + 1 : i + 2] = [args[i + 1], "--listen", f"127.0.0.1:{port}", "--token-file", token]
    d = spawn(args=args)
    with KVTierClient(f"127.0.0.1:{port}", "t", token="s3cret") as c:
        with pytest.raises(FailedPrecondition) as err:  # the memfd only travels on unix sockets
            c.attach(SLOTS)
        assert "unix://" in str(err.value)
    with d.client("t") as local:
        assert local.stats().pools == 0  # refused before a pool was made
        att = local.attach(SLOTS)
        assert att.tensor is not None and local.allocate(att, 1) is not None


def _maps(d: Daemon) -> int:
    return len(Path(f"/proc/{d.proc.pid}/maps").read_text().splitlines())


def test_segments_of_one_memfd_cost_the_daemon_one_mapping(
        spawn: Callable[..., Daemon]) -> None:
    """Each registered segment was its own memory mapping: 15 Registers of 4,096 tiny segments
    of one memfd (1 MiB in all) took the daemon to the kernel's map count, and every other
    tenant's Register and Attach failed (the Attach with INTERNAL and a traceback). Now a memfd
    is mapped once per Register, however many segments view it."""
    d = spawn()
    mem = SharedMemory(4096 * 4 * 64)
    flat = mem.tensor
    segs = [flat[i * 256 : (i + 1) * 256].view(4, 64) for i in range(4096)]
    with d.client("hog") as hog, d.client("other") as other:
        before = _maps(d)
        for i in range(4):
            flat.fill_(i)
            att = hog.register(segs, fds=[mem.fd] * len(segs))
            assert hog.store(att, [b"k%d" % i], [3]) == 1
        assert _maps(d) - before < 64, (before, _maps(d))  # was 4,096 a Register
        assert other.attach(SLOTS).num_slots == SLOTS
    assert "Traceback" not in d.output()


def test_registered_slots_are_a_bounded_share_of_the_daemons_memory(
        spawn: Callable[..., Daemon]) -> None:
    """A slot costs the daemon ~9 bytes of its own (page table, free flags) whoever owns the
    memory: Registers of a sparse 64 GiB memfd (2**24 slots, nothing touched) took ~147 MB of
    the daemon each, 64 pools a tenant and without bound across free tenant names. Now one
    tenant's pools hold at most a quarter of the daemon's slot budget (2**24), all at most
    2**26; past that, RESOURCE_EXHAUSTED naming num_slots, and the other tenants still register."""
    d = spawn()
    slots = 1 << 24
    fd = memfd.create(slots * 4096, "sparse")
    s = session(d)

    def register(tenant: str, n: int) -> pb.AttachReply:
        seg = pb.Segment(num_slots=n, slot_bytes=4096, slot_stride=4096,
                         memfd_ticket=s.deposit(fd, tenant))
        with grpc.insecure_channel(d.address) as ch:
            return pb_grpc.KVTierStub(ch).Register(
                pb.RegisterRequest(tenant=tenant, segments=[seg]), timeout=60)

    try:
        before = _rss_mib(d)
        assert register("hog", slots).num_slots == slots
        for _ in range(4):
            with pytest.raises(grpc.RpcError) as err:
                register("hog", slots)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "num_slots" in (err.value.details() or "")
        assert register("other", 4).num_slots == 4
        assert _rss_mib(d) - before < 400, "refused Registers kept the daemon's memory"
    finally:
        s.close()
        os.close(fd)
    assert "Traceback" not in d.output()


def _rss_mib(d: Daemon) -> float:
    for line in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_registered_memory_is_a_bounded_share_of_the_daemons_address_space(
        spawn: Callable[..., Daemon]) -> None:
    """Two slots 2**45 bytes apart in a sparse memfd: a Register counted as 2 slots of 64 KiB
    mapped 32 TiB of the daemon's 128 TiB of address space; four such (free tenant names) and
    another tenant's Attach could not map its pool. Now a tenant's registered pools map at most
    a quarter of 32 TiB, all at most 32 TiB: RESOURCE_EXHAUSTED naming segments."""
    d = spawn()
    fd = memfd.create((1 << 45) + PAGE, "sparse")
    s = session(d)

    def register(tenant: str, stride: int) -> pb.AttachReply:
        seg = pb.Segment(num_slots=2, slot_bytes=PAGE, slot_stride=stride,
                         memfd_ticket=s.deposit(fd, tenant))
        with grpc.insecure_channel(d.address) as ch:
            return pb_grpc.KVTierStub(ch).Register(
                pb.RegisterRequest(tenant=tenant, segments=[seg]), timeout=60)

    try:
        for i in range(5):
            with pytest.raises(grpc.RpcError) as err:
                register(f"far-{i}", 1 << 45)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "segments" in (err.value.details() or "")
        assert register("near", PAGE).num_slots == 2
        with d.client("victim") as victim:
            assert victim.attach(SLOTS).num_slots == SLOTS
    finally:
        s.close()
        os.close(fd)
    assert "Traceback" not in d.output()
