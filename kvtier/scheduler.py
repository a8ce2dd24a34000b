"""Restore-first, batched transfer scheduling.

Contract:
    * Three lanes, each one thread and one handler set: ``up`` (CPU->GPU), ``down`` (GPU->CPU) and
      ``disk`` (disk->CPU and CPU->disk). Up and down run at the same time, so both PCIe directions
      are busy at once; the disk lane serves the shared disk.
    * Every lane keeps a restore queue and an offload queue; a queued restore is always taken before
      any queued offload. ``urgent`` moves (offloads that free room for a waiting restore) go to the
      front of their queue.
    * A lane takes one batch at a time: consecutive moves of one direction up to ``batch_bytes``.
      Bytes in flight across lanes never exceed ``max_inflight_bytes`` (a batch waits for room).
    * ``cancel(move)`` removes a queued move (True) or reports it already started (False).
    * ``on_complete(moves, results, seconds)`` is called on the lane thread after every batch,
      including failed ones (all False) and, on ``close``, every move still queued (all False).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from kvtier.errors import Unavailable
from kvtier.transfer.base import Move, TransferHandler
from kvtier.types import Direction

log = logging.getLogger(__name__)
CompleteFn = Callable[[list[Move], list[bool], float], None]
_LANE_OF = {
    Direction.CPU_TO_GPU: "up",
    Direction.GPU_TO_CPU: "down",
    Direction.DISK_TO_CPU: "disk",
    Direction.CPU_TO_DISK: "disk",
}


class _Lane:
    def __init__(self, name: str) -> None:
        self.name = name
        self.restores: deque[Move] = deque()
        self.offloads: deque[Move] = deque()
        self.thread: threading.Thread | None = None

    def peek_bytes(self, batch_bytes: int) -> int:
        queue = self.restores if self.restores else self.offloads
        return min(batch_bytes, queue[0].nbytes * len(queue)) if queue else 0

    def take(self, batch_bytes: int) -> list[Move]:
        queue = self.restores if self.restores else self.offloads
        batch = [queue.popleft()]
        size = batch[0].nbytes
        while queue and queue[0].direction is batch[0].direction:
            if size + queue[0].nbytes > batch_bytes:
                break
            size += queue[0].nbytes
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
            front: dict[int, list[Move]] = {}
            for move in moves:
                if move.direction not in self._handlers:
                    raise Unavailable(f"no handler for {move.direction.name}")
                lane = self._lanes[_LANE_OF[move.direction]]
                queue = lane.restores if move.direction.is_restore else lane.offloads
                if move.urgent:
                    front.setdefault(id(queue), []).append(move)
                else:
                    queue.append(move)
            for lane in self._lanes.values():
                for queue in (lane.restores, lane.offloads):
                    urgent = front.get(id(queue))
                    if urgent:  # ahead of the queue, in the order given
                        queue.extendleft(reversed(urgent))
            self._cond.notify_all()

    def cancel(self, move: Move) -> bool:
        with self._cond:
            lane = self._lanes[_LANE_OF[move.direction]]
            for queue in (lane.restores, lane.offloads):
                try:
                    queue.remove(move)
                except ValueError:
                    continue
                return True
            return False

    def depth(self) -> tuple[int, int]:
        """(queued restores, queued offloads)."""
        with self._cond:
            r = sum(len(lane.restores) for lane in self._lanes.values())
            o = sum(len(lane.offloads) for lane in self._lanes.values())
            return r, o

    @property
    def inflight_bytes(self) -> int:
        return self._inflight

    # -- lanes ------------------------------------------------------------------------------------
    def _loop(self, lane: _Lane) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._ready(lane):
                    self._cond.wait()
                if self._closed:
                    return
                batch = lane.take(self._batch_bytes)
                nbytes = sum(m.nbytes for m in batch)
                self._inflight += nbytes
            self._run(batch)
            with self._cond:
                self._inflight -= nbytes
                self._cond.notify_all()

    def _ready(self, lane: _Lane) -> bool:
        """Work is queued and the in-flight bound leaves room for its next batch."""
        want = lane.peek_bytes(self._batch_bytes)
        return want > 0 and (not self._inflight or self._inflight + want <= self._max_inflight)

    def _run(self, batch: list[Move]) -> None:
        handler = self._handlers[batch[0].direction]
        start = time.perf_counter()
        try:
            results = handler.run(batch)
        except Exception:
            log.exception(
                "transfer batch %s of %d pages failed", batch[0].direction.name, len(batch)
            )
            results = [False] * len(batch)
        try:
            self._on_complete(batch, results, time.perf_counter() - start)
        except Exception:  # the engine's completion must never kill a lane
            log.exception("completing a %s batch failed", batch[0].direction.name)

    def close(self, grace: float = 10.0) -> None:
        """Finish batches in flight (bounded by ``grace``), fail everything still queued."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            leftovers = [
                m for lane in self._lanes.values() for m in (*lane.restores, *lane.offloads)
            ]
            for lane in self._lanes.values():
                lane.restores.clear()
                lane.offloads.clear()
            self._cond.notify_all()
        for lane in self._lanes.values():
            if lane.thread is not None:
                lane.thread.join(timeout=grace)
        if leftovers:
            self._on_complete(leftovers, [False] * len(leftovers), 0.0)
        for handler in self._handlers.values():
            handler.close()
