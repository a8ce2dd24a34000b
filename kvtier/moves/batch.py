"""Bulk moves: the per-batch preparation and completion of page moves, over the placement.

Contract (everything runs with the engine lock held):
    * ``prepare(rows, direction, dsts, urgent)`` turns pages of one direction into
      :class:`Moves` batches, one per pool (GPU side) or page size (disk side): the pages leave
      their tier's policy in one call, are marked moving, and the table's ``move`` column numbers
      the batch each was prepared in; ``batch(number)`` finds it while anything holds it (for
      ``cancel``).
    * ``finish(batch, lo, hi, results, frees)`` completes columns ``lo:hi`` of a batch;
      ``finish_cols`` is the same for explicit columns (a cancelled move). Successes free their
      source slot (into ``frees``) and settle at the destination; failures free the destination
      and settle back at the source, a failed disk read is dropped as corrupt. Pages that land on
      the GPU take their waiting acquires' pins at once; pages freed while moving are released.
    * Everything is one numpy pass or one policy call per batch; a page costs no Python work
      unless events are subscribed or pages carry disk records.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import numpy as np

from kvtier.moves.frees import Frees
from kvtier.state.events import Event
from kvtier.state.placement import Placement
from kvtier.state.ready import ReadyEvents
from kvtier.state.table import by_value
from kvtier.transfer.base import Moves
from kvtier.types import BELOW_CPU, Direction, PoolId, Tier

if TYPE_CHECKING:
    from kvtier.state.pool import Pool

_GPU_SIDE = (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU)


class BulkMoves:
    """See the module docstring."""

    def __init__(self, place: Placement, ready: ReadyEvents) -> None:
        """``ready``: the GPU-side events a copy out of a pool waits for (its last use)."""
        self._place = place
        self._ready = ready
        # Numbers, not objects, in the table: an object column costs a reference count per
        # page on every write. A batch no queue holds any more drops out by itself.
        self._batches: weakref.WeakValueDictionary[int, Moves] = weakref.WeakValueDictionary()
        self._numbers = itertools.count(1)

    def batch(self, number: int) -> Moves | None:
        """The batch prepared as ``number``, if something still holds it."""
        return self._batches.get(number)

    def prepare(
        self,
        rows: np.ndarray,
        direction: Direction,
        dsts: np.ndarray,
        urgent: bool,
        final: bool = True,
    ) -> list[Moves]:
        """The batches moving ``rows`` to ``dsts``: out of their tier's policy, marked moving
        (``final``: the caller queues nothing after them, see ``Moves.final``)."""
        place, t = self._place, self._place.table
        gpu_side = direction in _GPU_SIDE
        out: list[Moves] = []
        for key, pos in by_value(t.pool[rows] if gpu_side else t.size[rows]):
            whole = len(pos) == len(rows)
            group, gdsts = (rows, dsts) if whole else (rows[pos], dsts[pos])
            size = int(t.size[group[0]])
            pool = place.pools[PoolId(key)] if gpu_side else None
            place.unsettle(group, direction.src, pool, size)
            if pool is not None and direction is Direction.GPU_TO_CPU:
                pool.moving_down += len(group)
            elif direction.src >= BELOW_CPU and not direction.is_restore:
                place.leave(direction.src, size, len(group))
            events = self._ready.events(t.ready[group]) if gpu_side else []
            batch = Moves(
                direction,
                size,
                t.slot[group],
                gdsts,
                group,
                pool.dev if pool is not None else None,
                False,
                urgent,
                events,
                final=final,
            )
            if direction.dst != Tier.GPU:  # the destination slots are the tenant's now
                owners = place.ledger.per_owner(t.owner[group], size)
                place.ledger.incoming[place.wire[direction.dst]] += owners
            number = next(self._numbers)
            self._batches[number] = batch
            t.mark_moving(group, direction.is_restore, number)
            out.append(batch)
        return out

    def finish(self, batch: Moves, lo: int, hi: int, results: list[bool], frees: Frees) -> None:
        """Columns ``lo:hi`` of a completed batch; see the module docstring."""
        rows = batch.rows[lo:hi]
        if not len(rows):
            return
        part = results[lo:hi]
        # ``count(True)`` matches by identity, ~20x faster than ``False in part`` (an equality
        # test per element) over a 4,096-page batch.
        ok = None if part.count(True) == len(part) else np.array(part, dtype=bool)
        srcs, dsts = batch.srcs[lo:hi], batch.dsts[lo:hi]
        if batch.copy:
            self._finish_store(batch, rows, dsts, ok)
            return
        self.finish_cols(batch.direction, rows, srcs, dsts, ok, frees, corrupt=True)

    def _finish_store(
        self, batch: Moves, rows: np.ndarray, dsts: np.ndarray, ok: np.ndarray | None
    ) -> None:
        """A copy batch: stored blocks (GPU->CPU) settle in the CPU tier or are forgotten;
        loads leave their pages as they are."""
        place = self._place
        if batch.direction is not Direction.GPU_TO_CPU:
            return
        ledger = place.ledger
        ledger.incoming[Tier.CPU] -= ledger.per_owner(place.table.owner[rows], batch.page_size)
        good, bad = (rows, rows[:0]) if ok is None else (rows[ok], rows[~ok])
        if len(good):
            place.settle(good, Tier.CPU, dsts if ok is None else dsts[ok], None)
        if len(bad):
            assert ok is not None
            place.free_slots(Tier.CPU, batch.page_size, dsts[~ok], None)
            place.table.remove(bad)

    def finish_cols(
        self,
        direction: Direction,
        rows: np.ndarray,
        srcs: np.ndarray,
        dsts: np.ndarray,
        ok: np.ndarray | None,
        frees: Frees,
        *,
        corrupt: bool,
    ) -> None:
        """Complete moves of ``rows`` (one pool or page size); ``ok`` None = all succeeded.
        ``corrupt``: a failed disk read means bad bytes (drop), not a cancelled one."""
        place, t = self._place, self._place.table
        src, dst = direction._value_
        size = int(t.size[rows[0]])
        if dst != Tier.GPU:  # reserved at ``prepare``: settled below, or given back
            place.ledger.incoming[place.wire[dst]] -= place.ledger.per_owner(t.owner[rows], size)
        pool_id = int(t.pool[rows[0]])
        pool = place.pools.get(PoolId(pool_id)) if Tier.GPU in (src, dst) else None
        if pool is not None and src == Tier.GPU:
            pool.moving_down -= len(rows)
        elif src >= BELOW_CPU and dst > src:
            place.leave(src, size, -len(rows))
        if ok is None:
            self._settled(rows, direction, srcs, dsts, pool, size, frees)
        else:
            good = ok.nonzero()[0]
            bad = (~ok).nonzero()[0]
            self._settled(rows[good], direction, srcs[good], dsts[good], pool, size, frees)
            self._failed(rows[bad], direction, srcs[bad], dsts[bad], pool, size, corrupt)
        doomed = rows[t.doomed[rows]]
        if len(doomed):
            frees.apply(place)  # the pages' own slots must be settled before they go
            self._release_doomed(doomed)

    def _settled(
        self,
        rows: np.ndarray,
        direction: Direction,
        srcs: np.ndarray,
        dsts: np.ndarray,
        pool: Pool | None,
        size: int,
        frees: Frees,
    ) -> None:
        if not len(rows):
            return
        place = self._place
        src, dst = direction._value_
        if place.keeps_copies(src, dst):  # keyed pages keep their slots there (placement.py)
            keyed = place.table.pool[rows] == 0
            if keyed.any():
                place.keep_copies(rows[keyed], srcs[keyed], size)
                srcs = srcs[~keyed]
        frees.add(src, pool, size, srcs)
        place.settle(rows, dst, dsts, pool)
        if dst in place.media:  # a slot medium below the CPU keeps keyed pages' records
            place.set_records(rows, size, dst)
        if dst == Tier.GPU:
            assert pool is not None
            place.land(pool, rows)
        if place.events.active:
            t = place.table
            for page_id, pool_id in zip(t.ids(rows).tolist(), t.pool[rows].tolist(), strict=True):
                place.events.publish(Event("moved", pool_id or None, page_id, place.wire[src],
                                           place.wire[dst]))

    def _failed(
        self,
        rows: np.ndarray,
        direction: Direction,
        srcs: np.ndarray,
        dsts: np.ndarray,
        pool: Pool | None,
        size: int,
        corrupt: bool,
    ) -> None:
        if not len(rows):
            return
        place = self._place
        src, dst = direction._value_
        place.free_slots(dst, size, dsts, pool)
        place.settle(rows, src, srcs, pool)
        if src == Tier.GPU:
            assert pool is not None
            place.land(pool, rows)
        # A restore read from a medium below the CPU that failed: its bytes there are bad.
        if src >= BELOW_CPU and dst == Tier.CPU and corrupt and not place.closed:
            place.counters.checksum_failures += len(rows)
            place.drop(rows, "corrupt")

    def _release_doomed(self, rows: np.ndarray) -> None:
        place, t = self._place, self._place.table
        ids, pools = t.ids(rows).tolist(), t.pool[rows].tolist()
        place.release(rows)
        for page_id, pool_id in zip(ids, pools, strict=True):
            place.events.publish(Event("freed", pool_id or None, page_id, None, None))
