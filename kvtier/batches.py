"""Per-batch helpers of the engine core: bulk slot frees and chunked submission."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.transfer.base import Move
from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore
    from kvtier.pool import Pool
    from kvtier.scheduler import TransferScheduler


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

    def flush(self) -> int:
        if self._scheduler is None:
            return len(self.moves)
        if self.moves:
            self._scheduler.submit(self.moves)
            self.total += len(self.moves)
            self.moves, self._bytes = [], 0
        return self.total
