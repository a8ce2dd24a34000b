"""Where each optimizer bucket's flat state blob (master weights + states) lives between steps.

``StateStore(nbytes_per_bucket, arena, disk=None)``:
    * host tier (``disk is None``): one arena buffer per bucket, used in place: ``acquire(i)``
      returns it, ``release`` does nothing.
    * disk tier: the blob is split into ``page_bytes`` pages kept in a ``DiskStore``; two host
      slot buffers (double buffering) hold the blobs being worked on. ``prefetch(i)`` starts the
      read of bucket ``i`` into slot ``i % 2`` (after that slot's previous write finished, and
      after any read of another bucket into that slot: a slot holds one bucket's read at a time,
      so buckets may be used in any order), ``acquire(i)`` waits for it, ``release(i, dirty)``
      starts the write back. ``prefetch_next(i)`` reads ahead the bucket expected after ``i``:
      the same direction as the last two acquires (buckets step in backward order when their
      gradients land, in index order at ``step()``).
      A read that fails its checksum raises :class:`~kvtier.errors.PageLost`.
    * ``bytes_read``/``bytes_written`` count disk traffic. ``flush()`` waits for every write.
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kvtier.errors import CapacityError, DeadlineExceeded, PageLost
from kvtier.training.base import BufferArena, get_buffers

DISK_ALIGN = 4096


class StateStore:
    """Homes of the per-bucket blobs (see module docstring)."""

    def __init__(self, sizes: list[int], arena: BufferArena, disk: Any = None,
                 page_bytes: int = 4 << 20, timeout_s: float = 600.0) -> None:
        self.sizes = sizes
        self.arena = arena
        self.disk = disk
        self.timeout_s = timeout_s
        self.bytes_read = 0
        self.bytes_written = 0
        self.written = [False] * len(sizes)
        self._host: list[torch.Tensor] = []
        self._last = -1  # the last bucket acquired
        self._step = 1  # the direction buckets are being used in
        if disk is None:
            self._host = get_buffers(arena, sizes)
            return
        biggest = max(sizes, default=1)
        self.page = min(page_bytes, (biggest + DISK_ALIGN - 1) // DISK_ALIGN * DISK_ALIGN)
        self._npages = [max(1, -(-n // self.page)) for n in sizes]
        slots = disk.alloc(self.page, sum(self._npages))
        if slots is None:
            raise CapacityError("disk tier budget too small for the optimizer states")
        self._slots: list[list[int]] = []
        start = 0
        for n in self._npages:
            self._slots.append([int(s) for s in slots[start : start + n]])
            start += n
        slot_bytes = max(self._npages) * self.page
        try:
            self._bufs = get_buffers(arena, [slot_bytes, slot_bytes])
        except CapacityError:
            disk.free(self.page, [s for ss in self._slots for s in ss])
            raise
        self._reads: dict[int, Future[list[bool]]] = {}
        self._writes: list[Future[list[bool]] | None] = [None, None]

    @property
    def on_disk(self) -> bool:
        return self.disk is not None

    def _pages(self, i: int) -> list[torch.Tensor]:
        buf = self._bufs[i % 2]
        return [buf[k * self.page : (k + 1) * self.page] for k in range(self._npages[i])]

    def _wait(self, fut: Future[list[bool]], what: str) -> list[bool]:
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise DeadlineExceeded(f"disk tier {what} not done after {self.timeout_s}s") from None

    def prefetch(self, i: int) -> None:
        """Start bringing bucket ``i`` to host memory (no-op for the host tier or if started)."""
        if self.disk is None or i >= len(self.sizes) or i in self._reads:
            return
        self._drain_slot(i % 2)
        if not self.written[i]:
            return  # nothing written yet: the caller initializes the blob
        self._reads[i] = self.disk.read(self.page, self._slots[i], self._pages(i))

    def prefetch_next(self, i: int) -> None:
        """Read ahead the bucket expected after bucket ``i`` (see the module docstring)."""
        nxt = i + self._step
        if self.disk is not None and 0 <= nxt < len(self.sizes):
            self.prefetch(nxt)

    def acquire(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s blob in host memory (``sizes[i]`` bytes), ready to use."""
        if self.disk is None:
            return self._host[i][: self.sizes[i]]
        if self._last >= 0 and i != self._last:
            self._step = 1 if i > self._last else -1
        self._last = i
        self.prefetch(i)
        fut = self._reads.pop(i, None)
        if fut is not None:
            ok = self._wait(fut, "read")
            if not all(ok):
                raise PageLost(f"optimizer state bucket {i} failed its checksum on disk")
            self.bytes_read += self._npages[i] * self.page
        return self._bufs[i % 2][: self.sizes[i]]

    def release(self, i: int, dirty: bool) -> None:
        """Done with bucket ``i``'s blob; written back to disk when ``dirty``."""
        if self.disk is None or not dirty:
            return
        self._writes[i % 2] = self.disk.write(self.page, self._slots[i], self._pages(i))
        self.written[i] = True
        self.bytes_written += self._npages[i] * self.page

    def _drain_slot(self, k: int) -> None:
        """Slot ``k``'s buffer free to refill: its write done, any read ahead into it dropped."""
        ahead = next((j for j in self._reads if j % 2 == k), None)  # at most one per slot
        if ahead is not None:  # a read ahead of a bucket that was not used next: wait it out
            self._wait(self._reads.pop(ahead), "read")
        fut, self._writes[k] = self._writes[k], None
        if fut is not None and not all(self._wait(fut, "write")):
            raise PageLost("writing optimizer states to the disk tier failed")

    def flush(self) -> None:
        """Wait until every started write is durable."""
        if self.disk is None:
            return
        for k in (0, 1):
            self._drain_slot(k)

    def close(self) -> None:
        self.flush()
        for buf in self._host + (self._bufs if self.disk is not None else []):
            self.arena.put_buffer(buf)
        if self.disk is not None:
            self.disk.free(self.page, [s for ss in self._slots for s in ss])
        self._host = []
