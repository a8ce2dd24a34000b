"""Transfers by medium pair.

Contract:
    * A :class:`Move` copies one page's bytes from a source slot to a destination slot. The engine
      prepares it (destination slot allocated, page marked moving) and completes it with the
      handler's result; the handler never touches the page table.
    * ``TransferHandler.run(moves)`` runs on a scheduler lane thread, copies a whole batch (all
      moves share the handler's direction) with as few calls as possible (one gather + one DMA per
      contiguous run, never one call per page on CUDA), waits for completion on its own stream's
      event (no device-wide synchronize) and returns one bool per move. It must not raise for a
      single bad page; an exception fails the whole batch.
    * A source slot is never modified; destination slots other than the moves' are never touched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.types import Direction

if TYPE_CHECKING:
    from kvtier.pagetable import Page
    from kvtier.tiers.device import DevicePool


@dataclass(slots=True, eq=False)
class Move:
    """One page's copy between two tiers. ``pool`` is the GPU side's pool (GPU<->CPU moves)."""

    direction: Direction
    page_size: int
    src: int
    dst: int
    page: Page | None = None
    pool: DevicePool | None = None
    copy: bool = False  # store/load: the source keeps its bytes and the page its state
    urgent: bool = False  # serves a waiting restore: goes to the front of its queue
    ready: Any = None  # CUDA event the copy must wait for (the engine's last write)
    result: bool | None = None  # copy moves: set on completion, read by the waiting caller

    @property
    def nbytes(self) -> int:
        return self.page_size


class TransferHandler(ABC):
    """Moves batches of pages in one direction. See the module docstring."""

    direction: Direction

    @abstractmethod
    def run(self, moves: list[Move]) -> list[bool]: ...

    def launch(self, moves: list[Move]) -> Callable[[], list[bool]]:
        """Start a batch; the returned callable waits for it and gives its results.

        Handlers that can overlap batches (CUDA streams, I/O threads) override this; at most two
        batches of one handler are in flight, and they complete in launch order.
        """
        results = self.run(moves)
        return lambda: results

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release staging buffers and streams."""
