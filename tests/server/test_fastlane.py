"""The fast lane against a real daemon: answers resident acquires/releases, defers the rest to
gRPC, and refuses anything without the pool's capability (changing nothing)."""

from __future__ import annotations

import os
import resource
import socket
import struct
import time
from typing import Any

import pytest
import torch
from kvtier_daemon_fixture import Daemon, free_port, serve_args

from server.fastlane import MAX_CONNS

REQUEST = struct.Struct("<BHQ16s")
REPLY = struct.Struct("<BH")


def raw(path: str, frame: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)  # a truncated frame then reads as EOF, not a stall
        return s.recv(64)


def frame(op: int, pool_id: int, cap: bytes, ids: list[int]) -> bytes:
    return REQUEST.pack(op, len(ids), pool_id, cap) + struct.pack(f"<{len(ids)}Q", *ids)


def lane_hits(c: Any) -> int:
    """A new pool's five acquire + release rounds of resident pages: how many took the lane."""
    mine = c.attach(4)
    pages = c.allocate(mine, 2)
    assert pages is not None and mine.fast_lane is not None
    ids = [p for p, _ in pages]
    c.release(mine, ids)
    hits = mine.fast_lane.hits
    for _ in range(5):
        c.acquire(mine, ids)
        c.release(mine, ids)
    c.detach(mine)
    return int(mine.fast_lane.hits - hits)


def test_resident_acquire_and_release_take_the_fast_lane(daemon: Daemon) -> None:
    with daemon.client("lane-a") as c:
        att = c.attach(8)
        assert att.fast_lane is not None and "capability" not in repr(att.fast_lane)
        got = c.allocate(att, 4)
        assert got is not None
        ids, slots = [p for p, _ in got], [s for _, s in got]
        c.release(att, ids)
        assert c.stats().pinned_pages == 0
        before = att.fast_lane.hits
        assert c.acquire(att, ids) == slots  # resident: the lane answers with the same slots
        assert c.stats().pinned_pages == 4
        c.release(att, ids)
        assert att.fast_lane.hits == before + 2 and c.stats().pinned_pages == 0
        c.detach(att)


def test_pages_off_the_gpu_fall_back_to_grpc_and_keep_their_bytes(daemon: Daemon) -> None:
    with daemon.client("lane-b") as c:
        att = c.attach(4)
        assert att.tensor is not None
        got = c.allocate(att, 4)
        ids = [p for p, _ in got]
        for i, (_, slot) in enumerate(got):
            att.tensor[slot].fill_(i + 1)
        c.release(att, ids)
        assert c.offload(att, ids) >= 3  # the 0.9 watermark may already be moving one
        hits = att.fast_lane.hits
        for i, pid in enumerate(ids):
            (slot,) = c.acquire(att, [pid])
            assert torch.all(att.tensor[slot] == i + 1)
            c.release(att, [pid])
        assert att.fast_lane.hits < hits + 8  # some acquires needed a restore: gRPC did them
        c.detach(att)


def test_wrong_or_foreign_capability_is_denied_and_changes_nothing(daemon: Daemon) -> None:
    with daemon.client("lane-c") as a, daemon.client("lane-d") as b:
        att_a, att_b = a.attach(4), b.attach(4)
        got = a.allocate(att_a, 2)
        ids = [p for p, _ in got]
        a.release(att_a, ids)
        path = att_a.fast_lane.path
        pinned = a.stats().pinned_pages
        assert REPLY.unpack(raw(path, frame(1, att_a.pool_id, b"\0" * 16, ids))[:3])[0] == 2
        foreign = att_b.fast_lane._capability  # b's secret, a's pool
        assert REPLY.unpack(raw(path, frame(1, att_a.pool_id, foreign, ids))[:3])[0] == 2
        assert a.stats().pinned_pages == pinned
        a.detach(att_a)
        own = att_a.fast_lane._capability
        assert REPLY.unpack(raw(path, frame(1, att_a.pool_id, own, ids))[:3])[0] == 2  # revoked
        b.detach(att_b)


def test_ids_no_page_can_have_are_sent_to_grpc_and_pin_nothing(daemon: Daemon) -> None:
    with daemon.client("lane-f") as c:
        att = c.attach(4)
        got = c.allocate(att, 2)
        ids = [p for p, _ in got]
        c.release(att, ids)
        path, cap = att.fast_lane.path, att.fast_lane._capability
        for bad in ([0], [1 << 63], [(1 << 64) - 1], [ids[0], 1 << 40]):
            for op in (1, 2):  # acquire, release
                reply = raw(path, frame(op, att.pool_id, cap, bad))
                assert REPLY.unpack(reply[:3]) == (1, 0), (op, bad)  # "use gRPC", no slots
        assert c.stats().pinned_pages == 0
        assert REPLY.unpack(raw(path, frame(1, att.pool_id, cap, ids))[:3]) == (0, 2)  # still OK
        c.detach(att)


def test_malformed_frames_close_the_connection_and_the_daemon_keeps_serving(daemon: Daemon) -> None:
    with daemon.client("lane-e") as c:
        att = c.attach(4)
        path = att.fast_lane.path
        assert raw(path, REQUEST.pack(1, 0, att.pool_id, b"\0" * 16)) == b""  # n = 0
        assert raw(path, REQUEST.pack(1, 60000, att.pool_id, b"\0" * 16)) == b""  # too many
        assert raw(path, b"\x01\x02") == b""  # truncated
        got = c.allocate(att, 1)
        assert got is not None and c.acquire(att, [got[0][0]]) is not None
        c.detach(att)


def test_the_asyncio_client_takes_the_fast_lane_too(daemon: Daemon) -> None:
    import asyncio

    from kvtier.client import AsyncKVTierClient

    async def scenario() -> None:
        async with AsyncKVTierClient(daemon.address, "lane-async") as c:
            att = await c.attach(4)
            got = await c.allocate(att, 3)
            assert got is not None
            ids, slots = [p for p, _ in got], [s for _, s in got]
            await c.release(att, ids)  # answered by the lane
            assert (await c.stats()).pinned_pages == 0
            assert await c.acquire(att, ids) == slots  # resident: the lane again
            assert (await c.stats()).pinned_pages == 3
            await c.release(att, ids)
            assert c.lane_hits() == 3
            assert await c.offload(att, ids) >= 2
            for pid in ids:  # off the GPU: gRPC restores, bytes of the right slot come back
                assert (await c.acquire(att, [pid])) is not None
                await c.release(att, [pid])
            await c.detach(att)

    asyncio.run(scenario())


def rpc_counts(daemon: Daemon) -> dict[str, float]:
    """kvtier_rpc_latency_seconds_count per method, scraped from the daemon's /metrics."""
    import urllib.request

    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvtier_rpc_latency_seconds_count{"):
            method = line.split('method="', 1)[1].split('"', 1)[0]
            out[method] = float(line.rsplit(" ", 1)[1])
    return out


def test_fast_lane_calls_are_counted_in_the_rpc_metrics(daemon: Daemon) -> None:
    with daemon.client("lane-metrics") as c:
        att = c.attach(4)
        ids = [p for p, _ in c.allocate(att, 2) or []]
        c.release(att, ids)
        before, hits = rpc_counts(daemon), att.fast_lane.hits
        for _ in range(25):
            c.acquire(att, ids)
            c.release(att, ids)
        after = rpc_counts(daemon)
        assert att.fast_lane.hits - hits == 50  # every call took the lane
        assert after.get("Acquire", 0) - before.get("Acquire", 0) == 25
        assert after.get("Release", 0) - before.get("Release", 0) == 25
        c.detach(att)


def test_a_connection_flood_is_capped_and_others_are_still_served(daemon: Daemon) -> None:
    """Connections opened and left idle are capped (descriptors), and at the cap they make way
    for a connection that sends a valid capability: a flood kept every new engine off the lane
    (each call then took gRPC, ~5x slower). Found by a tenant-isolation probe."""
    def fds() -> int:
        return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))

    with daemon.client("lane-f") as c:
        att = c.attach(4)
        got = c.allocate(att, 1)
        assert got is not None
        base = fds()
        flood = []
        for _ in range(MAX_CONNS + 200):  # opened and left idle
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(att.fast_lane.path)
            flood.append(s)
        time.sleep(1.0)
        assert fds() <= base + MAX_CONNS + 8  # the ones beyond the cap were closed
        assert c.acquire(att, [got[0][0]]) == [got[0][1]]  # gRPC serves what the lane can't
        # A new engine (its lane connection opened after the flood) still takes the lane: idle
        # connections that never sent a valid capability make way (they kept it off before).
        with daemon.client("lane-g") as g:
            assert lane_hits(g) == 10
        for s in flood:
            s.close()
        deadline = time.monotonic() + 20
        while fds() > base + 8:
            assert time.monotonic() < deadline, f"{fds()} descriptors, not ~{base}"
            time.sleep(0.1)
        c.detach(att)


def test_one_tenants_many_lane_connections_make_way_for_another_tenant(daemon: Daemon) -> None:
    """A tenant's own valid capability on more connections than the cap: at the cap the
    heaviest tenant's least recently used connection makes way, so another tenant's new
    engine still takes the lane."""
    with daemon.client("lane-heavy") as heavy, daemon.client("lane-light") as light:
        att = heavy.attach(4)
        got = heavy.allocate(att, 1)
        assert got is not None and att.fast_lane is not None
        heavy.release(att, [got[0][0]])
        # A release of a page not pinned: the capability is valid (the answer is "use gRPC",
        # not "denied") and nothing changes.
        hello = frame(2, att.pool_id, att.fast_lane._capability, [got[0][0]])
        flood = []
        for _ in range(MAX_CONNS + 50):  # each proves itself with a valid capability
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(att.fast_lane.path)
            try:
                s.sendall(hello)
                assert s.recv(64)[:1] in (b"", bytes([1]))  # use gRPC (or made way already)
            except OSError:
                pass  # closed to make room for a newer connection
            flood.append(s)
        assert lane_hits(light) == 10
        for s in flood:
            s.close()
        assert heavy.stats().pinned_pages == 0


def test_the_lane_keeps_to_its_share_of_a_low_descriptor_limit(
        spawn: Any, tmp_path: Any) -> None:
    """Under a hard limit of 1,024 descriptors, 1,100 idle lane connections (a fixed cap of
    1,024) took every descriptor: gRPC stopped accepting, and every engine's calls timed out.
    The lane now takes what the session socket takes: an eighth of the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip("this process can't open the flood")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    flood: list[socket.socket] = []
    try:
        argv = serve_args(tmp_path, disk=tmp_path / "disk", metrics_port=free_port())
        d = spawn(args=["sh", "-c", 'ulimit -n 1024 && exec "$@"', "sh", *argv])
        with d.client("lane-l") as c:
            att = c.attach(4)
            for _ in range(1100):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(att.fast_lane.path)
                flood.append(s)
            time.sleep(1.0)
            assert c.stats().pools == 1  # an engine already connected
            with d.client("another", timeout=5) as other:
                assert other.attach(4).num_slots == 4  # and a new one
    finally:
        for s in flood:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
