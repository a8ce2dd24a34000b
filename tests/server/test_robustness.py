"""Malformed and hostile requests get the right status, change nothing, and the daemon keeps
serving; concurrent clients account every page exactly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier_daemon_fixture import Daemon

from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

S = grpc.StatusCode
TENANT = "robust"
OTHER = "someone-else"


class World:
    """One tenant with one pool holding pinned and unpinned pages, plus a detached pool."""

    def __init__(self, daemon: Daemon) -> None:
        self.channel = grpc.insecure_channel(daemon.address)
        self.stub = pb_grpc.KVTierStub(self.channel)
        att = self.stub.Attach(pb.AttachRequest(tenant=TENANT, num_pages=8), timeout=10)
        self.pool, self.instance = att.pool_id, att.instance
        got = self.stub.Allocate(pb.AllocateRequest(pool=self.ref(), count=4), timeout=10)
        self.pages = [p.page_id for p in got.pages]
        self.stub.Release(pb.PagesRequest(pool=self.ref(), page_ids=self.pages[:2]), timeout=10)
        gone = self.stub.Attach(pb.AttachRequest(tenant=TENANT, num_pages=2), timeout=10)
        self.stub.Detach(pb.DetachRequest(pool=self.ref(gone.pool_id)), timeout=10)
        self.detached = gone.pool_id

    def ref(self, pool: int | None = None, tenant: str = TENANT, instance: str | None = None
            ) -> pb.PoolRef:
        return pb.PoolRef(tenant=tenant, pool_id=self.pool if pool is None else pool,
                          instance=self.instance if instance is None else instance)

    def state(self) -> tuple[Any, ...]:
        s = self.stub.Stats(pb.StatsRequest(tenant=TENANT), timeout=10)
        tiers = tuple((t.tier, t.used_bytes, t.pages) for t in s.tiers)
        return tiers, s.pools, s.pinned_pages, s.keyed_pages


@pytest.fixture(scope="module")
def world(daemon: Daemon) -> World:
    return World(daemon)


PAGE_METHODS = ("Free", "Release", "Offload", "Prefetch", "PageTiers")
BIG = st.integers(min_value=10_000, max_value=2**62)
NEG = st.integers(min_value=-(2**62), max_value=-1)


def bad_request(draw: Callable[..., Any], w: World) -> tuple[str, Any, grpc.StatusCode]:
    """(method, request, expected status) for one malformed or hostile call."""
    kind = draw(st.sampled_from([
        "unknown_pool", "negative_pool", "empty_tenant", "wrong_tenant", "detached_pool",
        "stale_instance", "unknown_page", "negative_page", "no_pages", "huge_count",
        "bad_count", "bad_priority", "bad_keys", "slot_mismatch", "attach_bad_size",
        "attach_empty_tenant", "attach_too_big", "lookup_empty_tenant", "missing_pool",
    ]))
    method = draw(st.sampled_from(PAGE_METHODS))
    page = w.pages[0]
    if kind == "unknown_pool":
        return method, pb.PagesRequest(pool=w.ref(draw(BIG)), page_ids=[page]), S.NOT_FOUND
    if kind == "negative_pool":
        return method, pb.PagesRequest(pool=w.ref(draw(NEG)), page_ids=[page]), S.INVALID_ARGUMENT
    if kind == "empty_tenant":
        return method, pb.PagesRequest(pool=w.ref(tenant=""), page_ids=[page]), S.INVALID_ARGUMENT
    if kind == "wrong_tenant":
        tenant = draw(st.text(st.characters(codec="ascii", categories=["L", "N"]),
                              min_size=1, max_size=20).filter(lambda t: t != TENANT))
        return method, pb.PagesRequest(pool=w.ref(tenant=tenant), page_ids=[page]), S.NOT_FOUND
    if kind == "detached_pool":
        return "Acquire", pb.AcquireRequest(pool=w.ref(w.detached), page_ids=[1]), S.NOT_FOUND
    if kind == "stale_instance":
        req = pb.PagesRequest(pool=w.ref(instance="0" * 32), page_ids=[page])
        return method, req, S.FAILED_PRECONDITION
    if kind == "unknown_page":
        return "Acquire", pb.AcquireRequest(pool=w.ref(), page_ids=[draw(BIG)]), S.NOT_FOUND
    if kind == "negative_page":
        return method, pb.PagesRequest(pool=w.ref(), page_ids=[draw(NEG)]), S.INVALID_ARGUMENT
    if kind == "no_pages":
        return method, pb.PagesRequest(pool=w.ref()), S.INVALID_ARGUMENT
    if kind == "huge_count":
        req = pb.AllocateRequest(pool=w.ref(), count=draw(st.integers(1 << 16 + 1, 2**62)))
        return "Allocate", req, S.INVALID_ARGUMENT
    if kind == "bad_count":
        req = pb.AllocateRequest(pool=w.ref(), count=draw(st.integers(-(2**62), 0)))
        return "Allocate", req, S.INVALID_ARGUMENT
    if kind == "bad_priority":
        prio = draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf")]))
        req = pb.SetPriorityRequest(pool=w.ref(), page_ids=[page], priority=prio)
        return "SetPriority", req, S.INVALID_ARGUMENT
    if kind == "bad_keys":
        keys = draw(st.sampled_from([[], [b""], [b"x" * 65]]))
        return "Store", pb.StoreRequest(pool=w.ref(), keys=keys, slots=[0] * len(keys)), \
            S.INVALID_ARGUMENT
    if kind == "slot_mismatch":
        return "Load", pb.LoadRequest(pool=w.ref(), keys=[b"a", b"b"], slots=[0]), \
            S.INVALID_ARGUMENT
    if kind == "attach_bad_size":
        size = draw(st.sampled_from([{"num_pages": -1}, {"num_pages": 0}, {"bytes": -5}, {}]))
        return "Attach", pb.AttachRequest(tenant=TENANT, **size), S.INVALID_ARGUMENT
    if kind == "attach_empty_tenant":
        return "Attach", pb.AttachRequest(tenant="", num_pages=1), S.INVALID_ARGUMENT
    if kind == "attach_too_big":
        return "Attach", pb.AttachRequest(tenant=TENANT, num_pages=1 << 20), \
            S.RESOURCE_EXHAUSTED
    if kind == "lookup_empty_tenant":
        return "Lookup", pb.LookupRequest(tenant="", keys=[b"k"]), S.INVALID_ARGUMENT
    return method, pb.PagesRequest(page_ids=[page]), S.INVALID_ARGUMENT  # missing_pool


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_bad_requests_get_the_right_status_and_change_nothing(world: World, data: Any) -> None:
    method, req, expected = bad_request(data.draw, world)
    before = world.state()
    with pytest.raises(grpc.RpcError) as err:
        getattr(world.stub, method)(req, timeout=10)
    assert err.value.code() == expected, (method, req, err.value.details())
    if expected == S.INVALID_ARGUMENT:
        assert ":" in (err.value.details() or ""), "message must name the field"
    assert world.state() == before


def test_daemon_still_serves_after_abuse(world: World) -> None:
    slots = world.stub.Acquire(pb.AcquireRequest(pool=world.ref(), page_ids=world.pages[:1]),
                               timeout=10)
    assert len(slots.slots) == 1
    world.stub.Release(pb.PagesRequest(pool=world.ref(), page_ids=world.pages[:1]), timeout=10)


def test_concurrent_clients_account_pages_exactly(daemon: Daemon) -> None:
    workers, rounds = 4, 25
    errors: list[BaseException] = []
    kept: dict[int, int] = {}
    lock = threading.Lock()

    def work(i: int) -> None:
        try:
            with daemon.client(f"hammer-{i}") as c:
                att = c.attach(4)
                assert att.tensor is not None
                live: list[int] = []
                for r in range(rounds):
                    got = c.allocate(att, 2)
                    assert got is not None
                    for page, slot in got:
                        att.tensor[slot].fill_((page + i) % 251)
                    c.release(att, [p for p, _ in got])
                    live += [p for p, _ in got]
                    if r % 3 == 2:
                        c.free(att, live[:2])
                        del live[:2]
                for page in live[-3:]:
                    slot = c.acquire(att, [page])
                    assert slot is not None
                    assert bool((att.tensor[slot[0]] == (page + i) % 251).all())
                    c.release(att, [page])
                with lock:
                    kept[i] = len(live)
        except BaseException as exc:
            errors.append(exc)

    s = daemon.client("x").stats(whole=True)
    base, base_pinned = sum(t.pages for t in s.tiers), s.pinned_pages
    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    deadline = time.monotonic() + 10
    while True:  # moves may still be settling; the total is exact once they do
        s = daemon.client("x").stats(whole=True)
        total = sum(t.pages for t in s.tiers) - base
        if total == sum(kept.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert total == sum(kept.values())
    assert s.pinned_pages == base_pinned  # every pin released
