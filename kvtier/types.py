"""Ids, enums and slotted messages shared between layers.

Ids are ``NewType`` over ``int`` so mypy keeps them apart; they are plain ints at run time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

PageId = NewType("PageId", int)
PoolId = NewType("PoolId", int)
SlotIndex = NewType("SlotIndex", int)
ContentKey = NewType("ContentKey", bytes)
"""A tenant-salted chained block hash (16 bytes). Never compared across tenants."""


class Tier(enum.IntEnum):
    """Where a page's bytes live. Ordered from fastest to slowest."""

    GPU = 0
    CPU = 1
    DISK = 2
    REMOTE = 3  # a shared keyed store (``prefix/remote.py``): keyed pages only, never a home


class PageState(enum.Enum):
    """Every page is in exactly one state. ``MOVING_*`` pages can't be read, pinned or evicted."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
    MOVING_DOWN = "moving_down"  # GPU->CPU or CPU->DISK in flight; source still valid
    MOVING_UP = "moving_up"  # DISK->CPU or CPU->GPU in flight; source still valid
    DROPPED = "dropped"  # bytes lost (budget full, corrupt); reads fail with PageLost


RESIDENT_STATES = {PageState.GPU: Tier.GPU, PageState.CPU: Tier.CPU, PageState.DISK: Tier.DISK}


class Direction(enum.Enum):
    """A transfer's medium pair. One handler exists per direction."""

    GPU_TO_CPU = (Tier.GPU, Tier.CPU)
    CPU_TO_GPU = (Tier.CPU, Tier.GPU)
    CPU_TO_DISK = (Tier.CPU, Tier.DISK)
    DISK_TO_CPU = (Tier.DISK, Tier.CPU)

    # ``_value_`` rather than ``value``: these sit on per-page hot paths and the enum descriptor
    # behind ``value`` costs more than the rest of the lookup.
    @property
    def src(self) -> Tier:
        return self._value_[0]

    @property
    def dst(self) -> Tier:
        return self._value_[1]

    @property
    def is_restore(self) -> bool:
        return self._value_[1] < self._value_[0]


@dataclass(slots=True, frozen=True)
class PageMeta:
    """What a policy may know about a page. Set by the engine; policies never mutate pages."""

    page_id: PageId
    priority: float = 1.0  # >0; higher = keep longer
    position: int = 0  # index of the page in its sequence
    length: int = 1  # length of the sequence in pages


@dataclass(slots=True, frozen=True)
class TierUsage:
    """Capacity snapshot of one tier."""

    tier: Tier
    used_bytes: int
    capacity_bytes: int
    pages: int

    @property
    def ratio(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0
