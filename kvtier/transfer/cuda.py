"""GPU<->CPU handlers on CUDA: one gather kernel + one DMA per contiguous host run, per batch.

Each handler owns a CUDA stream (the offload a second one for its gather kernel, so a batch's
gather runs while its neighbour's DMA does), ``depth`` device staging buffers of
``staging_bytes`` (the largest batch) and events. A batch first waits (on its streams, not the
host) for the events the engine recorded when pages were last released, then copies, then
records its event; the lane thread waits for that one event, so a slot is reused only after its
bytes have landed. A staging buffer is reused ``depth`` launches later, when the lane has
already waited for the batch that used it (a lane keeps at most ``depth`` batches in flight).
Three in flight, not two: a lane held up for a batch's time (the engine lock, the interpreter
lock) still finds the copy engine busy when it comes back. No device-wide synchronize.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvtier.tiers.pinned import HostArena
from kvtier.transfer.base import Moves, TransferHandler
from kvtier.transfer.gather import gather, scatter
from kvtier.types import Direction


class _CudaHandler(TransferHandler):
    depth = 3

    def __init__(self, arena: HostArena, device: torch.device, staging_bytes: int) -> None:
        self._arena = arena
        self._device = device
        self._stream = torch.cuda.Stream(device)
        self._entry = self._stream  # the stream that first touches the pool's pages
        # Batches i+1.. are launched while batch i's copies still run: a buffer per batch.
        self._buffers = [
            torch.empty(staging_bytes, dtype=torch.uint8, device=device) for _ in range(self.depth)
        ]
        # Pinned index buffers, one per staging buffer: a batch's slot indices go up from one
        # that the batch ``depth`` launches back (completed by then) used.
        rows = max(1, staging_bytes // 4096)
        pin = torch.cuda.is_available()
        self._indices = [
            torch.empty(rows, dtype=torch.long, pin_memory=pin) for _ in range(self.depth)
        ]
        self._turn = 0  # the buffers of the batch being launched
        self._staging = self._buffers[0]

    def _buffer(self, rows: int, size: int) -> torch.Tensor:
        """Staging for ``rows`` pages; called on the entry stream (a larger batch's own buffer
        is then also kept from reuse until the DMA stream is done with it)."""
        if rows * size <= self._staging.numel():
            return self._staging[: rows * size].view(rows, size)
        extra = torch.empty((rows, size), dtype=torch.uint8, device=self._device)
        if self._entry is not self._stream:
            extra.record_stream(self._stream)
        return extra

    def _index(self, values: np.ndarray) -> torch.Tensor:
        # From pinned memory: a pageable source makes the copy synchronous, and the host would
        # wait for the previous batch's DMA on this stream, undoing the double buffering.
        packed = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        pinned = self._indices[self._turn]
        if len(values) > pinned.numel():
            return packed.pin_memory().to(self._device, non_blocking=True)
        host = pinned[: len(values)]
        host.copy_(packed)
        return host.to(self._device, non_blocking=True)

    def run(self, batch: Moves) -> list[bool]:
        return self.launch(batch)()

    def launch(self, batch: Moves) -> Callable[[], list[bool]]:
        self._staging = self._buffers[self._turn]
        done = torch.cuda.Event()
        with torch.cuda.device(self._device), torch.cuda.stream(self._entry):
            for event in batch.ready:
                self._entry.wait_event(event)
            if len(batch.srcs):
                self._copy(batch)
            done.record(self._stream)
        self._turn = (self._turn + 1) % self.depth
        n = len(batch)

        def wait() -> list[bool]:
            done.synchronize()
            return [True] * n

        return wait

    def _copy(self, batch: Moves) -> None:
        """Queue the batch's copies (from the entry stream); they end on ``_stream``."""
        raise NotImplementedError

    def close(self) -> None:
        self._entry.synchronize()
        self._stream.synchronize()


class CudaOffload(_CudaHandler):
    """GPU->CPU: gather the pages into staging in host-run order, then one DMA per run."""

    direction = Direction.GPU_TO_CPU

    def __init__(self, arena: HostArena, device: torch.device, staging_bytes: int) -> None:
        super().__init__(arena, device, staging_bytes)
        self._entry = torch.cuda.Stream(device)  # gathers, beside the DMA stream

    def _copy(self, batch: Moves) -> None:
        pool, size, srcs = batch.pool, batch.page_size, batch.srcs
        assert pool is not None, "GPU<->CPU batch without a pool"
        runs = self._arena.runs_array(size, batch.dsts)
        order = srcs if len(runs) == 1 else _in_run_order(srcs, runs)
        staging = self._buffer(len(srcs), size)
        gather(pool.segments, self._index(order), staging)
        gathered = torch.cuda.Event()
        gathered.record(self._entry)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(gathered)
            at = 0
            for view, lo, hi in runs:
                view.copy_(staging[at : at + hi - lo], non_blocking=True)
                at += hi - lo


class CudaRestore(_CudaHandler):
    """CPU->GPU: one DMA per host run into staging, then one scatter kernel into the pool."""

    direction = Direction.CPU_TO_GPU

    def _copy(self, batch: Moves) -> None:
        # One stream: measured on the H100, a separate scatter stream slowed 64-256 KiB restores.
        pool, size, dsts = batch.pool, batch.page_size, batch.dsts
        assert pool is not None, "GPU<->CPU batch without a pool"
        runs = self._arena.runs_array(size, batch.srcs)
        staging = self._buffer(len(dsts), size)
        at = 0
        for view, lo, hi in runs:
            staging[at : at + hi - lo].copy_(view, non_blocking=True)
            at += hi - lo
        order = dsts if len(runs) == 1 else _in_run_order(dsts, runs)
        scatter(pool.segments, self._index(order), staging)


def _in_run_order(values: np.ndarray, runs: list[tuple[torch.Tensor, int, int]]) -> np.ndarray:
    """``values`` reordered as the runs list their positions (runs cover every position once)."""
    return np.concatenate([values[lo:hi] for _, lo, hi in runs])
