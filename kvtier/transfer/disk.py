"""CPU<->disk handlers: whole batches handed to the disk store's I/O threads."""

from __future__ import annotations

from collections import defaultdict

from kvtier.tiers.disk import DiskStore
from kvtier.tiers.pinned import HostArena
from kvtier.transfer.base import Move, TransferHandler
from kvtier.types import Direction


def _by_size(moves: list[Move]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, move in enumerate(moves):
        groups[move.page_size].append(i)
    return groups


class DiskWrite(TransferHandler):
    """CPU->disk: the store checksums and records a page only once its bytes are durable."""

    direction = Direction.CPU_TO_DISK

    def __init__(self, arena: HostArena, disk: DiskStore) -> None:
        self._arena, self._disk = arena, disk

    def run(self, moves: list[Move]) -> list[bool]:
        results = [False] * len(moves)
        for size, group in _by_size(moves).items():
            rows = self._arena.rows(size, [moves[i].src for i in group])
            done = self._disk.write(size, [moves[i].dst for i in group], rows).result()
            for i, ok in zip(group, done, strict=True):
                results[i] = ok
        return results


class DiskRead(TransferHandler):
    """Disk->CPU: a page whose checksum fails comes back False (never as good bytes)."""

    direction = Direction.DISK_TO_CPU

    def __init__(self, arena: HostArena, disk: DiskStore) -> None:
        self._arena, self._disk = arena, disk

    def run(self, moves: list[Move]) -> list[bool]:
        results = [False] * len(moves)
        for size, group in _by_size(moves).items():
            rows = self._arena.rows(size, [moves[i].dst for i in group])
            done = self._disk.read(size, [moves[i].src for i in group], rows).result()
            for i, ok in zip(group, done, strict=True):
                results[i] = ok
        return results
