"""Bulk moves: the engine core's per-batch preparation and completion of page moves.

Contract (everything runs with the engine lock held, like the core it serves):
    * ``prepare(pages, direction, dsts, urgent)`` is ``EngineCore.start`` for pages of one
      direction: they leave their tier's policy in one call per pool or page size, are marked
      moving and get one :class:`Moves` batch per pool (GPU side) or page size (disk side);
      ``page.move`` is the batch a page was prepared in.
    * ``finish(batch, lo, hi, results, frees)`` completes columns ``lo:hi`` of a batch like
      ``EngineCore.finish_column`` of each; when all of them succeeded (the common case) they
      are settled with one slot free, one ``slot_pages`` update and one policy ``insert_many``,
      and their waits are advanced together.
    * ``settle_new`` / ``release_pages``: ``settle`` of newly allocated GPU pages and
      ``release_page`` of settled GPU/CPU pages, one call per pool, tier and page size.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from kvtier.batches import Frees, consume, split_by
from kvtier.events import Event
from kvtier.pagetable import Page, advance_waits_many
from kvtier.transfer.base import Moves
from kvtier.types import Direction, PageState, Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore
    from kvtier.pool import Pool

_GPU_SIDE = (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU)
_STATE_OF = {Tier.GPU: PageState.GPU, Tier.CPU: PageState.CPU, Tier.DISK: PageState.DISK}
_READY, _POOL_ID, _SIZE = attrgetter("ready"), attrgetter("pool_id"), attrgetter("page_size")


def _events(pages: list[Page]) -> list[Any]:
    """The distinct CUDA events the pages were last released with."""
    events = set(map(_READY, pages))
    events.discard(None)
    return list(events)


class BulkMoves:
    """See the module docstring."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

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
    ) -> list[Moves]:
        """The batches moving ``pages`` to ``dsts``: out of their tier's policy, marked moving."""
        core = self._core
        state = PageState.MOVING_UP if direction.is_restore else PageState.MOVING_DOWN
        gpu_side = direction in _GPU_SIDE
        keys = list(map(_POOL_ID if gpu_side else _SIZE, pages))
        out: list[Moves] = []
        for key, (group, gdsts) in split_by(keys, pages, dsts):
            ids = [p.page_id for p in group]
            srcs = [p.slot for p in group]
            size = group[0].page_size
            pool = core.pools[key] if gpu_side else None
            if direction is Direction.GPU_TO_CPU:
                assert pool is not None
                pool.policy.remove_many(ids)
                consume(map(pool.slot_pages.pop, srcs, repeat(None)))
                pool.moving_down += len(group)
            else:
                core.tier_policy(direction.src, size).remove_many(ids)
            batch = Moves(
                direction,
                size,
                srcs,
                list(gdsts),
                list(group),
                pool.dev if pool is not None else None,
                False,
                urgent,
                _events(group) if gpu_side else [],
            )
            for page in group:
                page.move = batch
                page.state = state
            out.append(batch)
        return out

    def finish(self, batch: Moves, lo: int, hi: int, results: list[bool], frees: Frees) -> None:
        """Columns ``lo:hi`` of a completed batch; see the module docstring."""
        core = self._core
        if batch.copy or not batch.pages or False in results[lo:hi]:
            for i in range(lo, hi):
                core.finish_column(batch, i, results[i], frees)
        elif batch.direction.dst is Tier.DISK:  # disk records are written per page
            for i in range(lo, hi):
                core.finish_column(batch, i, True, frees)
        else:
            self._settle_moved(batch, lo, hi, frees)

    def _settle_moved(self, batch: Moves, lo: int, hi: int, frees: Frees) -> None:
        """What ``EngineCore.finish_column`` does for successful columns of a batch (into the
        GPU or CPU tier), with a call per batch for the slots and policies."""
        core = self._core
        src, dst = batch.direction._value_
        pages, srcs, dsts = batch.pages[lo:hi], batch.srcs[lo:hi], batch.dsts[lo:hi]
        state = _STATE_OF[dst]
        for page, slot in zip(pages, dsts, strict=True):
            page.move = None
            page.tier, page.slot, page.state = dst, slot, state
        pool_id = pages[0].pool_id
        pool = core.pools.get(pool_id) if pool_id is not None and Tier.GPU in (src, dst) else None
        if src is Tier.GPU:
            assert pool is not None
            pool.moving_down -= len(pages)
        frees.add_many(src, pool, batch.page_size, srcs)
        metas = [p.meta() for p in pages]
        if dst is Tier.GPU:
            assert pool is not None
            pool.slot_pages.update(zip(dsts, pages, strict=True))
            pool.policy.insert_many(metas)
        else:
            core.tier_policy(dst, batch.page_size).insert_many(metas)
        if core.events.active:
            for page in pages:
                core.events.publish(Event("moved", page.pool_id, page.page_id, src, dst))
        waiting = [p for p in pages if p.waits]
        if waiting:
            for pool_id, (group,) in split_by([p.pool_id for p in waiting], waiting):
                owner = core.pools.get(pool_id) if pool_id is not None else None
                advance_waits_many(group, owner.pinned if owner is not None else set())
        doomed = [p for p in pages if p.doomed]
        if doomed:
            frees.apply(core)  # the pages' own slots must be settled before they go
            for page in doomed:
                core.release_page(page)
                core.events.publish(Event("freed", page.pool_id, page.page_id, None, None))
