"""Restore-first, batched transfer scheduling.

Contract:
    * Lanes come from the handlers: one lane (a thread) per ``TransferHandler.lane`` name. By
      default three: ``up`` (CPU->GPU), ``down`` (GPU->CPU) and ``disk`` (disk->CPU and
      CPU->disk). Up and down run at the same time, so both PCIe directions are busy at once;
      the lanes of the tiers below the CPU (``disk``, and any a handler names) are shared by
      every GPU.
    * Work is queued as :class:`~kvtier.transfer.base.Moves` batches. Every lane keeps a restore
      queue and an offload queue; a queued restore is always taken before any queued offload.
      ``urgent`` batches (offloads that free room for a waiting restore) go ahead of the other
      batches of their kind, first in, first out.
    * A lane takes one batch at a time: up to ``batch_bytes`` from the head of its first non-empty
      queue (a larger queued batch is split, smaller compatible ones are joined; when less than
      two batches' worth is queued and the last one is ``final``, it takes half of it, down to
      an eighth of ``batch_bytes`` and 512 pages, so a drain of many small pages ends on small
      batches and the last completion after the last copy is short), and launches the next
      batches before waiting on the oldest (up to its handlers' ``depth`` in flight: three on
      CUDA, two on disk and CPU mode). Bytes in flight across one GPU's lanes (the default
      GPU's with the disk lane) never exceed ``max_inflight_bytes`` (a batch waits for room):
      one GPU's backlog never takes another GPU's room.
    * Several GPUs: ``gpus`` gives each further GPU its own handler set (its own copy streams
      and staging) and its own up and down lanes (``up@cuda:1``, ``down@cuda:1``); a GPU<->CPU
      batch goes to the lanes of its pool's device (``device_of``), so one GPU's offload
      backlog never queues ahead of another GPU's restore. The disk lane and the in-flight
      bound stay shared (one CPU/disk budget); a batch of a device with no lanes of its own
      goes to the default lanes.
    * ``restore_first(device)``: while any caller is inside it (an acquire), a lane of that
      device (every GPU lane when ``device`` is None; the disk lane for any) whose next batch
      is a plain (not urgent) offload keeps one batch in flight instead of its depth: the copy
      engine stays busy, the launch work waits, the restore's thread gets the interpreter.
    * ``lend(direction, device, pause)``: an idle GPU lane whose handler only queues work is lent
      to one caller, who launches, waits for and completes its own copy batches on its own
      thread (``kvtier/loan.py``); the lane takes its queue again when the loan is given back,
      or at the first batch that finds other work queued. Completions of a loan's batches run
      on the caller's thread, not the lane's.
    * ``cancel(batch, rows)`` takes the columns of page-table ``rows`` out of a still-queued batch
      and returns them as ``(rows, srcs, dsts)`` (empty when the batch was already taken).
    * ``on_complete(batch, results, seconds)`` is called on the lane thread after every batch,
      including failed ones (all False) and, on ``close``, every batch still queued (all False).
      The scheduler never reads a batch again once it was completed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from kvtier.errors import Unavailable
from kvtier.lanes import TAIL_PAGES, Lane, Pending, failed
from kvtier.loan import LaneLoan
from kvtier.transfer.base import Moves, TransferHandler, lane_of
from kvtier.types import Direction, Tier

log = logging.getLogger(__name__)
_NONE = np.empty(0, dtype=np.int64)
CompleteFn = Callable[[Moves, list[bool], float], object]  # any return is ignored
TryCompleteFn = Callable[[Moves, list[bool], float], bool]
SHARED_LANE = "disk"  # the lane below the CPU, there even without handlers (as it always was)


def _gpu_side(direction: Direction) -> bool:
    return Tier.GPU in direction._value_


def _kinds(handlers: Mapping[Direction, TransferHandler]) -> list[str]:
    """The lane names of GPU<->CPU ``handlers``, restore lanes first (``up``, ``down``)."""
    gpu = [(not d.is_restore, lane_of(d, h)) for d, h in handlers.items() if _gpu_side(d)]
    return list(dict.fromkeys(lane for _, lane in sorted(gpu)))


def _pool_device(batch: Moves) -> str | None:
    """A batch's GPU: its pool's device (None for disk batches)."""
    return batch.pool.device if batch.pool is not None else None


class TransferScheduler:
    """See the module docstring."""

    def __init__(
        self,
        handlers: Mapping[Direction, TransferHandler],
        *,
        batch_bytes: int,
        max_inflight_bytes: int,
        on_complete: CompleteFn,
        try_complete: TryCompleteFn | None = None,
        device: str = "",
        gpus: Mapping[str, Mapping[Direction, TransferHandler]] | None = None,
        device_of: Callable[[Moves], str | None] = _pool_device,
    ) -> None:
        """``handlers``: the default device's (``device``) and the disk's; ``gpus``: each
        further GPU's GPU<->CPU handlers; ``device_of``: a batch's GPU (its pool's device)."""
        self._handlers = dict(handlers)  # the default GPU's and the disk's
        self._try_complete = try_complete
        self._batch_bytes = batch_bytes
        self._max_inflight = max(max_inflight_bytes, batch_bytes)
        self._on_complete = on_complete
        self._device_of = device_of
        self._default = device
        self._lock = threading.Lock()
        self._lanes: dict[str, Lane] = {}
        self._kind = {d: lane_of(d, h) for d, h in handlers.items()}  # direction -> lane name
        self._add_lanes(device, "", handlers)
        shared: dict[str, dict[Direction, TransferHandler]] = {SHARED_LANE: {}}
        for d, h in handlers.items():
            if not _gpu_side(d):
                shared.setdefault(lane_of(d, h), {})[d] = h
        for name, mine in shared.items():
            self._lanes[name] = Lane(name, self._lock, mine, None)
            self._lanes[name].group = device  # shared lanes share the default GPU's bound
        for gpu, more in (gpus or {}).items():
            if gpu != device:
                self._kind.update((d, lane_of(d, h)) for d, h in more.items())
                self._add_lanes(gpu, f"@{gpu}", more)
        self._inflight = {lane.group: 0 for lane in self._lanes.values()}  # bytes, per GPU
        self._closed = False
        self._last_end: dict[tuple[str, Direction], float] = {}
        self._restoring: dict[str | None, int] = {}  # callers inside ``restore_first``, per GPU
        self._restoring_lock = threading.Lock()
        for lane in self._lanes.values():
            lane.thread = threading.Thread(
                target=self._loop, args=(lane,), name=f"kvtier-{lane.name}", daemon=True
            )
            lane.thread.start()

    def _add_lanes(
        self, device: str, suffix: str, handlers: Mapping[Direction, TransferHandler]
    ) -> None:
        """One lane per lane name of the GPU<->CPU ``handlers`` (``up``, ``down``)."""
        for kind in _kinds(handlers):
            mine = {d: h for d, h in handlers.items() if _gpu_side(d) and lane_of(d, h) == kind}
            self._lanes[kind + suffix] = Lane(kind + suffix, self._lock, mine, device)

    def _lane_of(self, batch: Moves) -> Lane | None:
        """The lane serving ``batch``: its device's lane of its kind (``up``/``down``), or a
        shared one below the CPU; None when no handler serves its direction."""
        kind = self._kind.get(batch.direction)
        if kind is None:
            return None
        if not _gpu_side(batch.direction):
            return self._lanes.get(kind)
        return self._lanes.get(f"{kind}@{self._device_of(batch)}") or self._lanes.get(kind)

    @property
    def lanes(self) -> list[str]:
        """The lanes' names (``up``, ``down``, ``disk``, then ``up@cuda:1``, ...)."""
        return list(self._lanes)

    # -- queueing ---------------------------------------------------------------------------------
    def submit(self, batches: list[Moves]) -> None:
        """Queue batches (restores and offloads may be mixed); empty ones are ignored."""
        with self._lock:
            if self._closed:
                raise Unavailable("transfer scheduler is closed")
            for batch in batches:  # all checked first: a refused submit queues nothing
                lane = self._lane_of(batch)
                if lane is None or batch.direction not in lane.handlers:
                    raise Unavailable(f"no handler for {batch.direction.name}")
            fed = set()
            for batch in batches:
                if len(batch.srcs):
                    lane = self._lane_of(batch)
                    assert lane is not None  # checked above
                    lane.queue_for(batch).append(batch)
                    fed.add(lane.name)
            for name in fed:
                self._lanes[name].cond.notify()

    def cancel(self, batch: Moves, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The columns of page-table ``rows`` taken out of ``batch`` while it is still queued,
        as ``(rows, srcs, dsts)``; empty for a batch already taken (its copies may be running)."""
        with self._lock:
            lane = self._lane_of(batch)
            if lane is None:
                return _NONE, _NONE, _NONE
            queue = lane.queue_for(batch)
            if not any(b is batch for b in queue):
                return _NONE, _NONE, _NONE
            cols = batch.remove(rows)
            if not len(batch.srcs):
                queue.remove(batch)
            return cols

    def lend(
        self, direction: Direction, device: str | None, pause: Callable[[], object] | None = None
    ) -> LaneLoan:
        """The lane of ``direction``'s batches on ``device``, lent to the caller if it is idle
        and its handler only queues work (``kvtier/loan.py``); ``pause``: what the caller does
        while its copies catch up (default: a short sleep)."""
        kind = self._kind.get(direction)
        lane = None
        if kind is not None and _gpu_side(direction):
            lane = self._lanes.get(f"{kind}@{device}") or self._lanes.get(kind)
        with self._lock:
            handler = lane.handlers.get(direction) if lane is not None else None
            if (
                lane is None or handler is None or not handler.queued or self._closed
                or lane.lent or not lane.idle()
                or (not direction.is_restore and self._restoring_for(lane))
            ):
                lane = None
            else:
                lane.lent = True
        return LaneLoan(lane, self._lock, self._take_room, self._launch, self._settle,
                        lambda: self._closed, pause)

    def _fits(self, lane: Lane, nbytes: int) -> bool:
        """The in-flight bound of ``lane``'s GPU leaves room for ``nbytes`` (lock held): always
        when nothing is in flight, so a batch larger than the bound still goes."""
        used = self._inflight[lane.group]
        return not used or used + nbytes <= self._max_inflight

    def _take_room(self, lane: Lane, nbytes: int) -> bool:
        """Count ``nbytes`` in flight on ``lane``'s GPU if the bound leaves room (lock held)."""
        if not self._fits(lane, nbytes):
            return False
        self._inflight[lane.group] += nbytes
        return True

    @contextlib.contextmanager
    def restore_first(self, device: str | None = None) -> Iterator[None]:
        """Restores first on the interpreter too: while any caller is inside this block (an
        acquire on ``device``; None: any GPU), that device's lanes and the disk lane launch
        plain offloads one batch at a time (their copies keep running; the launch work between
        them waits), so the restore's own steps seldom queue behind an offload launch for the
        interpreter lock. Another GPU's lanes keep their depth."""
        if device is not None and f"up@{device}" not in self._lanes:
            device = self._default  # a device with no lanes of its own uses the default ones
        with self._restoring_lock:
            self._restoring[device] = self._restoring.get(device, 0) + 1
        try:
            yield
        finally:
            with self._restoring_lock:
                self._restoring[device] -= 1

    def _restoring_for(self, lane: Lane) -> bool:
        """Whether a restore waits that ``lane`` must give way to."""
        counts = self._restoring
        if lane.device is None:
            return any(counts.values())
        return bool(counts.get(lane.device) or counts.get(None))

    def depth(self) -> tuple[int, int]:
        """(queued restores, queued offloads)."""
        with self._lock:
            r = sum(lane.count(restores=True) for lane in self._lanes.values())
            o = sum(lane.count(restores=False) for lane in self._lanes.values())
            return r, o

    @property
    def inflight_bytes(self) -> int:
        return sum(self._inflight.values())

    # -- lanes ------------------------------------------------------------------------------------
    def _loop(self, lane: Lane) -> None:
        """Launch the next batches before waiting on the oldest (up to the lane's depth in
        flight), so Python work and hold-ups hide behind the copies. A copied batch whose
        completion cannot run at once (``try_complete`` refused: a caller holds the engine lock)
        waits in ``done`` while the lane keeps launching; it is completed, in order, as soon as
        it can be, and always before the lane sleeps."""
        pending: deque[Pending] = deque()
        done: deque[tuple[Pending, list[bool], float]] = deque()
        while True:
            batch: Moves | None = None
            with self._lock:
                while not self._closed and not pending and not done and not self._ready(lane):
                    lane.cond.wait()
                if self._closed and not pending and not done:
                    return
                more = not self._closed and self._ready(lane)
                slow = lane.plain_offload_next() and self._restoring_for(lane)
                depth = 1 if slow else lane.depth
                if more and len(pending) < depth:
                    batch = lane.take(self._batch_bytes, TAIL_PAGES)
                    self._inflight[lane.group] += batch.nbytes
                    lane.active += 1
            if batch is not None:
                pending.append(self._launch(lane, batch))
                if len(pending) < depth:
                    continue  # more may be ready: launch before waiting
            if pending:
                done.append(self._wait(lane, pending.popleft()))
                if not more:  # queued while this lane waited: launch it, not block on a lock
                    with self._lock:
                        more = not self._closed and self._ready(lane)
            # While more is queued, one completion per launch: completions deferred behind the
            # engine lock must not all run back to back while the copy engine runs dry.
            most = 1 if more else len(done)
            self._complete(lane, done, block=not pending and not more, most=most)

    def _ready(self, lane: Lane) -> bool:
        """Work is queued and the in-flight bound leaves room for its next batch."""
        want = lane.peek_bytes(self._batch_bytes)
        return not lane.lent and want > 0 and self._fits(lane, want)

    def _launch(self, lane: Lane, batch: Moves) -> Pending:
        handler = lane.handlers[batch.direction]
        start = time.perf_counter()
        if batch.caller is not None and batch.caller.gone:  # it may have reused the memory
            return Pending(batch, failed(len(batch)), start)
        try:
            waiter = handler.launch(batch)
        except Exception:
            log.exception(
                "launching a %s batch of %d pages failed", batch.direction.name, len(batch)
            )
            waiter = failed(len(batch))
        return Pending(batch, waiter, start)

    def _wait(self, lane: Lane, pending: Pending) -> tuple[Pending, list[bool], float]:
        """Wait for a launched batch's copies: its results and busy seconds."""
        batch = pending.batch
        try:
            results = pending.waiter()
        except Exception:
            log.exception("transfer batch %s of %d pages failed", batch.direction.name, len(batch))
            results = [False] * len(batch)
        end = time.perf_counter()
        # Busy time only: a batch launched while its predecessor ran starts counting when that
        # one finished, so per-direction seconds never double-count overlapping batches.
        key = (lane.name, pending.direction)  # per lane: two GPUs' copies overlap
        busy = end - max(pending.start, self._last_end.get(key, 0.0))
        self._last_end[key] = end
        return pending, results, busy

    def _complete(
        self, lane: Lane, done: deque[tuple[Pending, list[bool], float]], block: bool,
        most: int,
    ) -> None:
        """Complete up to ``most`` copied batches in order; without ``block``, stop at the first
        whose completion would have to wait for the engine lock."""
        while done and most > 0:
            most -= 1
            pending, results, busy = done[0]
            batch = pending.batch
            try:
                if block or self._try_complete is None:
                    self._on_complete(batch, results, busy)
                elif not self._try_complete(batch, results, busy):
                    return
            except Exception:  # the engine's completion must never kill a lane
                log.exception("completing a %s batch failed", pending.direction.name)
            done.popleft()
            self._out_of_flight(lane, pending)

    def _out_of_flight(self, lane: Lane, pending: Pending) -> None:
        """A completed batch no longer counts in flight: wake the lanes waiting for room."""
        with self._lock:
            self._inflight[lane.group] -= pending.nbytes
            lane.active -= 1
            for other in self._lanes.values():  # room in flight: only for queued work
                if other is not lane and other.has_work():
                    other.cond.notify()

    def _settle(self, lane: Lane, pending: Pending) -> None:
        """A lent lane's batch (``kvtier/loan.py``), copied: completed on the caller's thread."""
        _, results, busy = self._wait(lane, pending)
        try:
            self._on_complete(pending.batch, results, busy)
        except Exception:
            log.exception("completing a %s batch failed", pending.direction.name)
        self._out_of_flight(lane, pending)

    def close(self, grace: float = 10.0) -> None:
        """Finish batches in flight (bounded by ``grace``), fail everything still queued."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            leftovers = [b for lane in self._lanes.values() for q in lane.queues for b in q]
            for lane in self._lanes.values():
                for q in lane.queues:
                    q.clear()
                lane.cond.notify()
        for lane in self._lanes.values():
            if lane.thread is not None:
                lane.thread.join(timeout=grace)
        for batch in leftovers:
            self._on_complete(batch, [False] * len(batch), 0.0)
        for lane in self._lanes.values():
            for handler in lane.handlers.values():
                handler.close()
