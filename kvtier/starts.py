"""Starts: the engine core's queueing of page moves (the prepare side of its two-phase moves).

Contract (every method runs with the engine lock held, like the core it serves):
    * ``offload(rows)`` / ``restore_cpu(pool, rows)`` / ``restore_disk(rows)`` allocate the
      destination slots a chunk at a time (chunks of 2, 4, 8, ... batches: the first copies start
      before the rest is prepared), prepare the moves (``BulkMoves.prepare``) and queue them; a
      page that gets no destination slot stays where it was. They return how many were queued.
    * ``start_many`` / ``start_as_taken`` are the shared mechanics (slots given, or taken per
      chunk); the cascade queues its CPU->disk moves through ``start_many``.
    * A small urgent restore (at most ``INLINE_RESTORE_BYTES``) runs on the caller's thread with
      the core's inline handler and is completed before ``restore_cpu`` returns.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvtier.batches import growing_chunks
from kvtier.pagetable import by_value
from kvtier.transfer.base import Moves
from kvtier.types import Direction, Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore
    from kvtier.pool import Pool

log = logging.getLogger(__name__)
INLINE_RESTORE_BYTES = 8 << 20  # urgent restores up to this size run on the caller's thread


class Starts:
    """See the module docstring."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    def start_many(
        self,
        rows: np.ndarray,
        direction: Direction,
        dsts: np.ndarray,
        *,
        urgent: bool,
        out: list[Moves] | None = None,
        chunked: bool = True,
        final: bool = True,
    ) -> int:
        """Queue moves of ``rows`` (as many as there are ``dsts``) in growing chunks (a lane
        splits each into batches). With ``out`` the batches are collected there instead (the
        caller runs them). ``chunked=False``: one pass (the caller chunks; ``final`` says
        whether this is its last chunk: a lane ends a drain on small batches only after it)."""
        rows = rows[: len(dsts)]
        chunks = growing_chunks(len(rows), self._batch_pages(rows)) if chunked else [(0, len(rows))]
        for lo, hi in chunks:
            last = final and hi == len(rows)
            batches = self._core.bulk.prepare(rows[lo:hi], direction, dsts[lo:hi], urgent, last)
            if out is None:
                self._core.scheduler.submit(batches)
            else:
                out += batches
        return len(rows)

    def start_as_taken(
        self,
        rows: np.ndarray,
        direction: Direction,
        take: Callable[[int], np.ndarray],
        *,
        urgent: bool,
        then: Callable[[], object] | None = None,
    ) -> int:
        """``start_many`` with each chunk's slots taken (``take(k)``: up to ``k``) just before
        it is prepared, so copies start before the rest is taken; stops at a short take.
        ``then()`` runs once the first chunk is queued (the caller's bookkeeping overlaps
        the first copies; the lock held meanwhile keeps every completion out)."""
        queued = 0
        for lo, hi in growing_chunks(len(rows), self._batch_pages(rows)):
            slots = take(hi - lo)
            queued += self.start_many(
                rows[lo:hi], direction, slots, urgent=urgent, chunked=False, final=hi == len(rows)
            )
            if then is not None:
                then()
                then = None
            if len(slots) < hi - lo:
                break
        if then is not None:
            then()
        return queued

    def _batch_pages(self, rows: np.ndarray) -> int:
        if not len(rows):
            return 1
        return max(1, self._core.config.batch_bytes // int(self._core.table.size[rows[0]]))

    def offload(self, rows: np.ndarray, *, urgent: bool = False) -> int:
        """Queue GPU->CPU for unpinned GPU pages; returns how many were queued."""
        t = self._core.table
        if not len(rows) or not self._core.config.enabled:
            return 0
        todo = rows[t.at(rows, Tier.GPU) & (t.pins[rows] == 0)]
        queued = 0
        for (size, owner), group in self._groups(todo):
            cpu_slots = functools.partial(self._core.cascade.cpu_slots, size, owner=owner)
            started = self.start_as_taken(group, Direction.GPU_TO_CPU, cpu_slots, urgent=urgent)
            queued += started
            if started < len(group) and not self._core.ledger.active:
                return queued  # the CPU tier (and its cascade) ran out of room
        return queued

    def _groups(self, rows: np.ndarray) -> list[tuple[tuple[int, int], np.ndarray]]:
        """``rows`` by page size and, with tenant quotas, by tenant (``owner``; else 0)."""
        t = self._core.table
        out = []
        for size, pos in by_value(t.size[rows]):
            group = rows if len(pos) == len(rows) else rows[pos]
            if not self._core.ledger.active:
                out.append(((size, 0), group))
                continue
            for owner, opos in by_value(t.owner[group]):
                out.append(((size, owner), group if len(opos) == len(group) else group[opos]))
        return out

    def restore_cpu(
        self,
        pool: Pool,
        rows: np.ndarray,
        *,
        urgent: bool = True,
        then: Callable[[], object] | None = None,
    ) -> int:
        """CPU->GPU for as many pages as the pool has free slots; ``then()`` runs before any
        of them can land (after the first queued chunk, or first of all).

        A small urgent restore (at most ``INLINE_RESTORE_BYTES``) runs right here on the caller's
        thread with its own stream and staging: no hand-off to a lane and back, which under an
        offload backlog costs more than the copy. Larger ones are queued on the up lane.
        """
        n = min(pool.dev.num_free, len(rows))
        up = Direction.CPU_TO_GPU
        if n and (not urgent or n * pool.page_size > INLINE_RESTORE_BYTES or self._core.closed):
            return self.start_as_taken(rows[:n], up, pool.dev.take_some, urgent=urgent, then=then)
        if then is not None:
            then()
        if not n:
            return 0
        slots = pool.dev.take_some(n)
        batches: list[Moves] = []
        started = self.start_many(rows, up, slots, urgent=True, out=batches)
        for batch in batches:
            begin = time.perf_counter()
            try:
                results = self._core.inline_restore(pool.dev.device).run(batch)
            except Exception:
                log.exception("inline restore of %d pages failed", len(batch))
                results = [False] * len(batch)
            self._core.complete(batch, results, time.perf_counter() - begin)
        return started

    def restore_disk(self, rows: np.ndarray) -> int:
        """Queue disk->CPU (the first leg of a disk restore), one CPU allocation per page size."""
        started = 0
        for (size, owner), group in self._groups(rows):
            slots = self._core.cascade.cpu_slots(size, len(group), owner)
            started += self.start_many(group, Direction.DISK_TO_CPU, slots, urgent=True)
        return started
