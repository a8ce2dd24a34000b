"""A pool: one attached engine's GPU page slots, its tenant and its GPU-tier policy."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.policy.base import RowPolicy
from kvtier.tiers.base import PoolHandle
from kvtier.tiers.device import DevicePool
from kvtier.types import PoolId


@dataclass(slots=True, eq=False)
class Pool:
    """Mutated only under the engine lock. ``slot_rows[s]`` is the page-table row resident in
    GPU slot ``s`` (-1: none); ``pinned`` counts the pool's pages with pins."""

    pool_id: PoolId
    tenant: str
    dev: DevicePool
    policy: RowPolicy
    default_priority: float = 1.0
    external: bool = False  # engine-registered memory: slots are the engine's to manage
    pinned: int = 0
    slot_rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    moving_down: int = 0  # offloads in flight: slots that will come free
    detaching: bool = False  # being detached: no new keyed store or load through it

    def __post_init__(self) -> None:
        self.slot_rows = np.full(self.dev.num_slots, -1, dtype=np.int64)

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
