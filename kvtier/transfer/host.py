"""GPU<->CPU handlers for CPU mode, where the "GPU" pool lives in host shared memory.

Real bytes move: each batch is one gather (or scatter) per contiguous run of host slots, written
straight into (or read straight from) the host arena's chunk memory.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from kvtier.tiers.pinned import HostArena
from kvtier.transfer.base import Move, TransferHandler
from kvtier.transfer.gather import gather, scatter
from kvtier.types import Direction


def by_pool(moves: list[Move]) -> list[list[int]]:
    """Positions of ``moves`` grouped by their pool, in first-seen order."""
    first = moves[0].pool if moves else None
    if first is not None and all(m.pool is first for m in moves):
        return [list(range(len(moves)))]  # the common case: one pool
    groups: dict[int, list[int]] = defaultdict(list)
    for i, move in enumerate(moves):
        assert move.pool is not None, "GPU<->CPU move without a pool"
        groups[id(move.pool)].append(i)
    return list(groups.values())


class _HostCopy(TransferHandler):
    """Per pool: one index of pool rows, then one copy per contiguous run of host slots."""

    def __init__(self, arena: HostArena) -> None:
        self._arena = arena

    def run(self, moves: list[Move]) -> list[bool]:
        restore = self.direction is Direction.CPU_TO_GPU
        for group in by_pool(moves):
            pool = moves[group[0]].pool
            assert pool is not None
            size = moves[group[0]].page_size
            rows = [moves[i].dst if restore else moves[i].src for i in group]
            host = [moves[i].src if restore else moves[i].dst for i in group]
            idx = torch.tensor(rows, dtype=torch.long)
            for view, positions in self._arena.runs(size, host):
                # A run's positions are consecutive: a slice, not a per-position index.
                self._copy(pool.segments, idx[positions[0] : positions[-1] + 1], view)
        return [True] * len(moves)

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
