"""The medium interface: what a tier below the CPU offers the engine, whatever stores the bytes.

The tier chain (``OffloadConfig.tier_chain``, ``KVCACHED_OFFLOAD_TIER_CHAIN``) names the media a
page walks down: ``gpu`` (``DevicePool``, one per attached pool), ``cpu`` (``HostArena``, shared)
and, below the CPU, any number of *slot media*, each opened by name from
``kvtier.tiers.registry`` (``disk``: ``DiskStore``) and reporting the wire ``Tier`` it was
registered with. The engine reaches them only through this interface; the transfer handlers
registered for (``cpu``, name), (name, ``cpu``) and, optionally, (name, next name)
(``kvtier.transfer.registry``) copy their bytes. Adding a medium: a class implementing
``SlotMedium`` (one file), its handlers (one file), ``register_medium`` and ``register_route``
calls (the registry lines).

``SlotMedium`` primitives and their contracts:
    * ``capacity_bytes`` / ``used_bytes``: the budget, and the bytes of slots in use.
    * ``alloc(page_size, n) -> list[int] | None``: ``n`` free slots of ``page_size`` bytes, all
      or nothing; never beyond the budget. ``free(page_size, slots)`` gives them back (their
      bytes and record are forgotten); freeing a free slot is an internal error.
    * ``write(page_size, slots, srcs)`` / ``read(page_size, slots, dsts)`` -> a future of one
      bool per page: batch I/O between the medium and 1-D ``uint8`` CPU tensors. A page read
      back is the bytes written or ``False`` (never wrong bytes reported as good).
    * ``set_record`` / ``clear_record`` / ``write_records`` / ``records()``: a persistable
      record (content key, tenant) per slot, for keyed pages to be found after a restart
      (``NoRecords``: a medium that keeps none); ``persist()`` makes them durable;
      ``unindexed_records()``: record changes a restart now would not see (0: none).
    * ``counters`` (``TierCounters``): plain counters for ``kvtier.metrics``; ``close()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from kvtier.tiers.base import MediumSlot, SlotRecord, TierCounters


class SlotMedium(Protocol):
    """A tier below the CPU, by slot (see the module docstring)."""

    counters: TierCounters

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def alloc(self, page_size: int, n: int) -> list[MediumSlot] | None: ...

    def free(self, page_size: int, slots: Sequence[int]) -> None: ...

    def write(
        self, page_size: int, slots: Sequence[int], srcs: Sequence[torch.Tensor]
    ) -> Future[list[bool]]: ...

    def read(
        self, page_size: int, slots: Sequence[int], dsts: Sequence[torch.Tensor]
    ) -> Future[list[bool]]: ...

    def set_record(self, page_size: int, slot: MediumSlot, record: SlotRecord) -> None: ...

    def clear_record(self, page_size: int, slot: MediumSlot) -> None: ...

    def write_records(self) -> None: ...

    def records(self) -> list[tuple[int, MediumSlot, SlotRecord]]: ...

    def persist(self) -> None: ...

    def unindexed_records(self) -> int: ...

    def close(self) -> None: ...


class NoRecords:
    """The record primitives of a medium that keeps nothing across restarts."""

    def set_record(self, page_size: int, slot: MediumSlot, record: SlotRecord) -> None:
        pass

    def clear_record(self, page_size: int, slot: MediumSlot) -> None:
        pass

    def write_records(self) -> None:
        pass

    def records(self) -> list[tuple[int, MediumSlot, SlotRecord]]:
        return []

    def persist(self) -> None:
        pass

    def unindexed_records(self) -> int:
        return 0
