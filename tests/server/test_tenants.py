"""Tenant credentials, per-tenant quotas and per-tenant Stats against a real daemon subprocess.

With ``KVCACHED_OFFLOAD_TENANTS_FILE`` a call for tenant X needs X's token (metadata
``kvtier-tenant-token``): none or unknown is UNAUTHENTICATED, another tenant's is
PERMISSION_DENIED, and either way nothing changes. Stats shows a tenant its own view; the
daemon-wide view needs the admin token (or, without credentials, just the socket).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvtier.client import (
    KVTierClient,
    PermissionDenied,
    Unauthenticated,
    connect,
    connect_async,
)
from kvtier_daemon_fixture import PAGE, Daemon, daemon_env, serve_args, with_fd_limit

from kvtier.errors import CapacityError, FailedPrecondition
from kvtier.types import Tier
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

OK, UNAUTH = grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED
TOKENS = {"a": "token-of-a", "b": "token-of-b", "@admin": "token-of-admin"}
QUOTAS = f"a=gpu:{8 * PAGE},cpu:{4 * PAGE},disk:{16 * PAGE};b=cpu:{6 * PAGE},disk:{32 * PAGE}"


def tenants_file(tmp: Path, mode: int = 0o600) -> Path:
    path = tmp / "tenants"
    path.write_text("# tenant token\n" + "".join(f"{k} {v}\n" for k, v in TOKENS.items()))
    path.chmod(mode)
    return path


@pytest.fixture
def secured(spawn: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    env = daemon_env(KVCACHED_OFFLOAD_TENANTS_FILE=str(tenants_file(tmp_path)),
                     KVCACHED_OFFLOAD_TENANT_QUOTAS=QUOTAS)
    return spawn(env=env)


def client(d: Daemon, tenant: str, token: str | None) -> KVTierClient:
    return KVTierClient(d.address, tenant, timeout=20.0, tenant_token=token)


def raw(d: Daemon, method: str, request: object, token: str | None) -> grpc.StatusCode:
    """The status of one call made with the plain stub (OK when it succeeds)."""
    md = (("kvtier-tenant-token", token),) if token else ()
    with grpc.insecure_channel(d.address) as ch:
        try:
            reply = getattr(pb_grpc.KVTierStub(ch), method)(request, timeout=10, metadata=md)
            if method == "LoadLayers":  # a stream: its status comes with the replies
                list(reply)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def write(c: KVTierClient, att, keys: list[bytes], value: int) -> None:
    """Store ``keys`` through ``att`` (bytes ``value`` + position), a pool-full at a time."""
    for lo in range(0, len(keys), att.num_slots):
        part = keys[lo : lo + att.num_slots]
        got = c.allocate(att, len(part))
        assert got is not None
        for i, (_, slot) in enumerate(got):
            att.tensor[slot].fill_((value + lo + i) % 251)
        assert c.store(att, part, [s for _, s in got]) == len(part)
        c.free(att, [p for p, _ in got])


def exact(c: KVTierClient, att, keys: list[bytes], value: int) -> bool:
    got = c.allocate(att, len(keys))
    assert got is not None
    slots = [s for _, s in got]
    try:
        if c.load(att, keys, slots) != len(keys):
            return False
        return all(bool((att.tensor[s] == (value + i) % 251).all()) for i, s in enumerate(slots))
    finally:
        c.free(att, [p for p, _ in got])


def test_sighup_reloads_the_tenants_file_and_keeps_it_on_a_bad_one(secured: Daemon,
                                                                   tmp_path: Path) -> None:
    path = tmp_path / "tenants"
    path.write_text("a fresh-token-of-a\n@admin token-of-admin\n")
    secured.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while raw(secured, "Stats", pb.StatsRequest(tenant="a"), "fresh-token-of-a") != OK:
        assert time.monotonic() < deadline, secured.output()
        time.sleep(0.1)
    assert raw(secured, "Stats", pb.StatsRequest(tenant="a"), TOKENS["a"]) == UNAUTH
    assert raw(secured, "Stats", pb.StatsRequest(tenant="b"), TOKENS["b"]) == UNAUTH
    path.chmod(0o644)
    secured.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "not reloaded" not in secured.output():
        assert time.monotonic() < deadline, secured.output()
        time.sleep(0.1)
    assert secured.proc.poll() is None
    assert raw(secured, "Stats", pb.StatsRequest(tenant="a"), "fresh-token-of-a") == OK


def test_group_readable_tenants_file_stops_the_start(tmp_path: Path) -> None:
    env = daemon_env(KVCACHED_OFFLOAD_TENANTS_FILE=str(tenants_file(tmp_path, 0o640)))
    argv = serve_args(tmp_path, disk=tmp_path / "disk")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines  # one line from the start-up checks, not a traceback
    assert "KVCACHED_OFFLOAD_TENANTS_FILE" in lines[0] and "0640" in lines[0]
    assert "serving" not in done.stdout + done.stderr


def test_every_call_needs_the_tenants_own_token(secured: Daemon) -> None:
    with client(secured, "a", TOKENS["a"]) as a:
        att = a.attach(4)
        keys = [b"k0", b"k1"]
        write(a, att, keys, 9)
        got = a.allocate(att, 2)
        assert got is not None
        pages = [p for p, _ in got]
        ref = pb.PoolRef(tenant="a", pool_id=att.pool_id, instance=att.instance)
        calls = {
            "Attach": pb.AttachRequest(tenant="a", num_pages=1),
            "Detach": pb.DetachRequest(pool=ref),
            "Allocate": pb.AllocateRequest(pool=ref, count=1),
            "Free": pb.PagesRequest(pool=ref, page_ids=pages),
            "Release": pb.PagesRequest(pool=ref, page_ids=pages),
            "Acquire": pb.AcquireRequest(pool=ref, page_ids=pages),
            "Offload": pb.PagesRequest(pool=ref, page_ids=pages),
            "PageTiers": pb.PagesRequest(pool=ref, page_ids=pages),
            "Store": pb.StoreRequest(pool=ref, keys=[b"new"], slots=[got[0][1]]),
            "Lookup": pb.LookupRequest(tenant="a", keys=keys),
            "Load": pb.LoadRequest(pool=ref, keys=keys, slots=[s for _, s in got]),
            "LoadLayers": pb.LoadLayersRequest(pool=ref, keys=keys, slots=[s for _, s in got],
                                               segment_bounds=[0, 1]),
            "Stats": pb.StatsRequest(tenant="a"),
        }
        for method, request in calls.items():
            assert raw(secured, method, request, None) == grpc.StatusCode.UNAUTHENTICATED, method
            assert raw(secured, method, request, "nope") == grpc.StatusCode.UNAUTHENTICATED
            denied = grpc.StatusCode.PERMISSION_DENIED
            assert raw(secured, method, request, TOKENS["b"]) == denied, method
            admin = grpc.StatusCode.OK if method == "Stats" else denied  # it may read a view
            assert raw(secured, method, request, TOKENS["@admin"]) == admin, method
        # nothing changed: the pool, its pinned pages and its keys are as they were
        view = a.stats()
        assert (view.pools, view.pinned_pages, view.keyed_pages) == (1, 2, 2)
        assert a.page_tiers(att, pages) == [Tier.GPU, Tier.GPU]
        assert a.lookup([b"new"]) == [] and exact(a, att, keys, 9)
        with pytest.raises(PermissionDenied):
            client(secured, "a", TOKENS["b"]).attach(1)
        with pytest.raises(Unauthenticated):
            client(secured, "b", None).lookup(keys)
        stream = client(secured, "a", TOKENS["b"]).watch_events(duration=2)
        with pytest.raises(PermissionDenied):
            next(stream)


def test_both_clients_send_the_token(secured: Daemon, tmp_path: Path) -> None:
    token_file = tmp_path / "token-b"
    token_file.write_text(TOKENS["b"] + "\n")
    with connect(secured.address, tenant="b", tenant_token_file=str(token_file)) as b:
        assert b.attach(1).num_slots == 1

    async def run() -> int:
        async with connect_async(secured.address, tenant="b", tenant_token=TOKENS["b"]) as c:
            return int((await c.stats()).pools)

    assert asyncio.run(run()) == 1


def test_fast_lane_capability_comes_only_with_an_authenticated_attach(secured: Daemon) -> None:
    with grpc.insecure_channel(secured.address) as ch:
        stub = pb_grpc.KVTierStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Attach(pb.AttachRequest(tenant="a", num_pages=1), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.Attach(pb.AttachRequest(tenant="a", num_pages=2), timeout=10,
                            metadata=(("kvtier-tenant-token", TOKENS["a"]),))
        assert reply.fast_lane.path and len(reply.fast_lane.capability) == 16
    with client(secured, "@admin", TOKENS["@admin"]) as admin:
        assert admin.stats(whole=True).pools == 1  # the refused attach made none


def test_stats_shows_a_tenant_its_own_view(secured: Daemon, tmp_path: Path) -> None:
    with client(secured, "a", TOKENS["a"]) as a, client(secured, "b", TOKENS["b"]) as b:
        att_a, att_b = a.attach(4), b.attach(2)
        write(a, att_a, [b"a0", b"a1", b"a2"], 1)
        assert b.allocate(att_b, 1) is not None
        mine = a.stats()
        assert (mine.pools, mine.tenants, mine.keyed_pages, mine.pinned_pages) == (1, 1, 3, 0)
        cpu = next(t for t in mine.tiers if t.tier == pb.TIER_CPU)
        assert (cpu.used_bytes, cpu.capacity_bytes) == (3 * PAGE, 4 * PAGE)  # its quota
        theirs = b.stats()
        assert (theirs.pools, theirs.keyed_pages, theirs.pinned_pages) == (1, 0, 1)
        assert sum(m.pages for m in theirs.moved) == 0  # a's stores are not b's moves
        with pytest.raises(PermissionDenied):
            a.stats(whole=True)
        with client(secured, "@admin", TOKENS["@admin"]) as admin:
            whole = admin.stats(whole=True)
            assert (whole.pools, whole.tenants, whole.keyed_pages) == (2, 2, 3)
        admin_file = tmp_path / "admin-token"
        admin_file.write_text(TOKENS["@admin"] + "\n")
        status = [sys.executable, "-m", "kvtier.cli", "status", "--address", secured.address,
                  "--json"]
        env = dict(os.environ)
        refused = subprocess.run(status, capture_output=True, text=True, env=env, timeout=60)
        assert refused.returncode == 1 and "refused" in refused.stderr
        shown = subprocess.run([*status, "--tenant-token-file", str(admin_file)],
                               capture_output=True, text=True, env=env, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["pools"] == 2
        a_file = tmp_path / "a-token"
        a_file.write_text(TOKENS["a"] + "\n")
        own = subprocess.run([*status, "--tenant", "a", "--tenant-token-file", str(a_file)],
                             capture_output=True, text=True, env=env, timeout=60)
        assert own.returncode == 0, own.stderr
        assert (json.loads(own.stdout)["pools"], json.loads(own.stdout)["keyed_pages"]) == (1, 3)


def test_attach_over_quota_names_only_the_tenants_own_quota(secured: Daemon) -> None:
    with client(secured, "a", TOKENS["a"]) as a, client(secured, "b", TOKENS["b"]) as b:
        a.attach(8)
        with pytest.raises(CapacityError) as err:
            a.attach(1)
        text = str(err.value)
        assert "'a'" in text and f"{8 * PAGE} B" in text and "free" not in text
        with pytest.raises(CapacityError) as err:
            b.attach(1000)  # past the daemon's budget: says so, reveals no free bytes
        assert "budget" in str(err.value) and "free" not in str(err.value)
        assert " B of " not in str(err.value)
        assert b.attach(8).num_slots == 8  # b is not charged for a's pools


def test_a_flooding_tenant_does_not_evict_its_neighbour(secured: Daemon) -> None:
    with client(secured, "a", TOKENS["a"]) as a, client(secured, "b", TOKENS["b"]) as b:
        att_a, att_b = a.attach(8), b.attach(6)
        mine = [f"b{i}".encode() for i in range(6)]  # b's CPU quota, exactly
        write(b, att_b, mine, 40)
        write(a, att_a, [f"a{i}".encode() for i in range(2600)], 7)  # the issue: 160x the tier
        assert b.lookup(mine) == [Tier.CPU] * 6
        assert exact(b, att_b, mine, 40)
        view = a.stats()
        used = {t.tier: t.used_bytes for t in view.tiers}
        assert used[pb.TIER_CPU] <= 4 * PAGE and used[pb.TIER_DISK] <= 16 * PAGE
        assert view.drops["tenant_quota"] > 0 and dict(b.stats().drops) == {}


def test_without_credentials_the_socket_is_the_boundary(daemon: Daemon) -> None:
    """No tenants file: any tenant name is accepted (as before); Stats is still per tenant
    unless the daemon-wide view is asked for (what ``kvtier status`` does over the socket)."""
    with daemon.client("solo-x") as x, daemon.client("solo-y") as y:
        x.attach(2)
        y.attach(2)
        assert x.stats().pools == 1 and x.stats().tenants == 1
        assert x.stats(whole=True).pools >= 2
        done = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "status", "--address", daemon.address, "--json"],
            capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["pools"] >= 2


def test_one_tenant_cannot_take_every_session(spawn: Callable[..., Daemon],
                                              tmp_path: Path) -> None:
    """A tenant holding each of its pools (one 4 KiB page each, well within its quota) on a
    session of its own filled the session socket's connection cap, and every other tenant's
    attach then failed: its session connection was reset. A client holds all its pools on one
    session, so a tenant's sessions holding pools now stop at a quarter of the cap (the
    redeem is REFUSED, naming why), and the other tenants still attach."""
    from kvtier.client.fdpass import Session

    limit = 512  # session connections: 64; one tenant's sessions holding pools: 16
    argv = with_fd_limit(serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=0), limit)
    env = daemon_env(KVCACHED_OFFLOAD_TENANTS_FILE=str(tenants_file(tmp_path)),
                     KVCACHED_OFFLOAD_MAX_POOLS_PER_TENANT="100")
    d = spawn(args=argv, env=env)
    md = [("kvtier-tenant-token", TOKENS["a"])]
    sessions, refused = [], 0
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.KVTierStub(ch)
        for _ in range(70):
            r = stub.Attach(pb.AttachRequest(tenant="a", num_pages=1, page_size=4096),
                            metadata=md, timeout=20)
            s = Session(r.lease.path)
            try:
                os.close(s.redeem(r.lease.ticket, "a"))
                sessions.append(s)
            except FailedPrecondition as exc:
                assert "a quarter of the daemon's session connections" in str(exc)
                refused += 1
                s.close()
    assert (len(sessions), refused) == (16, 54)
    with client(d, "b", TOKENS["b"]) as b:  # another tenant still gets a session and a pool
        att = b.attach(2)
        assert att.tensor is not None and b.allocate(att, 1) is not None
    for s in sessions:
        s.close()
    assert d.proc.poll() is None


def test_registered_pools_count_toward_the_session_shares(spawn: Callable[..., Daemon],
                                                          tmp_path: Path) -> None:
    """A Register binds its pool to the session that deposited its memory, and that bypassed
    the shares: pools registered one per session under 16 made-up tenant names held every
    session connection, and every new client's redeem then failed. Now such a session counts
    toward its tenant's quarter and its client user's half of the cap (RESOURCE_EXHAUSTED
    past them), so half the connections always stay for other users."""
    from kvtier.client.fdpass import Session
    from kvtier.client.ipc import SharedMemory

    limit = 512  # session connections: 64; per tenant 16, per client user 32
    argv = with_fd_limit(serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=0), limit)
    d = spawn(args=argv)
    mem = SharedMemory(4 * 4096)
    path = d.address[len("unix://"):] + ".fd"
    held: list[Session] = []
    codes: dict[str, list[str]] = {}
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.KVTierStub(ch)
        for i in range(48):
            tenant = f"evil{i % 4}"
            s = Session(path)
            seg = pb.Segment(memfd_ticket=s.deposit(mem.fd, tenant), num_slots=4,
                             slot_stride=4096, slot_bytes=4096)
            try:
                stub.Register(pb.RegisterRequest(tenant=tenant, segments=[seg]), timeout=20)
                held.append(s)
                codes.setdefault(tenant, []).append("OK")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                assert "sessions holding pools" in (err.details() or "")
                codes.setdefault(tenant, []).append("refused")
                s.close()
    assert len(held) == 32  # the user's half of the 64 connections
    assert all(c.count("OK") <= 16 for c in codes.values())  # each tenant's quarter
    for s in held:
        s.close()
    assert d.proc.poll() is None and "Traceback" not in d.output()
