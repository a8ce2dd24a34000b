"""GPU<->CPU handlers on CUDA: one gather kernel + one DMA per contiguous host run, per batch.

The kernel is an ``index_select``/``index_copy_`` for a pool of one int64-wide segment, else
one launch of the pool's segment table (``segtable.py``: every segment of every page at once).

Each handler owns a DMA stream and a kernel stream (the offload's gather runs before its DMA,
the restore's scatter after, each overlapping a neighbour batch's DMA; restores on the highest
stream priority), ``depth`` device staging buffers of
``staging_bytes`` (the largest batch) and events. A batch first waits (on its streams, not the
host) for the events the engine recorded when pages were last released, then copies, then
records its event; the lane thread (or a caller holding the lane on loan) waits for that one
event, so a slot is reused only after its
bytes have landed. A staging buffer is reused ``depth`` launches later, when the lane has
already waited for the batch that used it (a lane keeps at most ``depth`` batches in flight).
Three in flight, not two: a lane held up for a batch's time (the engine lock, the interpreter
lock) still finds the copy engine busy when it comes back. No device-wide synchronize.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from kvtier.tiers.device import DevicePool
from kvtier.tiers.pinned import HostArena
from kvtier.transfer import dma
from kvtier.transfer.base import Moves, Queued, TransferHandler
from kvtier.transfer.gather import wide
from kvtier.transfer.segtable import GroupTables, SegmentTable, group_table
from kvtier.types import Direction

MAX_VIEWS = 256  # cached buffer views per handler (batch shapes repeat: a few per pool)
T = TypeVar("T")


class _CudaHandler(TransferHandler):
    depth = 3
    queued = True

    def __init__(
        self,
        arena: HostArena,
        device: torch.device,
        staging_bytes: int,
        *,
        priority: int = 0,
        kernel_stream: bool = True,
    ) -> None:
        self._arena = arena
        self._device = device
        self._device_index = torch.cuda.current_device() if device.index is None else device.index
        self._stream = torch.cuda.Stream(device, priority=priority)  # the DMA stream
        # A kernel stream beside it: the offload's gather runs first, the restore's scatter
        # last, each overlapping a neighbour batch's DMA (``kernel_stream=False``: one stream,
        # for a handler that runs one batch at a time). A batch starts on ``_entry`` and ends on
        # ``_exit``; the kernel stream (``_kernel``) is the one touching pool pages.
        self._kernel = (
            torch.cuda.Stream(device, priority=priority) if kernel_stream else self._stream
        )
        self._entry = self._exit = self._stream
        # Batches i+1.. are launched while batch i's copies still run: a buffer per batch.
        # (A whole number of int64 words, so the kernels can see every buffer as int64 rows.)
        words = -(-staging_bytes // 8)
        self._buffers = [
            torch.empty(8 * words, dtype=torch.uint8, device=device) for _ in range(self.depth)
        ]
        # Pinned index buffers, one per staging buffer: a batch's slot indices go up from one
        # that the batch ``depth`` launches back (completed by then) used.
        # And a device index buffer per batch in flight, so launching allocates nothing and
        # nothing needs ``record_stream``: like the staging, it is reused ``depth`` launches on.
        rows = max(1, staging_bytes // 4096)
        pin = torch.cuda.is_available()
        self._indices = [
            torch.empty(rows, dtype=torch.long, pin_memory=pin) for _ in range(self.depth)
        ]
        self._indices_np = [t.numpy() for t in self._indices]  # written by numpy, no tensor
        self._device_indices = [
            torch.empty(rows, dtype=torch.long, device=device) for _ in range(self.depth)
        ]
        # Events made once: a batch's ``done`` per turn (the lane waits on it before the turn
        # comes round again); one hand-over event (a stream waits on its latest record).
        self._done = [torch.cuda.Event() for _ in range(self.depth)]
        self._handed = torch.cuda.Event()
        # Copies queued by address (~1-2 us each, the interpreter lock kept) where the CUDA
        # runtime is found; else ``Tensor.copy_`` (~25 us each).
        self._dma = dma.runtime()
        self._turn = 0  # the buffers of the batch being launched
        self._staging = self._buffers[0]
        # Per pool, its one segment seen as int64 rows (None: several segments or odd widths,
        # its segment table then: one kernel for all segments): built once, not at every launch.
        self._rows64: weakref.WeakKeyDictionary[DevicePool, torch.Tensor | None] = (
            weakref.WeakKeyDictionary()
        )
        self._tables: weakref.WeakKeyDictionary[DevicePool, SegmentTable] = (
            weakref.WeakKeyDictionary()
        )
        self._groups: GroupTables = weakref.WeakKeyDictionary()  # layer groups' tables
        # Views of the turns' own staging and device index buffers, per shape (``_buffer``).
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._index_views: dict[tuple[int, int], torch.Tensor] = {}

    def _buffer(self, rows: int, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Staging for ``rows`` pages: as ``uint8`` rows (the DMA's view) and as ``int64`` rows
        (the kernel's; None when ``size`` is not a whole number of words). Called on the entry
        stream (a larger batch's own buffer is then also kept from reuse until the exit stream
        is done with it). The views of a turn's own buffer are made once per shape (tensor
        views cost tens of microseconds a launch)."""
        nbytes = rows * size
        if nbytes <= self._staging.numel():
            staging = self._staging
            return _memo(self._views, (self._turn, rows, size),
                         lambda: _views(staging[:nbytes], rows, size))
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        flat.record_stream(self._exit)
        return _views(flat, rows, size)

    def _pool_rows(self, pool: DevicePool) -> torch.Tensor | None:
        """The pool's pages as ``int64`` rows of its one segment, or None (generic path)."""
        try:
            return self._rows64[pool]
        except KeyError:
            rows = wide(pool.segments[0]) if len(pool.segments) == 1 else None
            found = rows if rows is not None and rows.dtype == torch.int64 else None
            self._rows64[pool] = found
            return found

    def _table(self, pool: DevicePool) -> SegmentTable:
        table = self._tables.get(pool)
        if table is None:
            table = self._tables[pool] = SegmentTable(pool.segments)
        return table

    def _index(self, values: np.ndarray) -> torch.Tensor:
        """The batch's indices on the device (copied on the current stream, read on the kernel
        stream). From pinned memory, written through its numpy view: a pageable source makes
        the copy synchronous, and the host would wait for the previous batch's DMA."""
        n = len(values)
        pinned = self._indices[self._turn]
        if n > pinned.numel():  # a batch larger than the staging: a one-off allocation
            packed = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
            index = packed.pin_memory().to(self._device, non_blocking=True)
            index.record_stream(self._kernel)  # the allocator must not reuse it before then
            return index
        self._indices_np[self._turn][:n] = values
        device = self._device_indices[self._turn]
        view = _memo(self._index_views, (self._turn, n), lambda: device[:n])
        if self._dma is not None:
            self._dma.copy(view.data_ptr(), pinned.data_ptr(), 8 * n, self._entry)
        else:
            view.copy_(pinned[:n], non_blocking=True)
        return view

    def run(self, batch: Moves) -> list[bool]:
        return self.launch(batch)()

    def launch(self, batch: Moves) -> Callable[[], list[bool]]:
        if batch.pool is not None and batch.pool.closed:  # detached: nothing to copy
            failed = [False] * len(batch)
            return Queued(lambda: failed, lambda: True)
        self._staging = self._buffers[self._turn]
        done = self._done[self._turn]
        # Streams are switched with ``set_stream`` and the caller's put back at the end: the
        # ``torch.cuda.device``/``torch.cuda.stream`` context managers cost ~50 us a launch.
        device = torch.cuda.current_device()
        caller = torch.cuda.current_stream(self._device_index)
        try:
            torch.cuda.set_stream(self._entry)
            for event in batch.ready:  # the pool's pages were last used under these
                self._kernel.wait_event(event)
            if len(batch.srcs):
                self._copy(batch)
            done.record(self._exit)
        finally:
            torch.cuda.set_stream(caller)
            if device != self._device_index:
                torch.cuda.set_device(device)
        self._turn = (self._turn + 1) % self.depth
        n = len(batch)

        def wait() -> list[bool]:
            done.synchronize()
            return [True] * n

        return Queued(wait, done.query)

    def _copy(self, batch: Moves) -> None:
        """Queue the batch's copies (from the entry stream); they end on the exit stream."""
        raise NotImplementedError

    def _runs(self, size: int, slots: np.ndarray) -> list[tuple[torch.Tensor | int, int, int]]:
        """The host runs of ``slots``: by address with the runtime's copies, else as views."""
        if self._dma is not None:
            return list(self._arena.run_addresses(size, slots))
        return list(self._arena.runs_array(size, slots))

    def _dma_runs(self, runs: list[tuple[torch.Tensor | int, int, int]], staging: torch.Tensor,
                  size: int, to_host: bool, part: tuple[int, int] | None = None) -> None:
        """One DMA per host run between it and its rows of ``staging``, on the DMA stream; with
        ``part`` (bytes ``[a, z)`` of each page, into the host only), a 2-D DMA of that range
        of each page of the run into staging rows of ``z - a`` bytes."""
        a, z = part or (0, size)
        width, at, base = z - a, 0, staging.data_ptr()
        for run, lo, hi in runs:
            k = hi - lo
            if isinstance(run, int):
                assert self._dma is not None
                if width < size:
                    self._dma.copy_2d(base + at * width, width, run + a, size, width, k,
                                      self._stream)
                else:
                    dst, src = (run, base + at * size) if to_host else (base + at * size, run)
                    self._dma.copy(dst, src, k * size, self._stream)
            elif to_host:
                run.copy_(staging[at : at + k], non_blocking=True)
            else:
                staging[at : at + k].copy_(run[:, a:z], non_blocking=True)
            at += k

    def _hand_over(self, src: torch.cuda.Stream, dst: torch.cuda.Stream) -> None:
        """Work queued on ``dst`` from here on runs after what ``src`` has queued so far."""
        if src is dst:
            return
        self._handed.record(src)
        dst.wait_event(self._handed)

    def close(self) -> None:
        self._kernel.synchronize()
        self._stream.synchronize()


class CudaOffload(_CudaHandler):
    """GPU->CPU: gather the pages into staging in host-run order (kernel stream), then one DMA
    per run (DMA stream), so a batch's gather runs while the previous batch's DMA does."""

    direction = Direction.GPU_TO_CPU

    def __init__(self, arena: HostArena, device: torch.device, staging_bytes: int) -> None:
        super().__init__(arena, device, staging_bytes)
        self._entry = self._kernel

    def _copy(self, batch: Moves) -> None:
        pool, size, srcs = batch.pool, batch.page_size, batch.srcs
        assert pool is not None, "GPU<->CPU batch without a pool"
        runs = self._runs(size, batch.dsts)
        order = srcs if len(runs) == 1 else _in_run_order(srcs, runs)
        staging, words = self._buffer(len(srcs), size)
        index = self._index(order)
        rows = self._pool_rows(pool)
        if rows is not None and words is not None:
            torch.index_select(rows, 0, index, out=words)
        else:
            self._table(pool).gather(index, staging)
        self._hand_over(self._kernel, self._stream)
        torch.cuda.set_stream(self._stream)
        self._dma_runs(runs, staging, size, to_host=True)


class CudaRestore(_CudaHandler):
    """CPU->GPU: one DMA per host run into staging (DMA stream), then one scatter kernel into
    the pool (kernel stream), so a batch's scatter runs while the next batch's DMA does."""

    direction = Direction.CPU_TO_GPU

    def __init__(
        self, arena: HostArena, device: torch.device, staging_bytes: int, *, inline: bool = False
    ) -> None:
        # Restores first on the GPU too: their streams have the highest priority, so a
        # restore's scatter is scheduled ahead of an offload backlog's gather kernels. An inline
        # restore (one batch, run by the acquiring thread) keeps one stream: nothing to overlap.
        super().__init__(arena, device, staging_bytes, priority=-1, kernel_stream=not inline)
        self._exit = self._kernel

    def _copy(self, batch: Moves) -> None:
        pool, size, dsts = batch.pool, batch.page_size, batch.dsts
        assert pool is not None, "GPU<->CPU batch without a pool"
        # A layer group (``segments``): its byte range of each CPU page, through a table of
        # those segments only.
        group = group_table(self._groups, pool, *batch.segments) if batch.segments else None
        part = group[1] if group is not None else None
        runs = self._runs(size, batch.srcs)
        order = dsts if len(runs) == 1 else _in_run_order(dsts, runs)
        index = self._index(order)
        staging, words = self._buffer(len(dsts), part[1] - part[0] if part else size)
        self._dma_runs(runs, staging, size, to_host=False, part=part)
        self._hand_over(self._stream, self._kernel)
        torch.cuda.set_stream(self._kernel)
        rows = self._pool_rows(pool) if group is None else None
        if rows is not None and words is not None:
            rows.index_copy_(0, index, words)
        else:
            table = group[0] if group is not None else self._table(pool)
            table.scatter(index, staging)


def _memo(cache: dict[Any, T], key: Any, make: Callable[[], T]) -> T:
    """``cache[key]``, made by ``make()`` the first time (the cache is emptied when it holds
    ``MAX_VIEWS`` entries: shapes repeat, a few per pool)."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= MAX_VIEWS:
            cache.clear()
        found = cache[key] = make()
    return found


def _views(flat: torch.Tensor, rows: int, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``flat`` as ``rows`` rows of ``size`` bytes, and as int64 rows (None: odd widths)."""
    words = flat.view(torch.int64).view(rows, size // 8) if size % 8 == 0 else None
    return flat.view(rows, size), words


def _in_run_order(
    values: np.ndarray, runs: list[tuple[torch.Tensor | int, int, int]]
) -> np.ndarray:
    """``values`` reordered as the runs list their positions (runs cover every position once)."""
    return np.concatenate([values[lo:hi] for _, lo, hi in runs])
