"""Completion: the finishing side of the engine's two-phase moves, as the lanes report them.

Contract:
    * ``complete(batch, results, seconds)`` takes the engine lock and finishes the batch a chunk
      of pages per lock hold (``BulkMoves.finish``: successes settle at the destination,
      failures go back to the source); slots go back to their tiers in bulk, CPU -> GPU moves
      are counted into ``Landings`` (waking the acquires they complete), the batch is counted
      per direction and per tenant, and a copy batch reports its results.
    * ``wait=False``: only if the lock is free now, else False with nothing done (a lane then
      keeps launching copies while a caller holds the lock).
    * Restores first, here too: while an acquire waits for a restore
      (``Landings.restore_waiters``), an offload batch is finished in smaller chunks with a
      pause between them, so the restore's own steps never queue behind a whole offload batch.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvtier.moves.batch import BulkMoves
from kvtier.moves.frees import Frees
from kvtier.moves.landings import Landings
from kvtier.state.placement import Placement
from kvtier.stats import DirectionCounters
from kvtier.transfer.base import Moves
from kvtier.types import Direction

COMPLETE_CHUNK = 4096  # pages finished per engine-lock hold (a restore arriving waits one)
YIELD_CHUNK = 1024  # ... while a restore is waiting, for offload batches
YIELD_S = 0.0001  # and the pause between those chunks that lets the restore's thread in


class Completion:
    """See the module docstring."""

    def __init__(
        self, place: Placement, bulk: BulkMoves, landings: Landings, cond: threading.Condition
    ) -> None:
        self._place, self._bulk, self._landings, self._cond = place, bulk, landings, cond

    def complete(
        self, batch: Moves, results: list[bool], seconds: float, *, wait: bool = True
    ) -> bool:
        """Finish a batch (see the module docstring); False only when ``wait=False`` found the
        lock busy."""
        if not self._cond.acquire(blocking=wait):
            return False
        try:
            start = self._complete_chunk(batch, results, seconds, 0)
        finally:
            self._cond.release()
        while start < len(batch):
            if self._landings.restore_waiters and not batch.direction.is_restore:
                time.sleep(YIELD_S)
            with self._cond:
                start = self._complete_chunk(batch, results, seconds, start)
        return True

    def _complete_chunk(self, batch: Moves, results: list[bool], seconds: float, start: int) -> int:
        """Columns from ``start`` on, one chunk (lock held); returns where the next one starts."""
        n = len(batch)
        restoring = batch.direction.is_restore
        step = COMPLETE_CHUNK if restoring or not self._landings.restore_waiters else YIELD_CHUNK
        end = min(n, start + step)
        frees = Frees()
        self._bulk.finish(batch, start, end, results, frees)
        if batch.direction is Direction.CPU_TO_GPU:
            self._landings.end(end - start)
        frees.apply(self._place)
        if batch.copy and batch.pool is not None:
            batch.pool.copying -= end - start  # a detach waits for the pool's copies
        if end >= n:  # the last chunk also counts the batch
            self._count(batch, results, seconds)
            self._count_tenants(batch, results)
            if batch.copy:
                batch.report(results)
        self._cond.notify_all()
        return end

    def _count(self, batch: Moves, results: list[bool], seconds: float) -> None:
        if not len(batch):
            return
        moved = self._place.counters.moved  # the four BASE moves, a deeper chain's on first use
        c = moved.get(batch.direction) or moved.setdefault(batch.direction, DirectionCounters())
        ok_pages = results.count(True)
        c.bytes += ok_pages * batch.page_size
        c.pages += ok_pages
        c.failures += len(batch) - ok_pages
        c.batches += 1
        c.seconds += seconds
        c.observe(ok_pages * batch.page_size, seconds)

    def _count_tenants(self, batch: Moves, results: list[bool]) -> None:
        """The batch's successful pages, per tenant (one bincount)."""
        rows = batch.rows
        if len(rows) and results.count(True) != len(rows):
            rows = rows[np.array(results, dtype=bool)]
        self._place.ledger.count_moved(batch.direction, self._place.table.owner[rows],
                                       batch.page_size)
