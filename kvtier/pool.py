"""A pool: one attached engine's GPU page slots, its tenant and its GPU-tier policy."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.pagetable import Page
from kvtier.policy.base import EvictionPolicy
from kvtier.tiers.base import PoolHandle
from kvtier.tiers.device import DevicePool
from kvtier.types import PageId, PoolId


@dataclass(slots=True, eq=False)
class Pool:
    """Mutated only under the engine lock. ``slot_pages`` maps GPU slots to resident pages."""

    pool_id: PoolId
    tenant: str
    dev: DevicePool
    policy: EvictionPolicy
    default_priority: float = 1.0
    external: bool = False  # engine-registered memory: slots are the engine's to manage
    pinned: set[PageId] = field(default_factory=set)
    slot_pages: dict[int, Page] = field(default_factory=dict)
    moving_down: int = 0  # offloads in flight: slots that will come free

    @property
    def page_size(self) -> int:
        return self.dev.page_size

    @property
    def num_slots(self) -> int:
        return self.dev.num_slots

    @property
    def segments(self) -> list[torch.Tensor]:
        return self.dev.segments

    @property
    def used_slots(self) -> int:
        return self.dev.num_slots - self.dev.num_free

    def handle(self) -> PoolHandle:
        return self.dev.handle()


class Protected:
    """``in`` test over several id sets without copying them (for ``policy.evict``)."""

    def __init__(self, *sets: set[PageId]) -> None:
        self._sets = sets

    def __contains__(self, item: object) -> bool:
        return any(item in s for s in self._sets)
