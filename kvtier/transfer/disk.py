"""CPU<->disk handlers: whole batches handed to the disk store's I/O threads."""

from __future__ import annotations

from kvtier.tiers.disk import DiskStore
from kvtier.tiers.pinned import HostArena
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.types import Direction


class DiskWrite(TransferHandler):
    """CPU->disk: the store checksums and records a page only once its bytes are durable."""

    direction = Direction.CPU_TO_DISK

    def __init__(self, arena: HostArena, disk: DiskStore) -> None:
        self._arena, self._disk = arena, disk

    def run(self, batch: Moves) -> list[bool]:
        rows = self._arena.rows(batch.page_size, batch.srcs.tolist())
        return list(self._disk.write(batch.page_size, batch.dsts.tolist(), rows).result())


class DiskRead(TransferHandler):
    """Disk->CPU: a page whose checksum fails comes back False (never as good bytes)."""

    direction = Direction.DISK_TO_CPU

    def __init__(self, arena: HostArena, disk: DiskStore) -> None:
        self._arena, self._disk = arena, disk

    def run(self, batch: Moves) -> list[bool]:
        rows = self._arena.rows(batch.page_size, batch.dsts.tolist())
        return list(self._disk.read(batch.page_size, batch.srcs.tolist(), rows).result())
