"""The Stats RPC carries each direction's measured batch cost (rate, fixed latency) in the
daemon-wide view, and only there."""

from __future__ import annotations

import math

from kvtier.client import Attachment, KVTierClient
from kvtier_daemon_fixture import Daemon


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


def test_stats_carry_each_directions_measured_rate(daemon: Daemon) -> None:
    with daemon.client("rates") as c:
        att = c.attach(8)
        try:
            churn(c, att, 3)
            whole = {m.direction: m for m in c.stats(whole=True).moved}
            own = {m.direction: m for m in c.stats().moved}
        finally:
            c.detach(att)
    for d in ("gpu_to_cpu", "cpu_to_gpu"):
        m = whole[d]
        assert m.batches > 0 and 0 < m.bytes_per_s < math.inf, d
        assert m.latency_s >= 0 and m.latency_s < m.seconds
        assert own[d].pages > 0 and own[d].bytes_per_s == own[d].latency_s == 0
