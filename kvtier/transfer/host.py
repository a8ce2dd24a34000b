"""GPU<->CPU handlers for CPU mode, where the "GPU" pool lives in host shared memory.

Real bytes move: each batch is one gather (or scatter) per contiguous run of host slots, written
straight into (or read straight from) the host arena's chunk memory.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from kvtier.tiers.device import DevicePool
from kvtier.tiers.pinned import HostArena
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.transfer.gather import gather, scatter
from kvtier.transfer.segtable import GroupTables, SegmentTable, group_table
from kvtier.types import Direction


class _HostCopy(TransferHandler):
    """One index of pool rows, then one copy per contiguous run of host slots (a pool of
    several segments through its segment table, as the CUDA handlers do)."""

    def __init__(self, arena: HostArena) -> None:
        self._arena = arena
        self._tables: weakref.WeakKeyDictionary[DevicePool, SegmentTable] = (
            weakref.WeakKeyDictionary()
        )
        self._groups: GroupTables = weakref.WeakKeyDictionary()

    def run(self, batch: Moves) -> list[bool]:
        pool = batch.pool
        assert pool is not None, "GPU<->CPU batch without a pool"
        if pool.closed:  # detached: nothing to copy from or to (never "copied")
            return [False] * len(batch)
        restore = self.direction is Direction.CPU_TO_GPU
        rows, host = (batch.dsts, batch.srcs) if restore else (batch.srcs, batch.dsts)
        idx = torch.from_numpy(rows)
        if batch.segments is not None:
            assert restore, "a layer group is only ever loaded"
            return self._restore_group(batch, idx, host)
        table = None
        if len(pool.segments) > 1:
            table = self._tables.get(pool)
            if table is None:
                table = self._tables[pool] = SegmentTable(pool.segments)
        for view, lo, hi in self._arena.runs_array(batch.page_size, host):
            # A run's positions are consecutive: a slice, not a per-position index.
            if table is None:
                self._copy(pool.segments, idx[lo:hi], view)
            elif restore:
                table.scatter(idx[lo:hi], view)
            else:
                table.gather(idx[lo:hi], view)
        return [True] * len(batch)

    def _restore_group(self, batch: Moves, idx: torch.Tensor, host: np.ndarray) -> list[bool]:
        """Segments ``[lo, hi)`` of each page: their byte range of every CPU page, scattered
        through a table of those segments only."""
        pool, (lo, hi) = batch.pool, batch.segments or (0, 0)
        assert pool is not None
        table, (a, z) = group_table(self._groups, pool, lo, hi)
        for view, p, q in self._arena.runs_array(batch.page_size, host):
            table.scatter(idx[p:q], view[:, a:z].contiguous())
        return [True] * len(batch)

    def _copy(self, segments: list[torch.Tensor], idx: torch.Tensor, view: torch.Tensor) -> None:
        raise NotImplementedError


class HostOffload(_HostCopy):
    """GPU->CPU in CPU mode: gather pool rows directly into each destination run."""

    direction = Direction.GPU_TO_CPU

    def _copy(self, segments: list[torch.Tensor], idx: torch.Tensor, view: torch.Tensor) -> None:
        gather(segments, idx, view)


class HostRestore(_HostCopy):
    """CPU->GPU in CPU mode: scatter each source run into the pool's rows."""

    direction = Direction.CPU_TO_GPU

    def _copy(self, segments: list[torch.Tensor], idx: torch.Tensor, view: torch.Tensor) -> None:
        scatter(segments, idx, view)
