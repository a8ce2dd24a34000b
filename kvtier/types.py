"""Ids, enums and slotted messages shared between layers.

Ids are ``NewType`` over ``int`` so mypy keeps them apart; they are plain ints at run time.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, NewType

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
    DISK = "disk"  # settled in any medium below the CPU (its level: the page table's ``tier``)
    MOVING_DOWN = "moving_down"  # one level down the chain in flight; source still valid
    MOVING_UP = "moving_up"  # a medium below ->CPU or CPU->GPU in flight; source still valid
    DROPPED = "dropped"  # bytes lost (budget full, corrupt); reads fail with PageLost


RESIDENT_STATES = {PageState.GPU: Tier.GPU, PageState.CPU: Tier.CPU, PageState.DISK: Tier.DISK}


BELOW_CPU = 2
"""The chain level of the first medium below the CPU: levels are positions in the tier chain
(``OffloadConfig.tier_chain``): 0 the GPU, 1 the CPU, 2.. the slot media below it, in order.
``Tier.GPU``/``Tier.CPU`` are levels 0/1 too; a medium below the CPU reports the ``Tier`` it
declares (``Tier.DISK`` for every slot medium today) on the wire."""


def level_name(level: int) -> str:
    """``GPU``, ``CPU``, then ``DISK``, ``DISK2``, ... for the media below the CPU."""
    if level < BELOW_CPU:
        return Tier(level).name
    depth = level - BELOW_CPU + 1
    return "DISK" if depth == 1 else f"DISK{depth}"


class _Directions(type):
    """``for d in Direction`` / ``len(Direction)``: the four moves of a three-level chain (the
    ones counted from the start, per tenant and in the stats); deeper ones are made on use."""

    def __iter__(cls) -> Iterator[Direction]:
        return iter(cls.BASE)  # type: ignore[attr-defined]

    def __len__(cls) -> int:
        return len(cls.BASE)  # type: ignore[attr-defined]


class Direction(metaclass=_Directions):
    """A transfer's pair of chain levels (source, destination); one handler serves each.

    One object per pair (``Direction((src, dst))`` returns it), so ``is`` compares them; the
    four moves of a three-level chain are ``GPU_TO_CPU``, ``CPU_TO_GPU``, ``CPU_TO_DISK`` and
    ``DISK_TO_CPU``; a longer chain adds e.g. ``DISK_TO_DISK2`` (a demotion between two media
    below the CPU) and ``DISK2_TO_CPU`` (a restore from the second one).
    """

    __slots__ = ("_value_", "name")
    _value_: tuple[int, int]
    name: str
    _pairs: ClassVar[dict[tuple[int, int], Direction]] = {}
    BASE: ClassVar[tuple[Direction, ...]]
    GPU_TO_CPU: ClassVar[Direction]
    CPU_TO_GPU: ClassVar[Direction]
    CPU_TO_DISK: ClassVar[Direction]
    DISK_TO_CPU: ClassVar[Direction]

    def __new__(cls, pair: tuple[int, int]) -> Direction:
        got = cls._pairs.get(pair)
        if got is not None:
            return got
        src, dst = int(pair[0]), int(pair[1])
        if src == dst or min(src, dst) < 0:
            raise ValueError(f"not a move between two chain levels: {pair!r}")
        got = object.__new__(cls)
        got._value_ = (src, dst)
        got.name = f"{level_name(src)}_TO_{level_name(dst)}"
        return cls._pairs.setdefault((src, dst), got)

    def __reduce__(self) -> tuple[type[Direction], tuple[tuple[int, int]]]:
        return Direction, (self._value_,)

    def __repr__(self) -> str:
        return f"Direction.{self.name}"

    # ``_value_`` rather than a property chain: these sit on per-page hot paths.
    @property
    def src(self) -> int:
        return self._value_[0]

    @property
    def dst(self) -> int:
        return self._value_[1]

    @property
    def is_restore(self) -> bool:
        return self._value_[1] < self._value_[0]

    @property
    def wire(self) -> Direction | None:
        """The move as the wire sees it (every medium below the CPU is ``Tier.DISK``): one of
        the four ``BASE`` moves, or None for a move between two media below the CPU."""
        src, dst = (min(x, BELOW_CPU) for x in self._value_)
        return None if src == dst else Direction((src, dst))


Direction.GPU_TO_CPU = Direction((Tier.GPU, Tier.CPU))
Direction.CPU_TO_GPU = Direction((Tier.CPU, Tier.GPU))
Direction.CPU_TO_DISK = Direction((Tier.CPU, BELOW_CPU))
Direction.DISK_TO_CPU = Direction((BELOW_CPU, Tier.CPU))
Direction.BASE = (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU, Direction.CPU_TO_DISK,
                  Direction.DISK_TO_CPU)


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
