"""Calls of one tenant at once (``server/turns.py``): on their own, and on a real daemon whose
one tenant has many slow calls in flight."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.server.turns import Turns
from kvtier_daemon_fixture import Daemon, daemon_env, serve_args


def test_a_tenant_runs_at_most_its_share_and_others_go_at_once() -> None:
    async def main() -> None:
        turns = Turns(2)
        release = asyncio.Event()
        order: list[int] = []

        async def call(tenant: str, i: int) -> None:
            async with turns.turn(tenant):
                order.append(i)
                await release.wait()

        tasks = [asyncio.create_task(call("a", i)) for i in range(5)]
        await asyncio.sleep(0.01)
        assert turns.running("a") == 2 and order == [0, 1]
        other = asyncio.create_task(call("b", 99))
        await asyncio.sleep(0.01)
        assert 99 in order  # another tenant does not wait behind "a"
        release.set()
        await asyncio.gather(*tasks, other)
        assert order == [0, 1, 99, 2, 3, 4]  # "a" in the order its calls came
        assert turns.running("a") == 0 and not turns._tenants  # nothing kept for names

    asyncio.run(main())


def test_one_tenants_many_slow_calls_do_not_queue_another_tenant(
        spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    """Eighty Loads of blocks on disk at once from one tenant held every worker thread, and a
    neighbour's Stats waited behind ~50 of them. With at most CALLS_PER_TENANT of a tenant's
    calls running, the neighbour is answered while most of them are still to come."""
    args = serve_args(tmp_path, disk=tmp_path / "disk", pool_pages=64, cpu_pages=8,
                      disk_pages=512)
    d = spawn(args=args, env=daemon_env(KVCACHED_OFFLOAD_CALLS_PER_TENANT="8"))
    with d.client("a") as a, d.client("b") as b:
        att = a.attach(64)
        got = a.allocate(att, 64)
        assert got is not None
        slots = [s for _, s in got]
        keys = [f"k{i}".encode() for i in range(64)]
        assert a.store(att, keys, slots) == 64
        done: list[float] = []

        def load() -> None:
            a.load(att, keys, slots)
            done.append(time.monotonic())

        threads = [threading.Thread(target=load) for _ in range(80)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        asked = time.monotonic()
        b.stats()
        answered = time.monotonic()
        for t in threads:
            t.join()
        # Loads that ended while b's Stats waited: ~50 behind which it queued, on the old
        # code. (Not all those ended before it: fast loads, disk copies kept since, finish ~40
        # in the 0.3 s before it is even asked.)
        during = sum(asked <= t < answered for t in done)
        assert len(done) == 80 and during < 40, f"{during} of a's 80 loads ended during b's Stats"
