"""Bulk moves: the engine core's per-batch preparation and completion of page moves.

Contract (everything runs with the engine lock held, like the core it serves):
    * ``prepare(pages, direction, dsts, urgent)`` is ``EngineCore.start`` for a batch of pages
      of one direction: they leave their tier's policy in one call per pool or page size, are
      marked moving and get their moves (spare ones first).
    * ``finish(moves, results, frees)`` is ``EngineCore.finish`` of each move, in order; runs
      of plain successful moves are settled with one slot free, one ``slot_pages`` update and
      one policy ``insert_many`` per pool or page size, and their waits advanced per batch.
    * ``recycle(moves)`` keeps a completed batch's engine moves for reuse: a new object per
      page moved makes the cyclic GC run full collections over every live page every ~70k
      moves, which cost more than the moves. Copy moves are never reused (their callers read
      ``result``); nothing else holds a move once it completed (the scheduler promises not to
      read it again and its page's ``move`` was cleared).
    * ``settle_new`` / ``release_pages``: ``settle`` of newly allocated GPU pages and
      ``release_page`` of settled GPU/CPU pages, one call per pool, tier and page size.
"""

from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING, cast

from kvtier.batches import Frees, consume, split_by
from kvtier.events import Event
from kvtier.pagetable import Page, advance_waits_many
from kvtier.transfer.base import Move
from kvtier.types import Direction, PageState, Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore
    from kvtier.pool import Pool
    from kvtier.tiers.device import DevicePool

SPARE_MOVES = 1 << 16  # spare moves kept at most
_GPU_SIDE = (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU)
_STATE_OF = {Tier.GPU: PageState.GPU, Tier.CPU: PageState.CPU, Tier.DISK: PageState.DISK}


class BulkMoves:
    """See the module docstring."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self.spares: list[Move] = []

    def settle_new(self, pool: Pool, pages: list[Page]) -> None:
        """``settle`` of new pages already placed in ``pool``'s slots, in one call."""
        pool.slot_pages.update(zip([p.slot for p in pages], pages, strict=True))
        pool.policy.insert_many([p.meta() for p in pages])

    def release_pages(self, pages: list[Page]) -> None:
        """``release_page`` of settled GPU and CPU pages (not moving), a call per tier, pool
        and page size rather than per page."""
        core = self._core
        keys = [(p.tier, p.pool_id, p.page_size) for p in pages]
        for (tier, pool_id, size), (group,) in split_by(keys, pages):
            assert tier is not Tier.DISK and all(p.state is _STATE_OF[tier] for p in group)
            pool = core.pools.get(pool_id) if pool_id is not None else None
            ids, slots = [p.page_id for p in group], [p.slot for p in group]
            if tier is Tier.GPU:
                assert pool is not None
                pool.policy.remove_many(ids)
                consume(map(pool.slot_pages.pop, slots, repeat(None)))
                pool.dev.free(slots)
            else:
                core.tier_policy(tier, size).remove_many(ids)
                core.host.free(size, slots)
            if pool is not None:
                pool.pinned.difference_update(ids)
            core.table.remove_many(group)

    def prepare(
        self, pages: list[Page], direction: Direction, dsts: list[int], urgent: bool
    ) -> list[Move]:
        """The moves of ``pages`` (one direction): out of their tier's policy, marked moving."""
        core = self._core
        state = PageState.MOVING_UP if direction.is_restore else PageState.MOVING_DOWN
        from_gpu = direction is Direction.GPU_TO_CPU
        gpu_side = direction in _GPU_SIDE
        moves: list[Move] = []
        for pool_id, (group, gdsts) in split_by([p.pool_id for p in pages], pages, dsts):
            pool = core.pools[pool_id] if pool_id is not None else None
            ids = [p.page_id for p in group]
            if from_gpu:
                assert pool is not None
                pool.policy.remove_many(ids)
                consume(map(pool.slot_pages.pop, [p.slot for p in group], repeat(None)))
                pool.moving_down += len(group)
            else:
                for size, (sized,) in split_by([p.page_size for p in group], ids):
                    core.tier_policy(direction.src, size).remove_many(sized)
            dev = pool.dev if gpu_side and pool is not None else None
            part = self._moves(direction, group, gdsts, dev, urgent)
            for page, move in zip(group, part, strict=True):
                page.move = move
                page.state = state
            moves += part
        return moves

    def _moves(
        self,
        direction: Direction,
        pages: list[Page],
        dsts: list[int],
        dev: DevicePool | None,
        urgent: bool,
    ) -> list[Move]:
        """Moves of ``pages`` to ``dsts``: spare (finished) moves first, then new ones."""
        spare = self.spares
        k = min(len(spare), len(pages))
        reused = spare[len(spare) - k :]
        del spare[len(spare) - k :]
        for move, page, dst in zip(reused, pages, dsts, strict=False):  # the first k pages
            move.direction, move.page_size = direction, page.page_size
            move.src, move.dst = page.slot, dst
            move.page, move.pool, move.urgent, move.ready = page, dev, urgent, page.ready
        return reused + [
            Move(direction, p.page_size, p.slot, dst, p, dev, False, urgent, p.ready)
            for p, dst in zip(pages[k:], dsts[k:], strict=True)
        ]

    def recycle(self, moves: list[Move]) -> None:
        """Keep a completed batch's engine moves as spares. Copy moves are never reused: their
        callers read ``result``. Nothing else holds a move once it completed (the scheduler
        promises not to read it again; its page's ``move`` was cleared)."""
        room = SPARE_MOVES - len(self.spares)
        done = [m for m in moves[: max(0, room)] if not m.copy and m.page is not None]
        for move in done:
            move.page = move.pool = move.ready = None
        self.spares += done

    def finish(self, moves: list[Move], results: list[bool], frees: Frees) -> None:
        """``EngineCore.finish`` of each, in order; plain successful runs settled in bulk."""
        core = self._core
        direction = moves[0].direction if moves else None
        run: list[Move] = []
        for move, ok in zip(moves, results, strict=True):
            if ok and not move.copy and move.page is not None and move.direction is direction:
                run.append(move)
                continue
            if run:
                self._settle_moved(run, frees)
                run = []
            core.finish(move, ok, frees)
        if run:
            self._settle_moved(run, frees)

    def _settle_moved(self, run: list[Move], frees: Frees) -> None:
        """What ``EngineCore.finish`` does for successful moves of one direction, with a call
        per batch for the slots and policies instead of one per page."""
        core = self._core
        direction = run[0].direction
        src, dst = direction._value_
        if dst is Tier.DISK:  # disk records are written per page
            for move in run:
                core.finish(move, True, frees)
            return
        state = _STATE_OF[dst]
        pages = cast("list[Page]", [m.page for m in run])
        for page, move in zip(pages, run, strict=True):
            page.move = None
            page.tier, page.slot, page.state = dst, move.dst, state
        for pool_id, (group, gmoves) in split_by([p.pool_id for p in pages], pages, run):
            pool = core.pools.get(pool_id) if pool_id is not None else None
            self._settle_group(direction, pool, group, gmoves, frees)
        if core.events.active:
            for page in pages:
                core.events.publish(Event("moved", page.pool_id, page.page_id, src, dst))
        waiting = [p for p in pages if p.waits]
        if waiting:
            for pool_id, (group,) in split_by([p.pool_id for p in waiting], waiting):
                pool = core.pools.get(pool_id) if pool_id is not None else None
                advance_waits_many(group, pool.pinned if pool is not None else set())
        doomed = [p for p in pages if p.doomed]
        if doomed:
            frees.apply(core)  # the pages' own slots must be settled before they go
            for page in doomed:
                core.release_page(page)
                core.events.publish(Event("freed", page.pool_id, page.page_id, None, None))

    def _settle_group(
        self,
        direction: Direction,
        pool: Pool | None,
        pages: list[Page],
        moves: list[Move],
        frees: Frees,
    ) -> None:
        """Slots and policies of moved pages of one pool (or of no pool: keyed pages)."""
        core = self._core
        src, dst = direction._value_
        srcs = [m.src for m in moves]
        if src is Tier.GPU:
            assert pool is not None
            pool.moving_down -= len(pages)
            frees.add_many(src, pool, pages[0].page_size, srcs)
        else:
            for size, (slots,) in split_by([p.page_size for p in pages], srcs):
                frees.add_many(src, pool, size, slots)
        metas = [p.meta() for p in pages]
        if dst is Tier.GPU:
            assert pool is not None
            pool.slot_pages.update(zip([m.dst for m in moves], pages, strict=True))
            pool.policy.insert_many(metas)
        else:
            for size, (part,) in split_by([p.page_size for p in pages], metas):
                core.tier_policy(dst, size).insert_many(part)
