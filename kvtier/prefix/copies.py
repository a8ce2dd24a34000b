"""Copies of keyed blocks between pool slots and CPU pages, gathered into engine batches.

* ``send(core, batch, loan=None)``: a copy batch handed to the lanes, counted as copying through
  its pool's memory until it completes (``DevicePool.copying``: a detach waits for it);
* ``Copies(pool, direction, loan, caller)``: ``add`` columns of copies, ``submit`` them as one
  batch (urgent for a load), launched on the caller's thread while it holds the lane on
  ``loan`` (``kvtier/loan.py``), else queued; not launched once ``caller`` is gone
  (``kvtier/caller.py``); ``sent`` keeps each batch with its rows;
* ``succeeded(sent)``: the rows whose copies succeeded; ``done(batch)``: all results are in;
"""

from __future__ import annotations

import time

import numpy as np

from kvtier.caller import Caller
from kvtier.core import EngineCore
from kvtier.loan import LaneLoan
from kvtier.state.pool import Pool
from kvtier.state.table import EMPTY
from kvtier.transfer.base import Moves
from kvtier.types import Direction


def succeeded(sent: list[tuple[Moves, np.ndarray]]) -> np.ndarray:
    """Rows of the copies that succeeded (a batch split by the scheduler keeps only its tail's
    rows, but reports every result)."""
    parts = [rows[np.array(b.results, dtype=object) == True] for b, rows in sent]  # noqa: E712
    return np.concatenate(parts) if parts else EMPTY


def done(batch: Moves) -> bool:
    return batch.results is not None and None not in batch.results


class Copies:
    """Copy columns of stored blocks, gathered until submitted as one batch."""

    def __init__(self, pool: Pool, direction: Direction, loan: LaneLoan | None = None,
                 caller: Caller | None = None) -> None:
        self.pool, self.direction, self.loan, self.caller = pool, direction, loan, caller
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.sent: list[tuple[Moves, np.ndarray]] = []  # each batch submitted, with its rows

    def add(self, rows: np.ndarray, srcs: np.ndarray, dsts: np.ndarray) -> None:
        self.parts.append((rows, srcs, dsts))

    def submit(self, core: EngineCore, urgent: bool = False) -> list[Moves]:
        """The gathered copies as one submitted batch (none when empty); starts a new one."""
        if not self.parts:
            return []
        rows, srcs, dsts = (np.concatenate(col) for col in zip(*self.parts, strict=True))
        pool = self.pool
        batch = Moves(self.direction, pool.page_size, srcs, dsts, rows, pool.dev,
                      caller=self.caller)
        batch.copy, batch.urgent, batch.results = True, urgent, [None] * len(rows)
        self.parts = []
        self.sent.append((batch, rows))
        if not send(core, batch, self.loan):
            # Offer the interpreter to the lane now: the caller goes on with the next chunk's
            # bookkeeping, and the launch should not wait a whole switch interval for it.
            time.sleep(0)
        return [batch]


def send(core: EngineCore, batch: Moves, loan: LaneLoan | None = None) -> bool:
    """Hand a copy batch to the lanes (engine lock held): launched on ``loan`` (True) or
    queued. Its pool's memory counts it as copying until it completes (a detach waits for
    that); a batch that could not be handed over (a closed scheduler) is not counted."""
    assert batch.pool is not None
    batch.pool.copying += len(batch)
    try:
        if loan is not None and loan.launch(batch):
            return True
        core.scheduler.submit([batch])
        return False
    except BaseException:
        batch.pool.copying -= len(batch)
        raise
