"""Write-behind to a keyed medium: a bounded queue drained by its own threads.

Contract:
    * ``offer(items, owner) -> int`` never blocks on the medium: it queues ``(name, payload)``
      items of one owner (a tenant) while their bytes fit in ``max_bytes`` and drops (and
      counts, reason ``queue_full``) the rest; it returns how many were queued. The queue is
      fair between owners (``kvtier/tiers/fairqueue.py``): when it is full, the owner with the
      most bytes queued loses its newest items first (counted ``queue_full`` and reported to
      ``on_drop``), so a flooding tenant cannot keep a light one's blocks out, and the writers
      take the owners' items in turn.
    * Each of ``threads`` writer threads takes up to ``batch_bytes`` (at most a quarter of
      ``max_bytes``) at a time, turns each item
      into a ``(store key, value)`` with ``encode`` (framing and MAC happen here, off the
      caller's path) and writes the batch with one ``put_many``; items the medium did not
      write are dropped and counted (reason ``store``), and a batch not wholly written is
      reported to ``on_drop`` (the medium does not say which items it wrote). Nothing is
      retried: a later Store of the same block writes it again.
    * ``flush(timeout) -> bool``: waits until everything offered so far is written or dropped.
      ``close(timeout)``: stops taking items, drains what is queued within ``timeout``, then drops
      the rest (counted ``closed``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.tiers.fairqueue import FairQueue
from kvtier.tiers.keyed import KeyedMedium

Payload = bytes | bytearray | memoryview
Encode = Callable[[bytes, Any], tuple[bytes, Payload]]


@dataclass(slots=True)
class WriteCounters:
    pages: int = 0
    bytes: int = 0  # value bytes written (framed: header and MAC included)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> pages

    def drop(self, reason: str, n: int) -> None:
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n


class WriteBehind:
    def __init__(
        self, medium: KeyedMedium, encode: Encode, *, max_bytes: int, batch_bytes: int,
        ttl_s: int = 0, threads: int = 1, on_drop: Callable[[list[bytes]], object] | None = None,
    ) -> None:
        """``on_drop(names)``: items that may not be in the store: evicted from the queue for
        another owner's, or in a batch not wholly written (called without the queue's lock)."""
        self._medium, self._encode, self._ttl_s = medium, encode, ttl_s
        # A writer's batch is at most a quarter of the bound: most of what waits stays queued,
        # where a full queue can still make room for a light owner (items in flight can't).
        self._max_bytes, self._batch_bytes = max_bytes, max(1, min(batch_bytes, max_bytes // 4))
        self._on_drop = on_drop
        self._queue: FairQueue[tuple[bytes, Payload]] = FairQueue()
        self._cond = threading.Condition()
        self.queued_bytes = 0  # queued or being written
        self._busy = 0  # batches being written
        self._closing = False
        self.counters = WriteCounters()
        self._threads = [
            threading.Thread(target=self._run, name=f"kvtier-remote-writer-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def offer(self, items: Sequence[tuple[bytes, Payload]], owner: str = "") -> int:
        evicted: list[tuple[bytes, Payload]] = []
        with self._cond:
            taken = 0
            for name, payload in items:
                size = len(payload)
                over = self.queued_bytes + size - self._max_bytes
                if over > 0 and not self._closing:
                    before = self._queue.bytes
                    evicted += self._queue.make_room(owner, over, size)
                    self.queued_bytes -= before - self._queue.bytes
                if self._closing or self.queued_bytes + size > self._max_bytes:
                    break
                self._queue.push(owner, (name, payload), size)
                self.queued_bytes += size
                taken += 1
            dropped = len(items) - taken + len(evicted)
            self.counters.drop("closed" if self._closing else "queue_full", dropped)
            if taken:
                self._cond.notify_all()
        if evicted and self._on_drop is not None:
            self._on_drop([name for name, _ in evicted])
        return taken

    def _take(self) -> list[tuple[bytes, Payload]] | None:
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            batch: list[tuple[bytes, Payload]] = []
            size, most = 0, self._batch_bytes
            while self._queue and (not batch or size + self._queue.peek_size() <= most):
                item = self._queue.pop()
                batch.append(item)
                size += len(item[1])
            self._busy += 1
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            size = sum(len(p) for _, p in batch)
            written = 0
            try:
                framed = [self._encode(name, payload) for name, payload in batch]
                written = self._medium.put_many(framed, self._ttl_s)
            finally:
                with self._cond:
                    self.counters.pages += written
                    self.counters.bytes += size * written // len(batch)
                    self.counters.drop("store", len(batch) - written)
                    self.queued_bytes -= size
                    self._busy -= 1
                    self._cond.notify_all()
            if written < len(batch) and self._on_drop is not None:
                self._on_drop([name for name, _ in batch])  # any of them may be unwritten

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        with self._cond:
            self._closing = True
            left = self._queue.clear()
            self.counters.drop("closed", len(left))
            self.queued_bytes -= sum(len(p) for _, p in left)
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
