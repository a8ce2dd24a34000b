"""A lane on loan: a caller launches its own run of copy batches, on its own thread.

Why: a keyed store or load hashes and indexes its keys a chunk at a time while the chunks before
it are copied. When the lane's thread launches those copies, it and the caller take turns on the
interpreter lock, and a store of 4 KiB pieces spent about as long launching as copying. A caller
holding the lane on loan launches each chunk itself right after that chunk's bookkeeping, and
waits for and completes its own batches, with no hand-over between threads.

Contract:
    * ``TransferScheduler.lend(direction, device, pause)`` makes a ``LaneLoan``. The lane is lent
      only when it is idle (nothing queued, launched or awaiting completion), its handler for
      ``direction`` only queues work (``TransferHandler.queued``: CUDA), and, for offloads, no
      acquire waits for a restore; otherwise the loan lends nothing and ``launch`` says False.
    * While lent, the lane launches nothing of its own queue; ``launch(batch)`` launches on the
      caller's thread and returns True, or returns False and the caller submits the batch as
      usual. The loan ends at the first batch that finds work queued on the lane, no room in
      flight (``max_inflight_bytes``) or the scheduler closed, and is never taken up again.
    * At most ``depth`` of the loan's batches are unfinished on the device: before a batch
      reuses the buffers of the one ``depth`` launches back, the caller completes those of its
      batches that are done and otherwise ``pause``s (the engine's lock wait: other callers get
      in) until that one is.
    * ``give_back`` (idempotent; also on leaving the ``with`` block) waits for the loan's batches
      and completes them, in launch order, on the caller's thread (the scheduler's
      ``on_complete``), then lets the lane take its queue again. A caller gives the loan back
      before it waits for anything but its own copies.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType

from kvtier.lanes import Lane, Pending
from kvtier.transfer.base import Moves

PAUSE_S = 0.00005  # a pause while a batch's copies run: how late its end may be seen


def _sleep() -> None:
    time.sleep(PAUSE_S)


class LaneLoan:
    """See the module docstring."""

    def __init__(
        self,
        lane: Lane | None,
        lock: threading.Lock,
        room: Callable[[Lane, int], bool],
        start: Callable[[Lane, Moves], Pending],
        settle: Callable[[Lane, Pending], None],
        closed: Callable[[], bool],
        pause: Callable[[], object] | None = None,
    ) -> None:
        """``lane``: the lane lent (None: nothing lent); ``room(lane, nbytes)``: counts
        ``nbytes`` in flight if the bound leaves room (scheduler's lock held); ``start(lane,
        batch)``: launches a batch (as the lane's thread does); ``settle(lane, pending)``: waits
        for a launched batch and completes it."""
        self._lane, self._lock, self._room = lane, lock, room
        self._start, self._settle = start, settle
        self._closed, self._pause = closed, pause or _sleep
        self._mine: deque[Pending] = deque()  # launched, not yet completed, oldest first
        self._launched = 0

    @property
    def lent(self) -> bool:
        return self._lane is not None

    def launch(self, batch: Moves) -> bool:
        """Launch ``batch`` on this thread (True), or not (False: submit it as usual)."""
        lane = self._lane
        if lane is None:
            return False
        if batch.direction not in lane.handlers:
            self.give_back()
            return False
        self._wait_turn(lane)
        with self._lock:
            ended = self._closed() or lane.has_work() or not self._room(lane, batch.nbytes)
            if not ended:
                lane.active += 1
        if ended:
            self.give_back()
            return False
        self._mine.append(self._start(lane, batch))
        self._launched += 1
        return True

    def _wait_turn(self, lane: Lane) -> None:
        """Until the batch ``depth`` launches back (whose buffers the next one reuses) is
        completed: the loan's batches are completed in order as they are done. (Not sooner:
        while the copies run ahead, completions would only delay the next chunk's launch.)"""
        back = self._launched - lane.depth  # its index among the loan's launches
        while self._mine and self._launched - len(self._mine) <= back:
            self._settle_oldest(lane)

    def _settle_oldest(self, lane: Lane) -> None:
        """Pause until the oldest batch's copies are done, then complete it."""
        while not _ready(self._mine[0]):
            self._pause()
        self._settle(lane, self._mine.popleft())

    def give_back(self) -> None:
        lane = self._lane
        if lane is None:
            return
        self._lane = None
        try:
            while self._mine:
                self._settle_oldest(lane)
        finally:
            while self._mine:  # a pause raised: wait for the rest without pausing
                self._settle(lane, self._mine.popleft())
            with self._lock:
                lane.lent = False
                lane.cond.notify()

    def __enter__(self) -> LaneLoan:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.give_back()


def _ready(pending: Pending) -> bool:
    """Whether a launched batch's copies are done (a waiter that can't say: wait for it)."""
    ready = getattr(pending.waiter, "ready", None)
    return True if ready is None else bool(ready())
