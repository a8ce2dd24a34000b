"""Page events for watchers (the daemon's WatchEvents stream).

Contract: ``EventHub.publish`` never blocks the engine: each subscription has a bounded queue and
a slow subscriber loses events (counted in ``dropped``), never the engine's time: the oldest of
the pool with the most queued, so one tenant's burst on its pools can't push another's events
out (a tenant freeing 16,384 pages made another's 160 frees vanish from its stream); the
subscriber gets the pools' events in turn, each pool's in order.
A subscriber that must not poll (the daemon's event loop) sets ``waker``: it is called, on the
publishing thread, after each event is queued, and must only schedule work (never block).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.types import PageId, PoolId, Tier


@dataclass(slots=True, frozen=True)
class Event:
    kind: str  # "moved" | "dropped" | "freed"
    pool_id: PoolId | None
    page_id: PageId
    src: Tier | None
    dst: Tier | None


class EventSubscription:
    """A bounded queue of events, fair between pools (see the module docstring). ``get(timeout)``
    returns ``None`` on timeout or after close."""

    def __init__(self, hub: EventHub, maxsize: int) -> None:
        self._hub = hub
        self._max = max(1, maxsize)
        self._cond = threading.Condition()
        self._pools: dict[PoolId | None, deque[Event]] = {}  # in turn: the next to give first
        self._size = 0
        self.dropped = 0
        self.closed = False
        self.waker: Callable[[], None] | None = None

    def put(self, event: Event) -> None:
        with self._cond:
            if self._size >= self._max:  # the pool with the most queued loses its oldest
                heavy = max(self._pools, key=lambda p: len(self._pools[p]))
                self._take(heavy)
                self.dropped += 1
            self._pools.setdefault(event.pool_id, deque()).append(event)
            self._size += 1
            self._cond.notify()
        if self.waker is not None:
            self.waker()

    def _take(self, pool: PoolId | None) -> Event:
        """The oldest event of ``pool``; the pool's turn passes to the next (lock held)."""
        events = self._pools.pop(pool)
        event = events.popleft()
        if events:
            self._pools[pool] = events  # to the back of the turns
        self._size -= 1
        return event

    def get(self, timeout: float | None = None) -> Event | None:
        with self._cond:
            if not self._size and not self.closed:
                self._cond.wait(timeout)
            return self._take(next(iter(self._pools))) if self._size else None

    def drain(self, limit: int) -> list[Event]:
        """Up to ``limit`` queued events, without waiting, the pools' in turn."""
        with self._cond:
            return [self._take(next(iter(self._pools)))
                    for _ in range(min(limit, self._size))]

    def close(self) -> None:
        if not self.closed:
            with self._cond:
                self.closed = True
                self._cond.notify_all()  # wakes a blocked get()
            self._hub.unsubscribe(self)


class EventHub:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: list[EventSubscription] = []

    def subscribe(self, maxsize: int = 1024) -> EventSubscription:
        sub = EventSubscription(self, maxsize)
        with self._lock:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: EventSubscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    @property
    def active(self) -> bool:
        """Anyone subscribed: callers on hot paths skip building events otherwise."""
        return bool(self._subs)

    def publish(self, event: Event) -> None:
        if not self._subs:  # the common case: nobody watching costs one check
            return
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub.put(event)

    def close(self) -> None:
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub.close()
