"""Per-batch helpers of the engine core: bulk slot frees and grouping."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.core import EngineCore
    from kvtier.pool import Pool


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
    """Source slots of completed moves, returned to their tiers in one call per tier."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[tuple[Tier, int], tuple[Pool | None, list[np.ndarray]]] = {}

    def add(self, tier: Tier, pool: Pool | None, page_size: int, slots: np.ndarray) -> None:
        key = (tier, pool.pool_id if tier is Tier.GPU and pool is not None else page_size)
        entry = self._slots.get(key)
        if entry is None:
            self._slots[key] = (pool, [slots])
        else:
            entry[1].append(slots)

    def apply(self, core: EngineCore) -> None:
        for (tier, key), (pool, parts) in self._slots.items():
            slots = parts[0] if len(parts) == 1 else np.concatenate(parts)
            core.free_slots(tier, key, slots, pool)
        self._slots.clear()


def consume(calls: Iterable[object]) -> None:
    """Run a lazy ``map`` of calls to the end (the per-item loop stays in C), keeping nothing."""
    deque(calls, maxlen=0)
