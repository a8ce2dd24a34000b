"""The fast lane comes back after it failed: a daemon restarted on the same socket (asyncio client,
whose lane outlives its pools) and a daemon that stalled past the timeout (both clients). A call
the lane may have done is never made again over gRPC: each stays exactly one pin level."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from kvtier.client import AsyncKVTierClient, Attachment, connect
from kvtier.client.fastlane import BACKOFF_FIRST
from kvtier_daemon_fixture import Daemon

from kvtier.errors import DeadlineExceeded, Unavailable

ROUNDS = 5  # acquire + release pairs, each answered by the lane


@contextmanager
def stalled(d: Daemon) -> Iterator[None]:
    """The daemon stopped (SIGSTOP): frames reach its socket but nothing answers them."""
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("call_while_down", [True, False])
def test_async_lane_is_used_again_after_a_restart_and_reattach(
        spawn: Callable[..., Daemon], call_while_down: bool) -> None:
    d = spawn()

    async def rounds(c: AsyncKVTierClient, att: Attachment, ids: list[int],
                     slots: list[int]) -> int:
        before = c.lane_hits()
        for _ in range(ROUNDS):
            assert await c.acquire(att, ids) == slots
            await c.release(att, ids)
        assert (await c.stats()).pinned_pages == 0  # every call done once
        return c.lane_hits() - before

    async def scenario() -> None:
        nonlocal d
        async with AsyncKVTierClient(d.address, "lane-restart", timeout=2.0) as c:
            att = await c.attach(4)
            got = await c.allocate(att, 2)
            assert got is not None
            ids, slots = [p for p, _ in got], [s for _, s in got]
            await c.release(att, ids)
            assert await rounds(c, att, ids, slots) == 2 * ROUNDS
            d.stop(signal.SIGKILL)
            if call_while_down:  # the lane fails (nothing sent), then gRPC reports the outage
                with pytest.raises(Unavailable):
                    await c.acquire(att, ids)
            d = spawn(disk=d.disk)  # same sockets, a new instance
            await c.wait_ready(10.0)
            fresh = await c.reattach(att)
            got = await c.allocate(fresh, 2)
            assert got is not None
            ids, slots = [p for p, _ in got], [s for _, s in got]
            await c.release(fresh, ids)
            assert await rounds(c, fresh, ids, slots) == 2 * ROUNDS

    asyncio.run(scenario())


def test_sync_lane_after_a_stall_did_the_call_once_and_is_used_again(
        spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    with connect(d.address, tenant="lane-stall", timeout=1.0) as c:
        att = c.attach(4)
        got = c.allocate(att, 1)
        assert got is not None and att.fast_lane is not None
        ids = [got[0][0]]
        c.release(att, ids)
        with stalled(d), pytest.raises(DeadlineExceeded, match="fast lane"):
            c.acquire(att, ids)  # sent, unanswered: not made again over gRPC
        assert wait_for(lambda: c.stats().pinned_pages == 1)  # the daemon did it late
        c.release(att, ids)
        assert c.stats().pinned_pages == 0  # one release undid it: it was pinned once
        time.sleep(BACKOFF_FIRST)
        hits = att.fast_lane.hits
        for _ in range(ROUNDS):
            assert c.acquire(att, ids) == [got[0][1]]
            c.release(att, ids)
        assert att.fast_lane.hits - hits == 2 * ROUNDS and c.stats().pinned_pages == 0


def test_async_lane_after_a_stall_did_the_call_once_and_is_used_again(
        spawn: Callable[..., Daemon]) -> None:
    d = spawn()

    async def pinned(c: AsyncKVTierClient) -> int:
        return int((await c.stats()).pinned_pages)

    async def scenario() -> None:
        async with AsyncKVTierClient(d.address, "lane-stall-async", timeout=1.0) as c:
            att = await c.attach(4)
            got = await c.allocate(att, 1)
            assert got is not None
            ids = [got[0][0]]
            await c.release(att, ids)
            with stalled(d), pytest.raises(DeadlineExceeded, match="fast lane"):
                await c.acquire(att, ids)
            deadline = time.monotonic() + 10
            while await pinned(c) != 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await pinned(c) == 1  # the daemon did it late, once
            await c.release(att, ids)
            assert await pinned(c) == 0
            await asyncio.sleep(BACKOFF_FIRST)
            hits = c.lane_hits()
            for _ in range(ROUNDS):
                assert await c.acquire(att, ids) == [got[0][1]]
                await c.release(att, ids)
            assert c.lane_hits() - hits == 2 * ROUNDS and await pinned(c) == 0

    asyncio.run(scenario())
