"""CPU<->disk handlers: whole batches handed to the disk store's I/O threads.

``launch`` returns at once (the store cuts the batch into parts run on its threads), so the disk
lane keeps ``depth`` batches in flight: the next batch's reads are queued on the disk while the
previous one's pages are copied on to the GPU by the up lane.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.tiers.disk import DiskStore
from kvtier.tiers.pinned import HostArena
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.types import Direction

DEPTH = 3  # disk batches in flight on the lane (its bytes still bounded by max_inflight_mb)


class DiskWrite(TransferHandler):
    """CPU->disk: the store checksums and records a page only once its bytes are durable."""

    direction = Direction.CPU_TO_DISK
    depth = DEPTH

    def __init__(self, arena: HostArena, disk: DiskStore) -> None:
        self._arena, self._disk = arena, disk

    def launch(self, batch: Moves) -> Callable[[], list[bool]]:
        rows = self._arena.rows(batch.page_size, batch.srcs.tolist())
        future = self._disk.write(batch.page_size, batch.dsts.tolist(), rows)
        return lambda: list(future.result())

    def run(self, batch: Moves) -> list[bool]:
        return self.launch(batch)()


class DiskRead(TransferHandler):
    """Disk->CPU: a page whose checksum fails comes back False (never as good bytes)."""

    direction = Direction.DISK_TO_CPU
    depth = DEPTH

    def __init__(self, arena: HostArena, disk: DiskStore) -> None:
        self._arena, self._disk = arena, disk

    def launch(self, batch: Moves) -> Callable[[], list[bool]]:
        rows = self._arena.rows(batch.page_size, batch.dsts.tolist())
        future = self._disk.read(batch.page_size, batch.srcs.tolist(), rows)
        return lambda: list(future.result())

    def run(self, batch: Moves) -> list[bool]:
        return self.launch(batch)()
