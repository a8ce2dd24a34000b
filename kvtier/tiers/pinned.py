"""The pinned host tier: exact-size page-aligned chunks, lazily created, one slab per page size.

Contract (see ``kvtier.tiers.base``): ``HostArena(budget_bytes, chunk_bytes, pin)``.
    * A chunk is one ``mmap`` of ``per_chunk * page_size`` bytes (``per_chunk = chunk_bytes //
      page_size``, at least 1), so it is page-aligned and exactly sized; it is pinned with
      ``cudaHostRegister`` only when ``pin`` is set and CUDA is available. Chunks are created on
      demand and ``reserved_bytes`` never exceeds ``budget_bytes``.
    * ``alloc(page_size, n)`` is all or nothing. It picks the smallest free run that holds all
      ``n`` slots (best fit), else a fresh chunk, else the fewest, largest runs.
    * A chunk that becomes entirely free is released, except one spare per slab kept to avoid
      map/pin churn; spares are released as soon as another allocation needs their budget.
    * ``get_buffer(nbytes)``/``put_buffer(buf)``: exact-size pooled buffers that share the budget.
      Idle pooled buffers are released when the budget is needed elsewhere.
All methods are thread-safe.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from kvtier.errors import InvalidArgument
from kvtier.tiers.base import HostSlot
from kvtier.tiers.runs import RunSet

_REGISTER_FLAGS = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped: any context may DMA


class _Mapping:
    """One anonymous mapping, optionally registered (pinned) with CUDA."""

    __slots__ = ("mm", "nbytes", "pinned", "tensor")

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, nbytes)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.pinned = pin and _register(self.tensor.data_ptr(), nbytes)

    def __del__(self) -> None:
        # Unpin before the mapping can go: CUDA keeps a registration past munmap, and a new
        # mapping at the same address would then fail to register ("already mapped").
        with contextlib.suppress(Exception):
            self.release()

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        del self.tensor
        # A caller may still hold a view: then the mapping dies with its last view.
        with contextlib.suppress(BufferError):
            self.mm.close()


def _register(ptr: int, nbytes: int) -> bool:
    """Pin ``[ptr, ptr + nbytes)``; an unpinned chunk still works (slower DMA), so don't raise."""
    if not torch.cuda.is_available():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS)
    return int(rc) == 0


@dataclass(slots=True)
class _Slab:
    page_size: int
    per_chunk: int
    chunks: dict[int, _Mapping] = field(default_factory=dict)
    free: dict[int, RunSet] = field(default_factory=dict)  # chunk_no -> free runs
    used: int = 0  # slots in use

    @property
    def chunk_bytes(self) -> int:
        return self.per_chunk * self.page_size


class HostArena:
    """Pinned host memory for pages of any size, within one byte budget."""

    def __init__(self, budget_bytes: int, chunk_bytes: int, pin: bool = True) -> None:
        if budget_bytes < 0:
            raise InvalidArgument("budget_bytes", f"must be >= 0, got {budget_bytes}")
        if chunk_bytes <= 0:
            raise InvalidArgument("chunk_bytes", f"must be > 0, got {chunk_bytes}")
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes
        self.pin = pin
        self._lock = threading.Lock()
        self._slabs: dict[int, _Slab] = {}
        self._reserved = 0
        self._idle_bufs: dict[int, list[_Mapping]] = {}
        self._busy_bufs: dict[int, tuple[_Mapping, int]] = {}  # data_ptr -> (mapping, nbytes)
        self._closed = False

    # ---- accounting ----------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.budget_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of chunks and pooled buffers actually mapped (<= budget)."""
        return self._reserved

    @property
    def used_bytes(self) -> int:
        """Bytes of slots in use plus pooled buffers handed out."""
        with self._lock:
            slots = sum(s.used * s.page_size for s in self._slabs.values())
            return slots + sum(n for _, n in self._busy_bufs.values())

    def slots_per_chunk(self, page_size: int) -> int:
        return max(1, self.chunk_bytes // page_size)

    # ---- slots ---------------------------------------------------------------------------
    def alloc(self, page_size: int, n: int) -> list[HostSlot] | None:
        """``n`` slots of ``page_size`` bytes, or ``None`` (nothing changed) if over budget."""
        _check_page_size(page_size)
        if n < 0:
            raise InvalidArgument("n", f"must be >= 0, got {n}")
        if n == 0:
            return []
        with self._lock:
            slab = self._slab(page_size)
            runs = self._plan(slab, n)
            if runs is None:
                return None
            out: list[int] = []
            for chunk_no, start, k in runs:
                if chunk_no < 0:
                    chunk_no = self._new_chunk(slab)
                slab.free[chunk_no].take(start, k)
                base = chunk_no * slab.per_chunk
                out.extend(range(base + start, base + start + k))
            slab.used += n
            return cast("list[HostSlot]", out)  # HostSlot is an int at run time

    def free(self, page_size: int, slots: Sequence[int]) -> None:
        """Return slots. Freeing a free or unknown slot is an internal error (assert)."""
        if not slots:
            return
        with self._lock:
            slab = self._slabs[page_size]
            touched: set[int] = set()
            for chunk_no, start, k in _group(slots, slab.per_chunk):
                assert chunk_no in slab.chunks, f"slot of unknown chunk {chunk_no}"
                slab.free[chunk_no].add(start, k)
                touched.add(chunk_no)
            slab.used -= len(slots)
            for chunk_no in sorted(touched):
                if slab.free[chunk_no].total == slab.per_chunk:
                    self._maybe_release(slab, chunk_no)

    def rows(self, page_size: int, slots: Sequence[int]) -> list[torch.Tensor]:
        """1-D ``uint8`` views, one per slot, in order."""
        if not slots:
            return []
        slab = self._slabs[page_size]
        out = []
        for s in slots:
            chunk_no, i = divmod(int(s), slab.per_chunk)
            out.append(slab.chunks[chunk_no].tensor[i * page_size : (i + 1) * page_size])
        return out

    def runs(self, page_size: int, slots: Sequence[int]) -> list[tuple[torch.Tensor, range]]:
        """Group ``slots`` (in the given order) into contiguous runs.

        Each run is a 2-D view ``[len, page_size]`` plus the positions of its slots in ``slots``
        (a ``range``: a run's positions are consecutive).
        Consecutive list entries join a run when their ids are consecutive in one chunk.
        """
        out: list[tuple[torch.Tensor, range]] = []
        if not slots:
            return out
        slab = self._slabs[page_size]
        first, n = int(slots[0]), len(slots)
        chunk_no, start = divmod(first, slab.per_chunk)
        if start + n <= slab.per_chunk and list(slots) == list(range(first, first + n)):
            # The common case (slots allocated as one run): a single view, no per-slot walk.
            flat = slab.chunks[chunk_no].tensor[start * page_size : (start + n) * page_size]
            return [(flat.view(n, page_size), range(n))]
        pos = 0
        while pos < len(slots):
            chunk_no, start = divmod(int(slots[pos]), slab.per_chunk)
            end = pos + 1
            while (
                end < len(slots)
                and int(slots[end]) == int(slots[end - 1]) + 1
                and (start + end - pos) < slab.per_chunk
            ):
                end += 1
            k = end - pos
            flat = slab.chunks[chunk_no].tensor[start * page_size : (start + k) * page_size]
            out.append((flat.view(k, page_size), range(pos, end)))
            pos = end
        return out

    def is_pinned(self, page_size: int, slot: HostSlot) -> bool:
        slab = self._slabs[page_size]
        return slab.chunks[int(slot) // slab.per_chunk].pinned

    # ---- pooled buffers ------------------------------------------------------------------
    def get_buffer(self, nbytes: int) -> torch.Tensor | None:
        """An exact-size 1-D ``uint8`` buffer from the pool, or ``None`` when over budget."""
        if nbytes <= 0:
            raise InvalidArgument("nbytes", f"must be > 0, got {nbytes}")
        with self._lock:
            idle = self._idle_bufs.get(nbytes)
            if idle:
                m = idle.pop()
            else:
                size = _round_up(nbytes, mmap.PAGESIZE)
                if not self._make_room(size):
                    return None
                m = _Mapping(size, self.pin)
                self._reserved += m.nbytes
            buf = m.tensor[:nbytes]
            self._busy_bufs[buf.data_ptr()] = (m, nbytes)
            return buf

    def put_buffer(self, buf: torch.Tensor) -> None:
        """Return a buffer from ``get_buffer``; it stays mapped for the next caller of that size."""
        with self._lock:
            m, _ = self._busy_bufs.pop(buf.data_ptr())
            self._idle_bufs.setdefault(buf.numel(), []).append(m)

    # ---- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Unpin and unmap everything. Idempotent; views handed out must no longer be used."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slab in self._slabs.values():
                for m in slab.chunks.values():
                    m.release()
            for ms in self._idle_bufs.values():
                for m in ms:
                    m.release()
            for m, _ in self._busy_bufs.values():
                m.release()
            self._slabs.clear()
            self._idle_bufs.clear()
            self._busy_bufs.clear()
            self._reserved = 0

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals (caller holds the lock) -----------------------------------------------
    def _slab(self, page_size: int) -> _Slab:
        slab = self._slabs.get(page_size)
        if slab is None:
            slab = _Slab(page_size, self.slots_per_chunk(page_size))
            self._slabs[page_size] = slab
        return slab

    def _plan(self, slab: _Slab, n: int) -> list[tuple[int, int, int]] | None:
        """Runs ``(chunk_no or -1 for a new chunk, start, count)`` covering ``n`` slots, or None."""
        existing = [
            (length, chunk_no, start)
            for chunk_no, rs in slab.free.items()
            for start, length in rs.items()
        ]
        fits = [r for r in existing if r[0] >= n]
        if fits:
            length, chunk_no, start = min(fits)  # best fit; ties -> lowest chunk, lowest start
            return [(chunk_no, start, n)]
        free_existing = sum(r[0] for r in existing)
        new_chunks = -(-max(0, n - free_existing) // slab.per_chunk)
        if slab.per_chunk >= n:
            new_chunks = 1  # one fresh chunk beats scattering n slots over fragments
        if new_chunks and not self._make_room(new_chunks * slab.chunk_bytes, slab):
            if free_existing < n:
                return None
            new_chunks = 0
        plan: list[tuple[int, int, int]] = []
        left = n
        for _ in range(new_chunks):
            k = min(left, slab.per_chunk)
            plan.append((-1, 0, k))
            left -= k
        for length, chunk_no, start in sorted(existing, key=lambda r: (-r[0], r[1], r[2])):
            if left == 0:
                break
            k = min(left, length)
            plan.append((chunk_no, start, k))
            left -= k
        assert left == 0
        return plan

    def _make_room(self, nbytes: int, exclude: _Slab | None = None) -> bool:
        """True if ``nbytes`` more fit the budget, releasing idle buffers/spare chunks if needed.

        ``exclude``'s spare chunks are kept: the caller is planning over them.
        """
        if self._reserved + nbytes <= self.budget_bytes:
            return True
        for idle in self._idle_bufs.values():
            while idle and self._reserved + nbytes > self.budget_bytes:
                m = idle.pop()
                self._reserved -= m.nbytes
                m.release()
        for slab in self._slabs.values():
            if slab is exclude:
                continue
            for chunk_no in [c for c, rs in slab.free.items() if rs.total == slab.per_chunk]:
                if self._reserved + nbytes <= self.budget_bytes:
                    return True
                self._release(slab, chunk_no)
        return self._reserved + nbytes <= self.budget_bytes

    def _new_chunk(self, slab: _Slab) -> int:
        chunk_no = 0
        while chunk_no in slab.chunks:  # reuse the lowest number: slot ids stay small
            chunk_no += 1
        slab.chunks[chunk_no] = _Mapping(slab.chunk_bytes, self.pin)
        slab.free[chunk_no] = RunSet(slab.per_chunk)
        self._reserved += slab.chunk_bytes
        return chunk_no

    def _maybe_release(self, slab: _Slab, chunk_no: int) -> None:
        # Empty chunks stay mapped and pinned: pinning (and unpinning, which can stall the
        # device) costs far more than the copies it serves. ``_make_room`` unmaps spare chunks
        # only when another page size or a pooled buffer needs the budget.
        return

    def _release(self, slab: _Slab, chunk_no: int) -> None:
        m = slab.chunks.pop(chunk_no)
        del slab.free[chunk_no]
        self._reserved -= slab.chunk_bytes
        m.release()


def _check_page_size(page_size: int) -> None:
    if page_size <= 0:
        raise InvalidArgument("page_size", f"must be > 0, got {page_size}")


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _group(slots: Sequence[int], per_chunk: int) -> list[tuple[int, int, int]]:
    """Sorted ``(chunk_no, start, count)`` runs of the given slot ids."""
    ordered = sorted(slots)
    first, n = ordered[0], len(ordered)
    if first % per_chunk + n <= per_chunk and ordered[-1] - first == n - 1:
        return [(first // per_chunk, first % per_chunk, n)]  # one run (distinct ids assumed)
    out: list[tuple[int, int, int]] = []
    for s in ordered:
        chunk_no, i = divmod(s, per_chunk)
        if out and out[-1][0] == chunk_no and out[-1][1] + out[-1][2] == i:
            out[-1] = (chunk_no, out[-1][1], out[-1][2] + 1)
        else:
            out.append((chunk_no, i, 1))
    return out
