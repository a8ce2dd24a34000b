"""WatchEvents streams: one engine subscription for all of them, fanned out per tenant on the loop.

An open stream is a coroutine parked on an ``asyncio.Event``: no thread, no timer, no poll, so
idle streams cost other callers nothing. Flow: an engine thread publishes → the hub's one
``EventSubscription`` queues the event and its waker schedules the pump on the event loop (once
per burst) → the pump drains a batch, asks the engine on a worker thread who owns the batch's
pools (one thread hop per batch, none while idle) → each event goes to the open streams of the
owning tenant (and pool filter) → each stream's coroutine yields it.

Contract:
  * at most ``per_tenant`` open streams per tenant and ``MAX_WATCHES`` in all; one more is a
    CapacityError (RESOURCE_EXHAUSTED) and opens nothing;
  * a stream sees only events of pools its tenant owns when the event is delivered;
  * a stream's backlog is bounded (``STREAM_BACKLOG``): a slow reader loses its oldest events
    (counted in ``Watch.dropped``), never the engine's time;
  * while the daemon drains every stream ends; the engine subscription exists only while a
    stream is open (the engine builds no events otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from kvtier.errors import CapacityError
from kvtier.state.events import Event

log = logging.getLogger(__name__)
MAX_WATCHES = 1024  # open streams of all tenants together
STREAM_BACKLOG = 1024  # events queued per stream before its oldest are dropped
HUB_BACKLOG = 8192  # events queued between the engine and the pump
BATCH = 1024  # events per pump step (one owner lookup)


class Watch:
    """One open stream's queue. ``next()`` waits without polling; ``None`` once ended."""

    __slots__ = ("_ended", "_items", "_ready", "dropped", "pool_id", "tenant")

    def __init__(self, tenant: str, pool_id: int) -> None:
        self.tenant, self.pool_id = tenant, pool_id
        self.dropped = 0
        self._items: deque[Event] = deque(maxlen=STREAM_BACKLOG)
        self._ready = asyncio.Event()
        self._ended = False

    def offer(self, event: Event) -> None:
        if len(self._items) == STREAM_BACKLOG:
            self.dropped += 1  # the deque drops the oldest
        self._items.append(event)
        self._ready.set()

    def end(self) -> None:
        self._ended = True
        self._ready.set()

    async def next(self) -> Event | None:
        while not self._items:
            if self._ended:
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class _Waker:
    """Called on engine threads: schedules one ``wake.set()`` on the loop per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
        self._loop, self._wake = loop, wake
        self._pending = False

    def __call__(self) -> None:
        if self._pending:
            return
        self._pending = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is stopping
            self._loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        self._pending = False
        self._wake.set()


class WatchHub:
    """Owns the open streams (loop thread only) and the pump that feeds them."""

    def __init__(self, engine: Any, owner: Callable[[int], str | None], executor: Executor,
                 draining: asyncio.Event, per_tenant: int) -> None:
        self._engine, self._owner, self._executor = engine, owner, executor
        self._draining, self._per_tenant = draining, per_tenant
        self._by_tenant: dict[str, set[Watch]] = {}
        self._count = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def open(self, tenant: str, pool_id: int) -> Watch:
        mine = self._by_tenant.get(tenant, set())
        if len(mine) >= self._per_tenant:
            raise CapacityError(f"this tenant has {len(mine)} open WatchEvents streams, the most "
                                f"allowed (KVCACHED_OFFLOAD_MAX_WATCHES); close one first")
        if self._count >= MAX_WATCHES:
            raise CapacityError(f"the daemon has {MAX_WATCHES} open WatchEvents streams; "
                                f"retry later")
        watch = Watch(tenant, pool_id)
        self._by_tenant.setdefault(tenant, set()).add(watch)
        self._count += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._pump())
        return watch

    def close(self, watch: Watch) -> None:
        mine = self._by_tenant.get(watch.tenant)
        if mine is None or watch not in mine:
            return
        mine.discard(watch)
        self._count -= 1
        if not mine:
            del self._by_tenant[watch.tenant]
        if not self._by_tenant:
            self._wake.set()  # the pump sees nobody left and drops the engine subscription

    @property
    def open_count(self) -> int:
        return self._count

    async def _pump(self) -> None:
        sub = self._engine.subscribe(HUB_BACKLOG)
        sub.waker = _Waker(asyncio.get_running_loop(), self._wake)
        drained = asyncio.ensure_future(self._draining.wait())
        try:
            while self._by_tenant and not self._draining.is_set():
                woke = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait((woke, drained), return_when=asyncio.FIRST_COMPLETED)
                woke.cancel()
                self._wake.clear()
                events = sub.drain(BATCH)
                if events:
                    await self._deliver(events)
                if len(events) == BATCH:
                    self._wake.set()  # more are queued
        except Exception:
            log.exception("event fan-out failed; ending every WatchEvents stream")
            self._end_all()
        finally:
            sub.close()
            drained.cancel()
        if self._draining.is_set():
            self._end_all()

    async def _deliver(self, events: list[Event]) -> None:
        pools = {int(e.pool_id) for e in events if e.pool_id is not None}
        loop = asyncio.get_running_loop()
        owners = await loop.run_in_executor(self._executor,
                                            lambda: {p: self._owner(p) for p in pools})
        for event in events:
            tenant = owners.get(int(event.pool_id)) if event.pool_id is not None else None
            for watch in self._by_tenant.get(tenant, ()) if tenant is not None else ():
                if not watch.pool_id or watch.pool_id == event.pool_id:
                    watch.offer(event)

    def _end_all(self) -> None:
        for watches in self._by_tenant.values():
            for watch in watches:
                watch.end()
