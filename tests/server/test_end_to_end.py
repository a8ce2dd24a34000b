"""Two engines (two tenants) on one real daemon: pressure moves pages down, Acquire restores."""

from __future__ import annotations

import time

import pytest
from kvtier.client import Attachment, KVTierClient
from kvtier_daemon_fixture import Daemon

from kvtier.errors import NotFound
from kvtier.types import Tier


def fill(c: KVTierClient, att: Attachment, n: int, salt: int) -> dict[int, int]:
    """Allocate ``n`` pages, write a byte pattern into each, release them; page -> byte."""
    got = c.allocate(att, n)
    assert got is not None
    assert att.tensor is not None
    written = {}
    for page, slot in got:
        value = (page * 7 + salt) % 251
        att.tensor[slot].fill_(value)
        written[page] = value
    c.release(att, list(written))
    return written


def verify(c: KVTierClient, att: Attachment, written: dict[int, int]) -> None:
    assert att.tensor is not None
    for page, value in written.items():
        slots = c.acquire(att, [page])
        assert slots is not None
        row = att.tensor[slots[0]]
        assert bool((row == value).all()), f"page {page} bytes differ"
        c.release(att, [page])


def moved(c: KVTierClient) -> dict[str, int]:
    return {m.direction: m.pages for m in c.stats().moved}


def test_two_tenants_survive_pressure(daemon: Daemon) -> None:
    with daemon.client("alpha") as a, daemon.client("beta") as b:
        pa, pb = a.attach(8), b.attach(8)
        assert pa.tensor is not None and tuple(pa.tensor.shape) == (8, pa.page_size)
        wa: dict[int, int] = {}
        wb: dict[int, int] = {}
        for i in range(3):  # 24 pages per 8-slot pool: evictions to CPU, then to disk
            wa |= fill(a, pa, 8, salt=i)
            wb |= fill(b, pb, 8, salt=100 + i)
        before = moved(a)
        assert before["gpu_to_cpu"] > 0
        assert before["cpu_to_disk"] > 0
        verify(a, pa, wa)
        verify(b, pb, wb)
        after = moved(a)
        assert after["cpu_to_gpu"] > before["cpu_to_gpu"]
        assert after["disk_to_cpu"] > before["disk_to_cpu"]
        a.detach(pa)
        b.detach(pb)


def test_tenant_cannot_touch_another_tenants_pool(daemon: Daemon) -> None:
    with daemon.client("owner") as a, daemon.client("intruder") as b:
        pa = a.attach(4)
        pages = fill(a, pa, 2, salt=1)
        page = next(iter(pages))
        calls = [
            lambda: b.acquire(pa, [page]), lambda: b.free(pa, [page]),
            lambda: b.release(pa, [page]), lambda: b.allocate(pa, 1),
            lambda: b.offload(pa, [page]), lambda: b.prefetch(pa, [page]),
            lambda: b.set_priority(pa, [page], 2.0), lambda: b.store(pa, [b"k"], [0]),
            lambda: b.load(pa, [b"k"], [0]), lambda: b.detach(pa),
        ]
        for call in calls:
            with pytest.raises(NotFound) as err:
                call()
            assert str(err.value) == f"pool {pa.pool_id} not found"
        verify(a, pa, pages)  # untouched
        a.detach(pa)


def test_store_lookup_load_is_per_tenant(daemon: Daemon) -> None:
    with daemon.client("kv-a") as a, daemon.client("kv-b") as b:
        pa = a.attach(4)
        assert pa.tensor is not None
        got = a.allocate(pa, 2)
        assert got is not None
        for i, (_, slot) in enumerate(got):
            pa.tensor[slot].fill_(40 + i)
        keys = [b"block-0", b"block-1"]
        assert a.store(pa, keys, [s for _, s in got]) == 2
        a.release(pa, [p for p, _ in got])
        assert len(a.lookup([*keys, b"missing"])) == 2
        assert all(isinstance(t, Tier) for t in a.lookup(keys))
        assert b.lookup(keys) == []  # another tenant never sees them: a miss, not an error
        a.free(pa, [p for p, _ in got])
        fresh = a.allocate(pa, 2)
        assert fresh is not None
        slots = [s for _, s in fresh]
        pa.tensor[slots].fill_(0)
        assert a.load(pa, keys, slots) == 2
        for i, slot in enumerate(slots):
            assert bool((pa.tensor[slot] == 40 + i).all())
        a.detach(pa)


def test_watch_events_sees_only_own_pools(daemon: Daemon) -> None:
    with daemon.client("watch-a") as a, daemon.client("watch-b") as b:
        pa, pb = a.attach(4), b.attach(4)
        stream = a.watch_events(duration=5.0)
        time.sleep(0.3)  # let the subscription open before the events happen
        b.free(pb, list(fill(b, pb, 4, salt=3)))
        pages = fill(a, pa, 4, salt=4)
        a.free(pa, list(pages))
        seen = []
        for ev in stream:
            seen.append(ev)
            assert ev.pool_id == pa.pool_id
            if ev.kind == "freed":
                break
        assert any(ev.kind == "freed" for ev in seen), seen
        a.detach(pa)
        b.detach(pb)


def tiers_until(c: KVTierClient, att: Attachment, pages: list[int], want: list[Tier],
                timeout: float = 10.0) -> list[Tier | None]:
    deadline = time.monotonic() + timeout
    got = c.page_tiers(att, pages)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.02)
        got = c.page_tiers(att, pages)
    return got


def test_page_tiers_follow_the_pages(daemon: Daemon) -> None:
    with daemon.client("tiers") as c:
        att = c.attach(8)
        written = fill(c, att, 3, salt=5)
        pages = list(written)
        assert c.page_tiers(att, pages) == [Tier.GPU] * 3
        assert c.offload(att, pages[:2]) == 2
        assert tiers_until(c, att, pages, [Tier.CPU, Tier.CPU, Tier.GPU]) == [
            Tier.CPU, Tier.CPU, Tier.GPU]
        verify(c, att, written)  # Acquire restores them
        assert c.page_tiers(att, pages) == [Tier.GPU] * 3
        with pytest.raises(NotFound):
            c.page_tiers(att, [*pages, 10**9])
        c.detach(att)
