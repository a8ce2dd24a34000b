"""The Stats RPC carries each direction's measured batch cost (rate, fixed latency): the daemon's
shared lanes' cost, the same in every view; the totals behind it only in the daemon-wide view."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from kvtier.client import Attachment, KVTierClient, PermissionDenied
from kvtier_daemon_fixture import Daemon, daemon_env

from kvtier.v1 import kvtier_pb2 as pb

DIRECTIONS = ("gpu_to_cpu", "cpu_to_gpu")
TOKENS = {"a": "token-of-a", "@admin": "token-of-admin"}


@pytest.fixture
def secured(spawn: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    """A daemon with tenant credentials: the global view needs the admin token."""
    path = tmp_path / "tenants"
    path.write_text("".join(f"{k} {v}\n" for k, v in TOKENS.items()))
    path.chmod(0o600)
    return spawn(env=daemon_env(KVCACHED_OFFLOAD_TENANTS_FILE=str(path)))


def client(d: Daemon, tenant: str) -> KVTierClient:
    return KVTierClient(d.address, tenant, timeout=20.0, tenant_token=TOKENS[tenant])


def churn(c: KVTierClient, att: Attachment, rounds: int) -> None:
    """Write more pages than the pool holds, then touch them all: moves both ways."""
    pages = []
    for r in range(rounds):
        got = c.allocate(att, att.num_slots)
        assert got is not None and att.tensor is not None
        for page, slot in got:
            att.tensor[slot].fill_((page + r) % 251)
        c.release(att, [p for p, _ in got])
        pages += [p for p, _ in got]
    for page in pages:
        assert c.acquire(att, [page]) is not None
        c.release(att, [page])


def costs(reply: pb.StatsReply) -> dict[str, tuple[float, float]]:
    return {m.direction: (m.bytes_per_s, m.latency_s) for m in reply.moved}


def settled(whole: Callable[[], pb.StatsReply], own: Callable[[], pb.StatsReply]
            ) -> tuple[pb.StatsReply, pb.StatsReply]:
    """A tenant's view read between two equal daemon-wide ones (no batch ended meanwhile)."""
    for _ in range(50):
        before, mine, after = whole(), own(), whole()
        if costs(before) == costs(after):
            return after, mine
    raise AssertionError("the measured costs never held still across three Stats calls")


def test_stats_carry_each_directions_measured_rate(daemon: Daemon) -> None:
    with daemon.client("rates") as c, daemon.client("rates-idle") as idle:
        att = c.attach(8)
        try:
            churn(c, att, 3)
            whole, own = settled(lambda: c.stats(whole=True), c.stats)
            whole_then, nothing = settled(lambda: c.stats(whole=True), idle.stats)
        finally:
            c.detach(att)
    moved = {m.direction: m for m in whole.moved}
    mine = {m.direction: m for m in own.moved}
    for d in DIRECTIONS:
        m = moved[d]
        assert m.batches > 0 and 0 < m.bytes_per_s < math.inf, d
        assert m.latency_s >= 0 and m.latency_s < m.seconds
        # The tenant's own totals, the daemon's cost; what counts everyone's batches stays out.
        assert mine[d].pages > 0 and mine[d].bytes > 0
        assert (mine[d].batches, mine[d].seconds, mine[d].failures) == (0, 0, 0)
    assert costs(own) == costs(whole)
    # A tenant with nothing in the daemon sees the lanes' cost too, and no traffic.
    assert costs(nothing) == costs(whole_then)
    assert all(m.pages == m.bytes == m.batches == 0 for m in nothing.moved)


def test_a_credentialed_tenant_sees_the_cost_but_not_the_global_view(secured: Daemon) -> None:
    with client(secured, "a") as a, client(secured, "@admin") as admin:
        att = a.attach(4)
        try:
            churn(a, att, 3)
            whole, own = settled(lambda: admin.stats(whole=True), a.stats)
            with pytest.raises(PermissionDenied):
                a.stats(whole=True)
        finally:
            a.detach(att)
    assert all(costs(whole)[d][0] > 0 for d in DIRECTIONS)
    assert costs(own) == costs(whole)
    assert own.queued_restores == own.queued_offloads == own.inflight_bytes == 0
    assert all(m.batches == 0 and m.seconds == 0 for m in own.moved)
