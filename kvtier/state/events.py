"""Page events for watchers (the daemon's WatchEvents stream).

Contract: ``EventHub.publish`` never blocks the engine: each subscription has a bounded queue and
a slow subscriber loses its oldest events (counted in ``dropped``), never the engine's time.
A subscriber that must not poll (the daemon's event loop) sets ``waker``: it is called, on the
publishing thread, after each event is queued, and must only schedule work (never block).
"""

from __future__ import annotations

import queue
import threading
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
    """A bounded queue of events. ``get(timeout)`` returns ``None`` on timeout or after close."""

    def __init__(self, hub: EventHub, maxsize: int) -> None:
        self._hub = hub
        self._queue: queue.Queue[Event | None] = queue.Queue(maxsize)
        self.dropped = 0
        self.closed = False
        self.waker: Callable[[], None] | None = None

    def put(self, event: Event) -> None:
        while True:
            try:
                self._queue.put_nowait(event)
                if self.waker is not None:
                    self.waker()
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def get(self, timeout: float | None = None) -> Event | None:
        if self.closed and self._queue.empty():
            return None
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self, limit: int) -> list[Event]:
        """Up to ``limit`` queued events, without waiting (the close marker is skipped)."""
        out: list[Event] = []
        while len(out) < limit:
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                break
            if event is not None:
                out.append(event)
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._hub.unsubscribe(self)
            self.put(None)  # type: ignore[arg-type]  # wakes a blocked get()


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
