"""A scheduler lane's state: its four queues of batches, how many of its batches are under way
(``active``: taken or launched, not yet completed) and whether a caller holds it on loan
(``lent``, ``kvtier/loan.py``); the scheduler's lock guards all of it."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping

from kvtier.transfer.base import Moves, TransferHandler
from kvtier.types import Direction

# A drain ends on batches down to ``batch_bytes // TAIL_FLOOR`` and ``TAIL_PAGES`` pages: the
# completion after the last copy costs per page, a launch per batch (large pages: no halving).
TAIL_FLOOR = 8
TAIL_PAGES = 512


class Pending:
    __slots__ = ("batch", "direction", "nbytes", "start", "waiter")

    def __init__(self, batch: Moves, waiter: Callable[[], list[bool]], start: float) -> None:
        self.batch, self.waiter, self.start = batch, waiter, start
        self.nbytes = batch.nbytes
        self.direction = batch.direction


def failed(n: int) -> Callable[[], list[bool]]:
    return lambda: [False] * n


class Lane:
    """Four FIFO queues of batches, served in order: urgent restores, restores, urgent offloads,
    offloads."""

    def __init__(
        self,
        name: str,
        lock: threading.Lock | None = None,
        handlers: Mapping[Direction, TransferHandler] | None = None,
        device: str | None = None,
    ) -> None:
        self.name = name
        self.handlers = dict(handlers or {})  # the directions this lane launches
        self.device = device  # its GPU (None: the disk lane, shared by every GPU)
        self.group = device or ""  # whose in-flight bound it counts against
        self.queues: tuple[deque[Moves], ...] = (deque(), deque(), deque(), deque())
        self.thread: threading.Thread | None = None
        # The lane sleeps on its own condition (the scheduler's lock): a submit wakes the lanes
        # it queued to, a completion the lanes with queued work (waiting for in-flight room);
        # an idle lane is never woken for another lane's batches.
        self.cond = threading.Condition(lock)
        # Batches in flight: the least its handlers allow.
        self.depth = max(1, min((h.depth for h in self.handlers.values()), default=2))
        self.active = 0  # batches taken or launched, not yet completed
        self.lent = False  # a caller launches this lane's batches (``kvtier/loan.py``)

    def idle(self) -> bool:
        """Nothing queued, launched or waiting for its completion (scheduler's lock held)."""
        return not self.active and not self._head()

    def queue_for(self, batch: Moves) -> deque[Moves]:
        return self.queues[(0 if batch.urgent else 1) + (0 if batch.direction.is_restore else 2)]

    def _head(self) -> deque[Moves] | None:
        return next((q for q in self.queues if q), None)

    def has_work(self) -> bool:
        return self._head() is not None

    def plain_offload_next(self) -> bool:
        """Whether the next batch would be a plain (not urgent) offload."""
        return self._head() is self.queues[3]

    def count(self, restores: bool) -> int:
        """Queued page moves (columns) of restores or of offloads."""
        return sum(len(b) for q in (self.queues[:2] if restores else self.queues[2:]) for b in q)

    def peek_bytes(self, batch_bytes: int) -> int:
        queue = self._head()
        return min(batch_bytes, queue[0].nbytes) if queue else 0

    def take(self, batch_bytes: int, least_pages: int | None = None) -> Moves:
        """The head queue's next batch, up to ``batch_bytes`` (at least one column): a larger
        queued batch is split, and following compatible ones are joined while there is room.
        With ``least_pages``, when the queue's last batch is ``final`` (its producer is done)
        and less than two batches' worth is queued: half of it, but not less than
        ``least_pages`` pages nor ``batch_bytes // TAIL_FLOOR``, so a drain ends on small
        batches (never while a producer is still feeding the queue)."""
        queue = self._head()
        assert queue is not None
        first = queue[0]
        least_bytes = batch_bytes
        if least_pages is not None:
            least_bytes = max(least_pages * first.page_size, batch_bytes // TAIL_FLOOR)
        if least_bytes < batch_bytes and queue[-1].final:
            queued = sum(b.nbytes for b in queue)
            if queued < 2 * batch_bytes:
                batch_bytes = max(least_bytes, queued // 2)
        k = max(1, batch_bytes // first.page_size)
        if len(first) > k:
            return first.take(k)
        batch = queue.popleft()
        while queue and len(batch) < k and batch.compatible(queue[0]):
            room = k - len(batch)
            if len(queue[0]) > room:
                batch.join(queue[0].take(room))
                break
            batch.join(queue.popleft())
        return batch


