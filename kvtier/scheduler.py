"""Restore-first, batched transfer scheduling.

Contract:
    * Three lanes, each one thread and one handler set: ``up`` (CPU->GPU), ``down`` (GPU->CPU) and
      ``disk`` (disk->CPU and CPU->disk). Up and down run at the same time, so both PCIe directions
      are busy at once; the disk lane serves the shared disk.
    * Every lane keeps a restore queue and an offload queue; a queued restore is always taken before
      any queued offload. ``urgent`` moves (offloads that free room for a waiting restore) go ahead
      of the other moves of their kind, first in, first out.
    * A lane takes one batch at a time: consecutive moves of one direction up to ``batch_bytes``,
      and launches the next batch before waiting on the previous one (two batches in flight).
      Bytes in flight across lanes never exceed ``max_inflight_bytes`` (a batch waits for room).
    * ``cancel(move)`` removes a queued move (True) or reports it already started (False).
    * ``on_complete(moves, results, seconds)`` is called on the lane thread after every batch,
      including failed ones (all False) and, on ``close``, every move still queued (all False).
      The scheduler never reads those moves again, so the engine may reuse them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from itertools import groupby
from operator import attrgetter

from kvtier.errors import Unavailable
from kvtier.transfer.base import Move, TransferHandler
from kvtier.types import Direction

log = logging.getLogger(__name__)
CompleteFn = Callable[[list[Move], list[bool], float], None]
_KIND = attrgetter("direction", "urgent")
_SIZE = attrgetter("page_size")
_LANE_OF = {
    Direction.CPU_TO_GPU: "up",
    Direction.GPU_TO_CPU: "down",
    Direction.DISK_TO_CPU: "disk",
    Direction.CPU_TO_DISK: "disk",
}


class _Pending:
    __slots__ = ("batch", "direction", "nbytes", "start", "waiter")

    def __init__(
        self, batch: list[Move], waiter: Callable[[], list[bool]], start: float, nbytes: int
    ) -> None:
        self.batch, self.waiter, self.start, self.nbytes = batch, waiter, start, nbytes
        self.direction = batch[0].direction


def _failed(n: int) -> Callable[[], list[bool]]:
    return lambda: [False] * n


class _Lane:
    """Four FIFO queues, served in order: urgent restores, restores, urgent offloads, offloads."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queues: tuple[deque[Move], ...] = (deque(), deque(), deque(), deque())
        self.thread: threading.Thread | None = None

    def queue_for(self, move: Move) -> deque[Move]:
        return self.queues[(0 if move.urgent else 1) + (0 if move.direction.is_restore else 2)]

    def _head(self) -> deque[Move] | None:
        return next((q for q in self.queues if q), None)

    def count(self, restores: bool) -> int:
        return sum(len(q) for q in (self.queues[:2] if restores else self.queues[2:]))

    def peek_bytes(self, batch_bytes: int) -> int:
        queue = self._head()
        return min(batch_bytes, queue[0].page_size * len(queue)) if queue else 0

    def take(self, batch_bytes: int) -> list[Move]:
        """The head queue's next moves, up to ``batch_bytes`` (at least one move).

        A queue holds one direction. Pages of one size (the common case) are taken as one slice
        of the queue; otherwise move by move.
        """
        queue = self._head()
        assert queue is not None
        size = queue[0].page_size
        k = min(len(queue), max(1, batch_bytes // size))
        if k > 1 and queue[k - 1].page_size == size:
            batch = [queue.popleft() for _ in range(k)]
            if len(set(map(_SIZE, batch))) == 1:
                return batch
            queue.extendleft(reversed(batch))  # mixed sizes: put them back, take one by one
        batch = [queue.popleft()]
        size = batch[0].page_size
        while queue and queue[0].direction is batch[0].direction:
            if size + queue[0].page_size > batch_bytes:
                break
            size += queue[0].page_size
            batch.append(queue.popleft())
        return batch


class TransferScheduler:
    """See the module docstring."""

    def __init__(
        self,
        handlers: Mapping[Direction, TransferHandler],
        *,
        batch_bytes: int,
        max_inflight_bytes: int,
        on_complete: CompleteFn,
    ) -> None:
        self._handlers = dict(handlers)
        self._batch_bytes = batch_bytes
        self._max_inflight = max(max_inflight_bytes, batch_bytes)
        self._on_complete = on_complete
        self._cond = threading.Condition()
        self._lanes = {n: _Lane(n) for n in ("up", "down", "disk")}
        self._inflight = 0
        self._closed = False
        self._last_end: dict[Direction, float] = {}
        for lane in self._lanes.values():
            lane.thread = threading.Thread(
                target=self._loop, args=(lane,), name=f"kvtier-{lane.name}", daemon=True
            )
            lane.thread.start()

    # -- queueing ---------------------------------------------------------------------------------
    def submit(self, moves: list[Move]) -> None:
        """Queue moves (restores and offloads may be mixed)."""
        with self._cond:
            if self._closed:
                raise Unavailable("transfer scheduler is closed")
            runs: list[tuple[deque[Move], list[Move]]] = []
            # One lookup per run of moves of one kind, not per move.
            for (direction, _), group in groupby(moves, key=_KIND):
                if direction not in self._handlers:
                    raise Unavailable(f"no handler for {direction.name}")
                run = list(group)
                runs.append((self._lanes[_LANE_OF[direction]].queue_for(run[0]), run))
            for queue, run in runs:  # all checked first: a refused submit queues nothing
                queue.extend(run)
            self._cond.notify_all()

    def cancel(self, move: Move) -> bool:
        with self._cond:
            queue = self._lanes[_LANE_OF[move.direction]].queue_for(move)
            try:
                queue.remove(move)
            except ValueError:
                return False
            return True

    def depth(self) -> tuple[int, int]:
        """(queued restores, queued offloads)."""
        with self._cond:
            r = sum(lane.count(restores=True) for lane in self._lanes.values())
            o = sum(lane.count(restores=False) for lane in self._lanes.values())
            return r, o

    @property
    def inflight_bytes(self) -> int:
        return self._inflight

    # -- lanes ------------------------------------------------------------------------------------
    def _loop(self, lane: _Lane) -> None:
        """Launch batch i+1 before waiting on batch i, so Python work hides behind the copies."""
        pending: _Pending | None = None
        while True:
            batch: list[Move] = []
            nbytes = 0
            with self._cond:
                while not self._closed and pending is None and not self._ready(lane):
                    self._cond.wait()
                if self._closed and pending is None:
                    return
                if not self._closed and self._ready(lane):
                    batch = lane.take(self._batch_bytes)
                    nbytes = sum(map(_SIZE, batch))
                    self._inflight += nbytes
            launched = self._launch(batch, nbytes) if batch else None
            if pending is not None:
                self._finish(pending)
            pending = launched

    def _ready(self, lane: _Lane) -> bool:
        """Work is queued and the in-flight bound leaves room for its next batch."""
        want = lane.peek_bytes(self._batch_bytes)
        return want > 0 and (not self._inflight or self._inflight + want <= self._max_inflight)

    def _launch(self, batch: list[Move], nbytes: int) -> _Pending:
        handler = self._handlers[batch[0].direction]
        start = time.perf_counter()
        try:
            waiter = handler.launch(batch)
        except Exception:
            log.exception(
                "launching a %s batch of %d pages failed", batch[0].direction.name, len(batch)
            )
            waiter = _failed(len(batch))
        return _Pending(batch, waiter, start, nbytes)

    def _finish(self, pending: _Pending) -> None:
        batch = pending.batch
        try:
            results = pending.waiter()
        except Exception:
            log.exception(
                "transfer batch %s of %d pages failed", batch[0].direction.name, len(batch)
            )
            results = [False] * len(batch)
        end = time.perf_counter()
        # Busy time only: a batch launched while its predecessor ran starts counting when that
        # one finished, so per-direction seconds never double-count overlapping batches.
        direction = pending.direction
        busy = end - max(pending.start, self._last_end.get(direction, 0.0))
        self._last_end[direction] = end
        pending.batch = []  # on_complete owns the moves from here on
        try:
            self._on_complete(batch, results, busy)
        except Exception:  # the engine's completion must never kill a lane
            log.exception("completing a %s batch failed", direction.name)
        with self._cond:
            self._inflight -= pending.nbytes
            self._cond.notify_all()

    def close(self, grace: float = 10.0) -> None:
        """Finish batches in flight (bounded by ``grace``), fail everything still queued."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            leftovers = [m for lane in self._lanes.values() for q in lane.queues for m in q]
            for lane in self._lanes.values():
                for q in lane.queues:
                    q.clear()
            self._cond.notify_all()
        for lane in self._lanes.values():
            if lane.thread is not None:
                lane.thread.join(timeout=grace)
        if leftovers:
            self._on_complete(leftovers, [False] * len(leftovers), 0.0)
        for handler in self._handlers.values():
            handler.close()
