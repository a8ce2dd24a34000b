"""The public client against a real daemon: restart handling, the asyncio client, error mapping."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import grpc
import pytest
from kvtier.client import AsyncKVTierClient, Unauthenticated, connect
from kvtier.client.errors import from_rpc_error
from kvtier_daemon_fixture import Daemon

from kvtier.errors import (
    CapacityError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVTierError,
    NotFound,
    PageLost,
    Unavailable,
)


def test_restart_is_reported_and_reattach_recovers(spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    c = connect(d.address, tenant="restart", timeout=2.0)
    att = c.attach(4)
    got = c.allocate(att, 1)
    assert got is not None
    d.stop(signal.SIGKILL)
    with pytest.raises(Unavailable):
        c.stats()
    spawn(disk=d.disk)
    c.wait_ready(10.0)
    restarted = r"pool \d+ is not attached \(daemon restarted\?\)"
    with pytest.raises(FailedPrecondition, match=restarted):
        c.allocate(att, 1)
    fresh = c.reattach(att)
    assert fresh.instance != att.instance and fresh.num_slots == att.num_slots
    again = c.allocate(fresh, 1)
    assert again is not None and fresh.tensor is not None
    fresh.tensor[again[0][1]].fill_(9)
    c.close()


def test_allocate_shortfall_is_none_not_an_error(spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    with d.client("short") as c:
        att = c.attach(2)
        assert c.allocate(att, 2) is not None  # pinned: nothing left to evict
        assert c.allocate(att, 1) is None
        with pytest.raises(CapacityError):
            c.attach(1 << 20)


def test_async_client_round_trip(spawn: Callable[..., Daemon]) -> None:
    d = spawn()

    async def scenario() -> None:
        async with AsyncKVTierClient(d.address, "async-tenant") as c:
            await c.wait_ready()
            att = await c.attach(4)
            got = await c.allocate(att, 2)
            assert got is not None and att.tensor is not None
            for page, slot in got:
                att.tensor[slot].fill_(page)
            await c.release(att, [p for p, _ in got])
            assert await c.offload(att, [p for p, _ in got]) == 2  # released: both queued
            slots = await c.acquire(att, [p for p, _ in got], timeout=5.0)
            assert slots is not None
            for (page, _), slot in zip(got, slots, strict=True):
                assert bool((att.tensor[slot] == page).all())
            await c.release(att, [p for p, _ in got])
            assert (await c.stats()).pools >= 1
            with pytest.raises(NotFound):
                await c.free(att, [10_000])
            await c.detach(att)

    asyncio.run(scenario())


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(("code", "cls"), [
    (grpc.StatusCode.NOT_FOUND, NotFound),
    (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, CapacityError),
    (grpc.StatusCode.UNAVAILABLE, Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
    (grpc.StatusCode.DATA_LOSS, PageLost),
    (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
    (grpc.StatusCode.INTERNAL, KVTierError),
])
def test_status_codes_map_back_to_error_classes(code: grpc.StatusCode, cls: type) -> None:
    err = from_rpc_error(_Err(code, "pool 3 not found"))
    assert type(err) is cls
    assert "pool 3 not found" in str(err)


def test_invalid_argument_keeps_the_field() -> None:
    err = from_rpc_error(_Err(grpc.StatusCode.INVALID_ARGUMENT, "count: must be 1..65536"))
    assert isinstance(err, InvalidArgument) and err.field == "count"
