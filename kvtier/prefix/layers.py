"""A keyed load of a registered pool, layer group by layer group.

``engine.load`` copies every segment of each stored block before it returns, so an engine that
waits per layer (vLLM's ``wait_for_layer_load``) waits for the last layer before the first.
``load_layers`` copies the same blocks one group of segments at a time, in order, and says when
each group has landed, so the first layers can run while the later ones are still copied.

Contract:
    * ``load_layers(prefix, pool_id, keys, slots, bounds) -> Iterator[int]``: a generator.
      ``bounds``: segment indices of the pool, ``0 = b0 < b1 < ... < bG = len(segments)`` (else
      ``InvalidArgument("segment_bounds")``); keys and slots are checked as ``load`` checks
      them. Every error is raised at the first ``next()``, before anything is copied.
    * The stored prefix of ``keys`` (local tiers and remote hits, as ``load`` finds it; of its
      blocks below the CPU tier at most half the CPU tier and the tenant's CPU quota: the rest
      of a longer prefix is not loaded) is brought to the CPU tier and protected once. Then for
      each group ``g``, segments ``[b_g, b_g+1)`` of each block of that prefix are copied into
      its slot (nothing else of the slot is written), waited for, and the generator yields how
      many leading blocks are loaded in every group so far: the values never grow (a copy that
      failed ends the prefix early). Blocks past the last value yielded are not loaded,
      whatever earlier groups wrote into them.
    * With a ``caller`` (``kvtier/caller.py``), no group is copied once it is gone (the values
      yielded from then on are 0).
    * Closing the generator early, or an error, returns the protection; the blocks loaded count
      as hits (the eviction policy's touch) once the last group is in.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from kvtier.caller import Caller
from kvtier.errors import InvalidArgument
from kvtier.prefix.copies import send
from kvtier.prefix.salt import salt_keys
from kvtier.prefix.shared import Held, land, offer, unstage
from kvtier.state.pool import Pool
from kvtier.transfer.base import Moves
from kvtier.types import Direction, PoolId
from kvtier.validate import unrepeated

if TYPE_CHECKING:
    from kvtier.prefix.store import PrefixStore

MAX_GROUPS = 4096


def check_bounds(bounds: Sequence[int], segments: int) -> list[int]:
    b = [int(x) for x in bounds]
    if (
        len(b) < 2
        or len(b) > MAX_GROUPS + 1
        or b[0] != 0
        or b[-1] != segments
        or any(x >= y for x, y in pairwise(b))
    ):
        raise InvalidArgument(
            "segment_bounds",
            f"need 0 = b0 < b1 < ... = {segments} (the pool's segments), at most "
            f"{MAX_GROUPS} groups",
        )
    return b


def load_layers(
    prefix: PrefixStore,
    pool_id: PoolId,
    keys: Sequence[bytes],
    slots: Sequence[int],
    bounds: Sequence[int],
    caller: Caller | None = None,
) -> Iterator[int]:
    core, caller = prefix.core, caller or Caller()  # none given: one that waits
    keys, slots = unrepeated(keys, slots)
    with core.cond:
        pool = prefix.pool(pool_id)
        keys, slots = prefix.args(pool, keys, slots)
        b = check_bounds(bounds, len(pool.segments))
    staged = prefix.fetch_remote(pool_id, keys, slots)  # in CPU slots, not yet pages
    reused: Held = []
    rows: np.ndarray | None = None
    try:
        with core.cond:
            if staged is not None:
                land(core, staged)
                staged = None
            salted = salt_keys(pool.tenant, keys)
            lent = len(prefix.lendable(pool, salted))
            rows = prefix.resident_prefix(pool, salted[:lent], None,  # protected until the end
                                          caller.patience)
            srcs, dsts = core.table.slot[rows], np.array(slots[: len(rows)], dtype=np.int64)
        n = len(rows)
        for lo, hi in pairwise(b):
            if caller.gone:
                n = 0  # it may have reused its slots: nothing more is copied
            if n:
                n = _copy_group(prefix, pool, rows[:n], srcs[:n], dsts[:n], (lo, hi), caller)
            yield n
        with core.cond:
            reused = prefix.reused(pool, rows[:n])
    finally:
        with core.cond:
            if staged is not None:
                unstage(core, staged)
            if rows is not None:
                core.unprotect(rows)
        offer(core, reused)


def _copy_group(
    prefix: PrefixStore,
    pool: Pool,
    rows: np.ndarray,
    srcs: np.ndarray,
    dsts: np.ndarray,
    segments: tuple[int, int],
    caller: Caller | None = None,
) -> int:
    """One group's copies of the blocks (urgent, as a load's); how many leading ones landed."""
    core = prefix.core
    batch = Moves(Direction.CPU_TO_GPU, pool.page_size, srcs, dsts, rows, pool.dev,
                  segments=segments, caller=caller)
    batch.copy, batch.urgent, batch.results = True, True, [None] * len(rows)
    with core.cond:
        prefix.pool(pool.pool_id)  # still attached (NotFound if detached meanwhile)
        send(core, batch)
        prefix.wait([batch])
    results = batch.results or []
    return results.index(False) if False in results else len(results)
