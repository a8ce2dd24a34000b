"""Write-behind to a keyed medium: a bounded queue drained by its own threads.

Contract:
    * ``offer(items) -> int`` never blocks on the medium: it queues ``(name, payload)`` items while
      their bytes fit in ``max_bytes`` and drops (and counts, reason ``queue_full``) the rest; it
      returns how many were queued.
    * Each of ``threads`` writer threads takes up to ``batch_bytes`` at a time, turns each item
      into a ``(store key, value)`` with ``encode`` (framing and MAC happen here, off the
      caller's path) and writes the batch with one ``put_many``; items the medium did not
      write are dropped and counted (reason ``store``). Nothing is retried: a later Store of
      the same block writes it again.
    * ``flush(timeout) -> bool``: waits until everything offered so far is written or dropped.
      ``close(timeout)``: stops taking items, drains what is queued within ``timeout``, then drops
      the rest (counted ``closed``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
        ttl_s: int = 0, threads: int = 1,
    ) -> None:
        self._medium, self._encode, self._ttl_s = medium, encode, ttl_s
        self._max_bytes, self._batch_bytes = max_bytes, max(1, batch_bytes)
        self._queue: deque[tuple[bytes, Payload]] = deque()
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

    def offer(self, items: Sequence[tuple[bytes, Payload]]) -> int:
        with self._cond:
            taken = 0
            for name, payload in items:
                if self._closing or self.queued_bytes + len(payload) > self._max_bytes:
                    break
                self._queue.append((name, payload))
                self.queued_bytes += len(payload)
                taken += 1
            self.counters.drop("closed" if self._closing else "queue_full", len(items) - taken)
            if taken:
                self._cond.notify_all()
            return taken

    def _take(self) -> list[tuple[bytes, Payload]] | None:
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            batch: list[tuple[bytes, Payload]] = []
            size = 0
            while self._queue and (not batch or size + len(self._queue[0][1]) <= self._batch_bytes):
                item = self._queue.popleft()
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
            self.counters.drop("closed", len(self._queue))
            self.queued_bytes -= sum(len(p) for _, p in self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
