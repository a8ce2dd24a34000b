"""Keyed pages lent in place: the CPU-tier bytes of a stored prefix, read by the caller.

``engine.load`` copies a stored prefix into pool slots through the engine's lanes, all of it
before it returns. An in-process caller that lays the bytes out its own way (the transformers
integration copies a prefix layer group by layer group into a static KV buffer, so the prefill
of group ``g`` can start while group ``g + 1`` is still on the link) borrows the pages instead.

Contract:
    * ``borrow(prefix, pool_id, keys, plan=None, patience=None) -> Borrowed``: the longest
      stored prefix of ``keys`` (the pool's tenant and page size, as ``load`` would find it;
      local tiers only), with at most half the CPU tier (and the tenant's CPU quota) of it
      below the CPU tier at once (blocks already there need no room), brought to the CPU tier
      (disk blocks are read and checked first) and protected there: no page of it is evicted,
      demoted or rewritten until ``release()``. Counted as a load (hits, the eviction policy's
      touch). ``plan(tiers) -> n`` (called once, with the engine lock held: quick, no waiting)
      sees where each stored block is at that moment (a page on its way to disk counts as
      disk) and keeps only the first ``n``: what it was told is what is borrowed, with no
      demotion in between. ``patience(landed) -> seconds`` (``kvtier.planner.Plan.patience``)
      bounds the wait for blocks below the CPU tier: once it has run out for the ``landed``
      leading blocks already there, those are lent and the rest is not (``prefix/resident.py``).
      ``Borrowed.cut``: fewer blocks were lent than planned (that, or the rest got no room).
    * ``Borrowed.views``: one ``uint8`` view of ``page_size`` bytes per block, in key order, of
      pinned (page-locked, device-mapped) host memory where CUDA is present (``pinned``): an
      asynchronous copy from it is a DMA. ``tiers``: where each block was when it was borrowed.
    * The caller must not write the views, and calls ``release()`` once every read of them has
      completed (for a copy on a CUDA stream: after synchronizing with it). ``release`` is
      idempotent; ``Borrowed`` is a context manager that releases on exit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.prefix.resident import Patience
from kvtier.prefix.salt import salt_keys
from kvtier.prefix.shared import Held, offer
from kvtier.types import PoolId, Tier
from kvtier.validate import check_keys, first_repeat

if TYPE_CHECKING:
    from kvtier.core import EngineCore
    from kvtier.prefix.store import PrefixStore

Plan = Callable[[list[Tier]], int]  # tiers of the stored prefix -> how many leading blocks


def _tiers(core: EngineCore, rows: np.ndarray) -> list[Tier]:
    """Where each row's bytes will be read from: its tier, or for a page already on its way
    below the CPU, the disk (a load would wait for that write, then read it back)."""
    t = core.table
    down = t.moving_down(rows) & (t.tier[rows] >= 1)
    out = [core.wire[int(x)] for x in t.tier[rows].tolist()]
    return [Tier.DISK if d else x for x, d in zip(out, down.tolist(), strict=True)]


@dataclass(eq=False)
class Borrowed:
    """See the module docstring."""

    views: list[torch.Tensor]
    tiers: list[Tier]
    pinned: bool
    cut: bool = False  # fewer lent than planned: the rest got no room, or patience ran out
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.views)

    def release(self) -> None:
        done, self._release = self._release, None
        if done is not None:
            done()

    def __enter__(self) -> Borrowed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def borrow(prefix: PrefixStore, pool_id: PoolId, keys: Sequence[bytes],
           plan: Plan | None = None, patience: Patience | None = None) -> Borrowed:
    keys = check_keys("keys", keys)
    keys = keys[: first_repeat(keys)]  # a prefix ends at a repeated key (``unrepeated``)
    core = prefix.core
    reused: Held = []
    with core.cond:
        pool = prefix.pool(pool_id)
        salted = salt_keys(pool.tenant, keys)
        stored = prefix.lendable(pool, salted)
        tiers = _tiers(core, stored)
        n = len(stored) if plan is None else max(0, min(len(stored), int(plan(tiers))))
        if n == 0:  # nothing lent (a plan to recompute): nothing to protect, touch or count
            return Borrowed([], [], True)
        rows = prefix.resident_prefix(pool, salted[:n], patience=patience)
        try:
            slots = core.table.slot[rows].tolist()
            views = core.host.rows(pool.page_size, slots)
            pinned = all(core.host.is_pinned(pool.page_size, s) for s in slots)
            reused = prefix.reused(pool, rows)
        except BaseException:
            core.unprotect(rows)
            raise
    offer(core, reused)

    def release() -> None:
        with core.cond:
            core.unprotect(rows)

    done = release if len(rows) else None
    return Borrowed(views, tiers[: len(rows)], pinned, len(rows) < n, done)

