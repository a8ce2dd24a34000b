"""Per-batch helpers of the engine core: bulk slot frees, chunked submission, grouping."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier.transfer.base import Move
from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore
    from kvtier.pool import Pool
    from kvtier.scheduler import TransferScheduler


K = TypeVar("K", bound=Hashable)


def split_by(keys: list[K], *columns: Sequence[Any]) -> list[tuple[K, list[list[Any]]]]:
    """``columns`` (each aligned with ``keys``) split into one part per distinct key, in
    first-seen order and keeping the order within each part. One key (the common case) is one
    C-level count and no copy."""
    if not keys:
        return []
    first = keys[0]
    if keys.count(first) == len(keys):
        return [(first, [list(col) if not isinstance(col, list) else col for col in columns])]
    positions: dict[K, list[int]] = {}
    for i, key in enumerate(keys):
        positions.setdefault(key, []).append(i)
    return [(key, [[col[i] for i in pos] for col in columns]) for key, pos in positions.items()]


class Frees:
    """Source slots of a completed batch, returned to their tiers in one call per tier."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[tuple[Tier, int], tuple[Pool | None, list[int]]] = {}

    def add(self, tier: Tier, pool: Pool | None, page_size: int, slot: int) -> None:
        key = (tier, pool.pool_id if tier is Tier.GPU and pool is not None else page_size)
        entry = self._slots.get(key)
        if entry is None:
            entry = self._slots[key] = (pool, [])
        entry[1].append(slot)

    def add_many(self, tier: Tier, pool: Pool | None, page_size: int, slots: list[int]) -> None:
        key = (tier, pool.pool_id if tier is Tier.GPU and pool is not None else page_size)
        entry = self._slots.get(key)
        if entry is None:
            self._slots[key] = (pool, list(slots))
        else:
            entry[1].extend(slots)

    def apply(self, core: EngineCore) -> None:
        for (tier, key), (pool, slots) in self._slots.items():
            if tier is Tier.GPU:
                assert pool is not None
                pool.dev.free(slots)
            elif tier is Tier.CPU:
                core.host.free(key, slots)
            else:
                assert core.disk is not None
                core.disk.free(key, slots)
        self._slots.clear()


class Chunks:
    """Submits prepared moves a batch at a time, so copies start while the rest is prepared.

    Without a scheduler it only collects them in ``moves`` (the caller runs them itself).
    """

    __slots__ = ("_bytes", "_limit", "_scheduler", "moves", "total")

    def __init__(self, scheduler: TransferScheduler | None, batch_bytes: int) -> None:
        self._scheduler, self._limit = scheduler, batch_bytes
        self.moves: list[Move] = []
        self._bytes = 0
        self.total = 0

    def add(self, move: Move) -> None:
        self.moves.append(move)
        self._bytes += move.page_size
        if self._scheduler is not None and self._bytes >= self._limit:
            self.flush()

    def add_many(self, moves: list[Move]) -> None:
        """``add`` of each; submits once the batch size is reached (not after every move)."""
        self.moves.extend(moves)
        self._bytes += sum(m.page_size for m in moves)
        if self._scheduler is not None and self._bytes >= self._limit:
            self.flush()

    def flush(self) -> int:
        if self._scheduler is None:
            return len(self.moves)
        if self.moves:
            self._scheduler.submit(self.moves)
            self.total += len(self.moves)
            self.moves, self._bytes = [], 0
        return self.total


def consume(calls: Iterable[object]) -> None:
    """Run a lazy ``map`` of calls to the end (the per-item loop stays in C), keeping nothing."""
    deque(calls, maxlen=0)
