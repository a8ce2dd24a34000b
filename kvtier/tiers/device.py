"""The GPU tier of one attached engine: a fixed array of page slots in one or more segments.

Contract (see ``kvtier.tiers.base``):
    * ``DevicePool.allocate(num_slots, page_size, device)``: daemon-owned memory. ``"cuda:N"`` is
      one ``torch.empty`` device allocation; ``"cpu"`` is a sealed memfd (``tiers/memfd.py``)
      mapped shared, so a second process given its descriptor maps the same bytes. No file name
      exists anywhere: nothing is left behind by any exit, ``kill -9`` included.
    * ``DevicePool.from_segments(segments)``: engine-owned memory; each segment a 2-D ``uint8``
      tensor ``[num_slots, seg_bytes]`` with contiguous rows (row stride may exceed ``seg_bytes``).
      Such a pool has no ``handle()``: the engine that registered it already maps it.
    * ``take(n) -> int64 array | None``: all or nothing, the ``n`` lowest free slots, sorted.
      ``give(slots)`` returns an int64 array of slots (any order); a free, out-of-range or repeated
      slot is an internal error (assert), detected before anything changes. Both are vectorised
      (a free mask, a count and a lowest-free hint); ``num_free`` is O(1).
    * ``alloc(n) -> list | None`` and ``free(slots)``: the same on lists.
    * ``gather_rows(slots) -> [len, page_size]`` and ``scatter_rows(slots, src)`` copy whole pages
      (the concatenation of each segment's row) on the pool's device, through the one row copy
      ``kvtier.transfer.gather`` (which the transfer handlers use too).
    * ``handle()`` -> ``PoolHandle``; ``open_handle(handle)`` maps it in another process as a
      ``[num_slots, page_size]`` tensor. ``close()`` drops the memory and closes the memfd;
      idempotent.
CUDA handles are ``kvtier.tiers.sharing``'s one format (``KVIPC1`` + JSON of the CUDA IPC memory
handle and torch's cross-process ref counter; never pickle), the format Register uses too. They
are capabilities: never log them. Both processes must run as the same user on the same GPU.
All methods are thread-safe.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

from kvtier.errors import CapacityError, FailedPrecondition, InvalidArgument
from kvtier.tiers import memfd, sharing
from kvtier.tiers.base import PoolHandle
from kvtier.tiers.runs import as_slots, ascending
from kvtier.transfer.gather import gather, scatter
from kvtier.types import SlotIndex

_MIN_SCAN = 1024  # mask bytes a take scans at least (one cheap numpy pass)


class DevicePool:
    """Fixed page slots of one pool; the engine's page table maps pages to these slots."""

    def __init__(
        self, segments: list[torch.Tensor], *, fd: int = -1, owned: bool = False
    ) -> None:
        """Use ``allocate`` or ``from_segments``; this trusts already-validated segments."""
        self.segments = segments
        self.num_slots = segments[0].shape[0]
        self.page_size = sum(s.shape[1] for s in segments)
        self.device = str(segments[0].device)
        self.fd = fd  # CPU mode: the pool's sealed memfd, closed by close()
        self.owned = owned
        # Keyed copy columns (stores, loads) queued or in flight through this memory; changed
        # under the engine lock. A detach waits for 0 before ``close``: a copy out of closed
        # memory would store whatever its CPU slot held before (another tenant's bytes).
        self.copying = 0
        # Separate memory mappings behind the segments (views of one mapping share it): what
        # the pool costs of the process's map count (``vm.max_map_count``).
        storages = {s.untyped_storage().data_ptr(): s.untyped_storage() for s in segments}
        self.mappings = len(storages)
        # The address space those mappings take: what a registered pool of sparse memory costs
        # the process however few slots it declares (``kvtier/tenancy/views.py``).
        self.mapped_bytes = sum(st.nbytes() for st in storages.values())
        self._is_free = np.ones(self.num_slots, dtype=np.bool_)
        self._num_free = self.num_slots
        self._hint = 0  # no slot below this is free
        self._lock = threading.Lock()
        self._closed = False

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def allocate(cls, num_slots: int, page_size: int, device: str) -> DevicePool:
        """A daemon-owned pool of ``num_slots * page_size`` bytes on ``device``."""
        if num_slots <= 0:
            raise InvalidArgument("num_slots", f"must be > 0, got {num_slots}")
        if page_size <= 0:
            raise InvalidArgument("page_size", f"must be > 0, got {page_size}")
        if device == "cpu":
            try:
                fd = memfd.create(num_slots * page_size, "kvtier-pool")
            except OSError as exc:
                raise CapacityError(f"num_slots: cannot make the pool's memory ({exc})") from None
            try:
                flat = memfd.map_shared(fd, num_slots * page_size)
            except (OSError, ValueError, RuntimeError) as exc:
                os.close(fd)
                raise CapacityError(f"num_slots: cannot map the pool's memory ({exc})") from None
            return cls([flat.view(num_slots, page_size)], fd=fd, owned=True)
        if not device.startswith("cuda"):
            raise InvalidArgument("device", f"expected 'cpu' or 'cuda:N', got {device!r}")
        data = torch.empty((num_slots, page_size), dtype=torch.uint8, device=device)
        return cls([data], owned=True)

    @classmethod
    def from_segments(cls, segments: list[torch.Tensor]) -> DevicePool:
        """A pool over engine-owned memory. Raises ``InvalidArgument`` naming the bad segment."""
        if not segments:
            raise InvalidArgument("segments", "at least one segment is required")
        first = segments[0]
        for i, seg in enumerate(segments):
            name = f"segments[{i}]"
            if not isinstance(seg, torch.Tensor):
                raise InvalidArgument(name, f"expected a torch.Tensor, got {type(seg).__name__}")
            if seg.dtype != torch.uint8 or seg.dim() != 2:
                raise InvalidArgument(name, f"expected 2-D uint8, got {seg.dim()}-D {seg.dtype}")
            if seg.shape[0] != first.shape[0] or seg.shape[0] == 0:
                raise InvalidArgument(name, f"{seg.shape[0]} rows; expected {first.shape[0]} > 0")
            if seg.shape[1] == 0 or seg.stride(1) != 1 or seg.stride(0) < seg.shape[1]:
                raise InvalidArgument(name, f"rows must be contiguous, stride {seg.stride()}")
            if seg.device != first.device:
                raise InvalidArgument(name, f"on {seg.device}, segments[0] on {first.device}")
        return cls(list(segments))

    # ---- slots ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    def take(self, n: int) -> np.ndarray | None:
        """The ``n`` lowest free slots (sorted ``int64``), or ``None`` (nothing changed)."""
        if n < 0:
            raise InvalidArgument("n", f"must be >= 0, got {n}")
        with self._lock:
            if n > self._num_free:
                return None
            if n == 0:
                return np.empty(0, dtype=np.int64)
            out = self._lowest_free(n)
            first, last = int(out[0]), int(out[-1])
            if last - first == n - 1:
                self._is_free[first : last + 1] = False
            else:
                self._is_free[out] = False
            self._num_free -= n
            self._hint = last + 1  # the n lowest free slots are gone: none free below this
            return out

    def take_some(self, n: int) -> np.ndarray:
        """Up to ``n`` of the lowest free slots (sorted ``int64``; fewer when fewer are free)."""
        slots = self.take(min(n, self._num_free))  # callers serialise takes (the engine lock)
        assert slots is not None
        return slots

    def give(self, slots: np.ndarray) -> None:
        """Return ``slots`` (any order, any int dtype).

        Freeing a free, out-of-range or repeated slot is an internal error (assert); nothing is
        changed then.
        """
        if len(slots) == 0:
            return
        ordered, distinct = ascending(np.asarray(slots, dtype=np.int64))
        first, last = int(ordered[0]), int(ordered[-1])
        assert distinct, f"slot freed twice in {ordered.tolist()}"
        assert first >= 0 and last < self.num_slots, f"bad free in {ordered.tolist()}"
        # Distinct and sorted: first..last is one slice exactly when it holds every slot.
        span: slice | np.ndarray = ordered
        if last - first == len(ordered) - 1:
            span = slice(first, last + 1)
        with self._lock:
            is_free = self._is_free
            assert not is_free[span].any(), f"free of a free slot in {ordered.tolist()}"
            is_free[span] = True
            self._num_free += len(ordered)
            self._hint = min(self._hint, first)

    def alloc(self, n: int) -> list[SlotIndex] | None:
        """``take`` as a list: the ``n`` lowest free slots, or ``None`` (nothing changed)."""
        out = self.take(n)
        return None if out is None else cast("list[SlotIndex]", out.tolist())

    def free(self, slots: Sequence[int]) -> None:
        """``give`` for a list. Freeing a free or out-of-range slot is an internal error."""
        if len(slots) != 0:
            self.give(as_slots(slots))

    def _lowest_free(self, n: int) -> np.ndarray:
        """The ``n`` lowest free slots; the caller holds the lock and ``n <= num_free``.

        Scans from the hint in windows that double, so a take near the low end costs about
        ``2 n`` mask bytes, not the whole pool.
        """
        parts: list[np.ndarray] = []
        pos, width, need = self._hint, max(2 * n, _MIN_SCAN), n
        while need:
            end = min(self.num_slots, pos + width)
            found = np.flatnonzero(self._is_free[pos:end])[:need]
            assert len(found) or end < self.num_slots, "free count out of step with the mask"
            parts.append(found + pos)
            need -= len(found)
            pos, width = end, width * 2
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    # ---- page copies ---------------------------------------------------------------------
    def gather_rows(self, slots: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Pages ``slots`` as a ``[len(slots), page_size]`` tensor on the pool's device."""
        idx = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        if out is None:
            out = torch.empty((len(slots), self.page_size), dtype=torch.uint8, device=self.device)
        gather(self.segments, idx, out)
        return out

    def scatter_rows(self, slots: Sequence[int], src: torch.Tensor) -> None:
        """Write ``src[j]`` (``[len(slots), page_size]``, same device) into page ``slots[j]``.

        ``slots`` must be distinct.
        """
        if src.shape != (len(slots), self.page_size):
            raise InvalidArgument("src", f"shape {tuple(src.shape)} != ({len(slots)}, page_size)")
        idx = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        scatter(self.segments, idx, src)

    # ---- sharing and lifecycle -----------------------------------------------------------
    def handle(self) -> PoolHandle:
        """What a second process needs to map this pool (``open_handle``)."""
        if self._closed:
            raise FailedPrecondition("pool is closed")
        if not self.owned:
            raise FailedPrecondition("engine-registered pool: its memory is mapped by its owner")
        if self.fd >= 0:
            return PoolHandle("memfd", self.num_slots, self.page_size, self.device, fd=self.fd)
        ipc = sharing.encode_cuda(self.segments[0].untyped_storage())
        return PoolHandle("cuda_ipc", self.num_slots, self.page_size, self.device, ipc=ipc)

    def close(self) -> None:
        """Drop the memory (views and descriptors held elsewhere keep theirs alive)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.segments = []
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_handle(handle: PoolHandle) -> torch.Tensor:
    """Map a pool made by another process as a ``[num_slots, page_size]`` ``uint8`` tensor."""
    size = handle.num_slots * handle.page_size
    if handle.kind == "memfd":
        memfd.check(handle.fd, size, "handle.fd")
        return memfd.map_shared(handle.fd, size).view(handle.num_slots, handle.page_size)
    if handle.kind == "cuda_ipc":
        return sharing.open_rows(handle.ipc, handle.num_slots, handle.page_size,
                                 handle.page_size, 0, "handle")
    raise InvalidArgument("handle.kind", f"expected 'memfd' or 'cuda_ipc', got {handle.kind!r}")
