"""The starter: queueing page moves (the prepare side of two-phase moves) and taking them back.

Built on the placement, the bulk moves, the scheduler and the completion (for inline restores);
it builds the cascade it makes room with, as that cascade's ``MoveStarter``.

Contract (every method runs with the engine lock held):
    * ``offload(rows)`` / ``restore_cpu(pool, rows)`` / ``restore_below(rows)`` allocate the
      destination slots a chunk at a time (chunks of 2, 4, 8, ... batches: the first copies start
      before the rest is prepared), prepare the moves (``BulkMoves.prepare``) and queue them; a
      page that gets no destination slot stays where it was. They return how many were queued.
    * ``start_many`` / ``start_as_taken`` are the shared mechanics (slots given, or taken per
      chunk); the cascade queues its moves down the chain through ``start_many``.
    * A small urgent restore (at most ``INLINE_RESTORE_BYTES``) runs on the caller's thread with
      the pool device's inline handler and is completed before ``restore_cpu`` returns.
    * ``cancel(rows)`` takes back queued (not started) moves: those pages stay where they were.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvtier.moves.batch import BulkMoves
from kvtier.moves.completion import Completion
from kvtier.moves.demotion import Cascade
from kvtier.moves.frees import Frees
from kvtier.moves.landings import Landings
from kvtier.scheduler import TransferScheduler
from kvtier.state.placement import Placement
from kvtier.state.table import by_value
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.types import Direction, Tier

if TYPE_CHECKING:
    from kvtier.state.pool import Pool

log = logging.getLogger(__name__)
INLINE_RESTORE_BYTES = 8 << 20  # urgent restores up to this size run on the caller's thread


class Starter:
    """See the module docstring."""

    def __init__(
        self,
        place: Placement,
        bulk: BulkMoves,
        scheduler: TransferScheduler,
        completion: Completion,
        landings: Landings,
        inline_restore: Callable[[str], TransferHandler],
    ) -> None:
        """``inline_restore(device)``: the CPU->GPU handler for a pool's device."""
        self._place, self._bulk, self._scheduler = place, bulk, scheduler
        self._completion, self._landings = completion, landings
        self._inline_restore = inline_restore
        self.cascade = Cascade(place, self)

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
            batches = self._bulk.prepare(rows[lo:hi], direction, dsts[lo:hi], urgent, last)
            if out is None:
                self._scheduler.submit(batches)
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
        return max(1, self._place.config.batch_bytes // int(self._place.table.size[rows[0]]))

    def offload(self, rows: np.ndarray, *, urgent: bool = False) -> int:
        """Queue GPU->CPU for unpinned GPU pages; returns how many were queued."""
        t = self._place.table
        if not len(rows) or not self._place.config.enabled:
            return 0
        todo = rows[t.at(rows, Tier.GPU) & (t.pins[rows] == 0)]
        queued = 0
        for (size, owner), group in self._groups(todo):
            cpu_slots = functools.partial(self.cascade.cpu_slots, size, owner=owner)
            started = self.start_as_taken(group, Direction.GPU_TO_CPU, cpu_slots, urgent=urgent)
            queued += started
            if started < len(group) and not self._place.ledger.active:
                return queued  # the CPU tier (and its cascade) ran out of room
        return queued

    def _groups(self, rows: np.ndarray) -> list[tuple[tuple[int, int], np.ndarray]]:
        """``rows`` by page size and, with tenant quotas, by tenant (``owner``; else 0)."""
        t = self._place.table
        out = []
        for size, pos in by_value(t.size[rows]):
            group = rows if len(pos) == len(rows) else rows[pos]
            if not self._place.ledger.active:
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
        if n and (not urgent or n * pool.page_size > INLINE_RESTORE_BYTES or self._place.closed):
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
                results = self._inline_restore(pool.dev.device).run(batch)
            except Exception:
                log.exception("inline restore of %d pages failed", len(batch))
                results = [False] * len(batch)
            self._completion.complete(batch, results, time.perf_counter() - begin)
        return started

    def restore_below(self, rows: np.ndarray) -> int:
        """Queue the first leg of a restore from below the CPU: each page is read straight from
        the level holding it into a CPU slot (one read, whatever the depth; no room is needed
        on the levels between), one CPU allocation per page size (and tenant). The pages are
        guarded meanwhile, so making CPU room (which walks the chain down) never moves them."""
        place, started = self._place, 0
        place.protect(rows)
        try:
            for (size, owner), group in self._groups(rows):
                slots = self.cascade.cpu_slots(size, len(group), owner)
                group = group[: len(slots)]
                for level, pos in by_value(place.table.tier[group]):
                    whole = len(pos) == len(group)
                    part, dsts = (group, slots) if whole else (group[pos], slots[pos])
                    up = Direction((level, Tier.CPU))
                    started += self.start_many(part, up, dsts, urgent=True)
        finally:
            place.unprotect(rows)
        return started

    def cancel(self, rows: np.ndarray) -> np.ndarray:
        """Take back the queued (not started) moves of ``rows``: those pages stay where they
        were. Returns the rows cancelled; the others' moves are under way (or there are none).
        One pass per distinct batch, whatever the number of rows."""
        place = self._place
        numbers = place.table.move[rows]
        live = np.flatnonzero(numbers)
        if not len(live):
            return rows[:0]
        done: list[np.ndarray] = []
        for number, pos in by_value(numbers[live]):
            batch = self._bulk.batch(number)
            if batch is None:  # every column already taken by a lane
                continue
            got, srcs, dsts = self._scheduler.cancel(batch, rows[live[pos]])
            if not len(got):
                continue
            place.counters.cancelled_offloads += 0 if batch.direction.is_restore else len(got)
            if batch.direction is Direction.CPU_TO_GPU:
                self._landings.end(len(got))
            frees = Frees()
            failed = np.zeros(len(got), dtype=bool)
            self._bulk.finish_cols(batch.direction, got, srcs, dsts, failed, frees, corrupt=False)
            frees.apply(place)
            done.append(got)
        return np.concatenate(done) if done else rows[:0]


def growing_chunks(n: int, step: int) -> list[tuple[int, int]]:
    """``[0, n)`` in chunks of 2, 4, 8, ... times ``step`` items: the first two batches'
    copies start at once (a lane launches the second while the first copies, so it never waits
    on the caller's next chunk with its copy engine idle), and each later chunk is prepared
    while the lanes copy the ones before it, in a handful of passes whatever ``n``."""
    out, lo, size = [], 0, 2 * step
    while lo < n:
        out.append((lo, min(n, lo + size)))
        lo += size
        size *= 2
    return out
