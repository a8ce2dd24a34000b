"""The pinned host tier: exact-size page-aligned chunks, lazily created, one slab per page size.

Contract (see ``kvtier.tiers.base``): ``HostArena(budget_bytes, chunk_bytes, pin)``.
    * A chunk is one ``mmap`` of ``per_chunk * page_size`` bytes (``per_chunk = chunk_bytes //
      page_size``, at least 1), so it is page-aligned and exactly sized; it is pinned with
      ``cudaHostRegister`` only when ``pin`` is set and CUDA is available. Chunks are created on
      demand and ``reserved_bytes`` never exceeds ``budget_bytes``.
    * ``alloc(page_size, n)`` is all or nothing. It picks the smallest free run that holds all
      ``n`` slots (best fit), else a fresh chunk, else the fewest, largest runs.
      ``alloc_array`` returns the same slots as an ``int64`` array.
    * ``free``/``free_array`` return slots (any order); a repeated, negative or unknown-chunk slot
      asserts before anything changes, a slot that is already free asserts in ``RunSet.add``.
    * ``runs``/``runs_array`` group slots, in the given order, into runs of consecutive ids in
      one chunk: a 2-D view per run plus its positions (a ``range`` / ``lo, hi``). The array
      versions do one numpy pass per batch and Python work per run only, never per slot.
    * A chunk that becomes entirely free stays mapped and pinned (pinning costs far more than
      the copies it serves); such spare chunks are released as soon as another page size or a
      pooled buffer needs their budget. ``chunks_in_use(exclude)`` lists the other sizes' chunks
      by how many slots are in use, for a caller that empties one to free its budget.
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

import numpy as np
import torch

from kvtier.errors import InvalidArgument
from kvtier.tiers.base import HostSlot
from kvtier.tiers.runs import RunSet, as_slots, free_runs, run_bounds, strictly_ascending

_NO_SLOTS = np.empty(0, dtype=np.int64)
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
        spans = self._take_spans(page_size, n)
        if spans is None:
            return None
        out: list[int] = []
        for first, k in spans:
            out.extend(range(first, first + k))
        return cast("list[HostSlot]", out)  # HostSlot is an int at run time

    def alloc_array(self, page_size: int, n: int) -> np.ndarray | None:
        """``alloc`` as an ``int64`` array: the same slots, in the same order."""
        spans = self._take_spans(page_size, n)
        if spans is None:
            return None
        parts = [np.arange(first, first + k, dtype=np.int64) for first, k in spans]
        return parts[0] if len(parts) == 1 else np.concatenate([_NO_SLOTS, *parts])

    def free(self, page_size: int, slots: Sequence[int]) -> None:
        """Return slots. Freeing a free or unknown slot is an internal error (assert)."""
        if len(slots) != 0:
            self.free_array(page_size, as_slots(slots))

    def free_array(self, page_size: int, slots: np.ndarray) -> None:
        """Return an ``int64`` array of slots (any order).

        A repeated, negative or unknown-chunk slot is an internal error (assert) found before
        anything changes; a slot that is already free asserts in ``RunSet.add``.
        """
        if len(slots) == 0:
            return
        slots = np.asarray(slots, dtype=np.int64)
        with self._lock:
            slab = self._slabs[page_size]
            chunk_nos, starts, counts = free_runs(slots, slab.per_chunk)
            unknown = set(chunk_nos).difference(slab.chunks)
            assert not unknown, f"slots of unknown chunks {sorted(unknown)}"
            for chunk_no, start, k in zip(chunk_nos, starts, counts, strict=True):
                slab.free[chunk_no].add(start, k)
            slab.used -= len(slots)
            for chunk_no in sorted(set(chunk_nos)):
                if slab.free[chunk_no].total == slab.per_chunk:
                    self._maybe_release(slab, chunk_no)

    def rows(self, page_size: int, slots: Sequence[int]) -> list[torch.Tensor]:
        """1-D ``uint8`` views, one per slot, in order."""
        if len(slots) == 0:
            return []
        slab = self._slabs[page_size]
        out = []
        for s in slots:
            chunk_no, i = divmod(int(s), slab.per_chunk)
            out.append(slab.chunks[chunk_no].tensor[i * page_size : (i + 1) * page_size])
        return out

    def runs(self, page_size: int, slots: Sequence[int]) -> list[tuple[torch.Tensor, range]]:
        """``runs_array`` with each run's positions as a ``range``."""
        if len(slots) == 0:
            return []
        found = self.runs_array(page_size, as_slots(slots))
        return [(view, range(lo, hi)) for view, lo, hi in found]

    def runs_array(self, page_size: int, slots: np.ndarray) -> list[tuple[torch.Tensor, int, int]]:
        """Group ``slots`` (in the given order) into contiguous runs.

        Each run is a 2-D view ``[hi - lo, page_size]`` of the chunk memory holding
        ``slots[lo:hi]``. Consecutive entries join a run when their ids are consecutive in one
        chunk; the runs cover every position once, in order.
        """
        if len(slots) == 0:
            return []
        slots = np.asarray(slots, dtype=np.int64)
        slab = self._slabs[page_size]
        per, n = slab.per_chunk, len(slots)
        chunk_no, start = divmod(int(slots[0]), per)
        if start + n <= per and _ascends_by_one(slots):
            # The common case (slots allocated as one run): a single view.
            return [(self._view(slab, chunk_no, start, n), 0, n)]
        lo, hi = run_bounds(slots, per)
        firsts = slots[lo]
        chunks, starts = (firsts // per).tolist(), (firsts % per).tolist()
        return [
            (self._view(slab, c, i, b - a), a, b)
            for c, i, a, b in zip(chunks, starts, lo.tolist(), hi.tolist(), strict=True)
        ]

    def run_addresses(self, page_size: int, slots: np.ndarray) -> list[tuple[int, int, int]]:
        """``runs_array`` as ``(address of the run's first byte, lo, hi)``: no tensor views
        (for copies queued by address, ``kvtier.transfer.dma``)."""
        if len(slots) == 0:
            return []
        slots = np.asarray(slots, dtype=np.int64)
        slab = self._slabs[page_size]
        per, ps = slab.per_chunk, page_size
        n = len(slots)
        chunk_no, start = divmod(int(slots[0]), per)
        if start + n <= per and _ascends_by_one(slots):  # one run, as in ``runs_array``
            return [(slab.chunks[chunk_no].tensor.data_ptr() + start * ps, 0, n)]
        lo, hi = run_bounds(slots, per)
        firsts = slots[lo].tolist()
        chunks = slab.chunks
        return [
            (chunks[f // per].tensor.data_ptr() + (f % per) * ps, a, b)
            for f, a, b in zip(firsts, lo.tolist(), hi.tolist(), strict=True)
        ]

    def _take_spans(self, page_size: int, n: int) -> list[tuple[int, int]] | None:
        """Allocate ``n`` slots as ``(first id, count)`` spans, or ``None`` (nothing changed).

        The one place ``alloc`` and ``alloc_array`` allocate.
        """
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
            spans: list[tuple[int, int]] = []
            for chunk_no, start, k in runs:
                if chunk_no < 0:
                    chunk_no = self._new_chunk(slab)
                slab.free[chunk_no].take(start, k)
                spans.append((chunk_no * slab.per_chunk + start, k))
            slab.used += n
            return spans

    def chunks_in_use(self, exclude: int) -> list[tuple[int, int, int, int]]:
        """``(page_size, first slot, slots, slots in use)`` of every chunk of the other page
        sizes that has slots in use, fewest in use first: what to empty when ``exclude`` finds
        the budget taken (an emptied chunk is spare, released for another size)."""
        with self._lock:
            out = [(s.per_chunk - rs.total, size, no * s.per_chunk, s.per_chunk)
                   for size, s in self._slabs.items() if size != exclude
                   for no, rs in s.free.items() if rs.total < s.per_chunk]
        return [(size, first, per, used) for used, size, first, per in sorted(out)]

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
    @staticmethod
    def _view(slab: _Slab, chunk_no: int, start: int, k: int) -> torch.Tensor:
        """Slots ``start .. start + k`` of one chunk as a ``[k, page_size]`` view."""
        ps, flat = slab.page_size, slab.chunks[chunk_no].tensor
        # One as_strided call: about half the cost of a slice plus a view, paid once per run.
        return flat.as_strided((k, ps), (ps, 1), flat.storage_offset() + start * ps)

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


def _ascends_by_one(slots: np.ndarray) -> bool:
    """True if ``slots`` (non-empty) is ``first, first + 1, ...``: the ends span exactly
    ``n - 1`` and every step goes up (one comparison pass, no difference array)."""
    n = len(slots)
    if int(slots[-1]) - int(slots[0]) != n - 1:
        return False
    return strictly_ascending(slots)
