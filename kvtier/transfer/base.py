"""Transfers by medium pair.

Contract:
    * A :class:`Moves` batch copies pages of one size in one direction: column ``i`` copies
      ``srcs[i]`` to ``dsts[i]`` (``rows[i]`` is its page-table row, when the engine made it).
      GPU<->CPU batches touch one GPU pool. The engine prepares a batch (destination slots
      allocated, pages marked moving) and completes it with the handler's results, one per
      column; the handler never touches the page table.
    * ``TransferHandler.run(batch)`` runs on a scheduler lane thread (a ``queued`` handler's
      ``launch`` also on a caller's thread holding the lane on loan, ``kvtier/loan.py``; never
      two threads at once), copies the whole batch
      with as few calls as possible (one gather + one DMA per contiguous run, never one call per
      page on CUDA), waits for completion on its own stream's event (no device-wide synchronize)
      and returns one bool per column. It must not raise for a single bad page; an exception
      fails the whole batch.
    * A source slot is never modified; destination slots other than the batch's are never
      touched.
    * ``take(k)`` splits off the first ``k`` columns (the scheduler's batches); ``join`` appends
      another batch of the same kind. A *copy* batch (store/load of prefix blocks) leaves its
      pages where they are and reports per-column ``results`` to its caller, also when split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.caller import Caller
from kvtier.types import Direction

if TYPE_CHECKING:
    from kvtier.tiers.device import DevicePool

_NONE = np.empty(0, dtype=np.int64)


def as_index(values: Any) -> np.ndarray:
    """An int64 array of slot or row indices (lists are accepted for convenience)."""
    return np.asarray(values, dtype=np.int64).reshape(-1)


def lane_of(direction: Direction, handler: TransferHandler) -> str:
    """The lane of ``handler``'s batches in ``direction``: its own ``lane``, else ``up`` into
    the GPU, ``down`` out of it, ``disk`` between the tiers below the GPU."""
    if handler.lane:
        return handler.lane
    src, dst = direction._value_
    return "up" if dst == 0 else "down" if src == 0 else "disk"


@dataclass(slots=True, eq=False, weakref_slot=True)
class Moves:
    """Copies of pages of one size, in one direction, touching at most one GPU pool.

    ``srcs``, ``dsts`` and ``rows`` are int64 arrays (``rows``: the page-table rows moved, empty
    for raw copies); they are replaced, never mutated in place, so a split keeps views safely.
    """

    direction: Direction
    page_size: int
    srcs: np.ndarray
    dsts: np.ndarray
    rows: np.ndarray = field(default_factory=lambda: _NONE)
    pool: DevicePool | None = None
    copy: bool = False  # store/load: sources keep their bytes and pages their state
    urgent: bool = False  # serves a waiting restore: goes to the front of its queue
    ready: list[Any] = field(default_factory=list)  # CUDA events the copies must wait for
    results: list[bool | None] | None = None  # copy batches: set on completion, read by callers
    origin: Moves | None = None  # a split copy batch reports its results there ...
    at: int = 0  # ... from this column on
    final: bool = False  # its producer queues nothing after it (a lane may end on small batches)
    # A copy batch of a registered pool's layer group: only the pool's segments [lo, hi) of
    # each page (the same byte range of each CPU page) are copied; None: whole pages.
    segments: tuple[int, int] | None = None
    # A copy batch of a call whose caller may give up: not launched once it has
    # (``kvtier/caller.py``: the caller may have reused the memory it would write).
    caller: Caller | None = None

    def __post_init__(self) -> None:
        self.srcs, self.dsts = as_index(self.srcs), as_index(self.dsts)
        self.rows = as_index(self.rows)

    def __len__(self) -> int:
        return len(self.srcs)

    @property
    def nbytes(self) -> int:
        return self.page_size * len(self.srcs)

    def compatible(self, other: Moves) -> bool:
        """Whether ``other`` may be joined to this batch (copy batches never are)."""
        return (
            not self.copy
            and not other.copy
            and other.direction is self.direction
            and other.page_size == self.page_size
            and other.pool is self.pool
        )

    def take(self, k: int) -> Moves:
        """The first ``k`` columns as a new batch; this one keeps the rest."""
        head = Moves(
            self.direction,
            self.page_size,
            self.srcs[:k],
            self.dsts[:k],
            self.rows[:k],
            self.pool,
            self.copy,
            self.urgent,
            list(self.ready),
            None,
            (self.origin or self) if self.copy else None,
            self.at,
            segments=self.segments,
            caller=self.caller,
        )
        self.srcs, self.dsts, self.rows = self.srcs[k:], self.dsts[k:], self.rows[k:]
        self.at += k
        return head

    def join(self, other: Moves) -> None:
        assert self.compatible(other) and bool(len(self.rows)) == bool(len(other.rows))
        self.srcs = np.concatenate([self.srcs, other.srcs])
        self.dsts = np.concatenate([self.dsts, other.dsts])
        self.rows = np.concatenate([self.rows, other.rows])
        self.ready += [e for e in other.ready if all(e is not r for r in self.ready)]

    def remove(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Take the columns of page-table ``rows`` out (cancelled moves): their
        ``(rows, srcs, dsts)``, empty when none of ``rows`` is in this batch. One pass."""
        hit = np.isin(self.rows, rows)
        if not hit.any():
            return _NONE, _NONE, _NONE
        taken = self.rows[hit], self.srcs[hit], self.dsts[hit]
        keep = ~hit
        self.srcs, self.dsts, self.rows = self.srcs[keep], self.dsts[keep], self.rows[keep]
        return taken

    def report(self, results: list[bool]) -> None:
        """A copy batch's results, written where its caller reads them."""
        target = self.origin or self
        if target.results is None:
            target.results = [None] * (self.at + len(results))
        target.results[self.at : self.at + len(results)] = results


class Queued:
    """What a queueing handler's ``launch`` returns: call it to wait for the batch's results;
    ``ready()`` says, without waiting, whether its copies are done."""

    __slots__ = ("_wait", "ready")

    def __init__(self, wait: Callable[[], list[bool]], ready: Callable[[], bool]) -> None:
        self._wait, self.ready = wait, ready

    def __call__(self) -> list[bool]:
        return self._wait()


class TransferHandler(ABC):
    """Moves batches of pages in one direction. See the module docstring."""

    direction: Direction
    depth = 2  # batches a lane may keep in flight on this handler (launched, not yet waited)
    # ``launch`` only queues the copies on the device and returns a ``Queued``: cheap enough
    # for a caller holding the lane on loan (``kvtier/loan.py``) to call on its own thread.
    queued = False
    # The scheduler lane that runs this handler's batches: the scheduler makes one lane per
    # name (per GPU for GPU<->CPU handlers). None: ``lane_of``'s default for the direction.
    lane: str | None = None

    @abstractmethod
    def run(self, batch: Moves) -> list[bool]: ...

    def launch(self, batch: Moves) -> Callable[[], list[bool]]:
        """Start a batch; the returned callable waits for it and gives its results.

        Handlers that can overlap batches (CUDA streams, I/O threads) override this; at most
        ``depth`` batches of one handler are in flight, and they complete in launch order.
        """
        results = self.run(batch)
        return lambda: results

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release staging buffers and streams."""
