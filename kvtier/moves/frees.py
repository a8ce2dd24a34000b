"""Frees: the source slots of completed moves, given back to their tiers in bulk."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.state.placement import Placement
    from kvtier.state.pool import Pool


class Frees:
    """Source slots of completed moves, returned to their tiers in one call per tier."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[tuple[int, int], tuple[Pool | None, list[np.ndarray]]] = {}

    def add(self, tier: int, pool: Pool | None, page_size: int, slots: np.ndarray) -> None:
        key = (tier, pool.pool_id if tier == Tier.GPU and pool is not None else page_size)
        entry = self._slots.get(key)
        if entry is None:
            self._slots[key] = (pool, [slots])
        else:
            entry[1].append(slots)

    def apply(self, place: Placement) -> None:
        for (tier, key), (pool, parts) in self._slots.items():
            slots = parts[0] if len(parts) == 1 else np.concatenate(parts)
            place.free_slots(tier, key, slots, pool)
        self._slots.clear()
