"""Gather/scatter of multi-segment pages through one segment table: one kernel per batch.

A registered pool (vLLM's KV tensors) has one segment per layer (or per layer and K/V): page
``i`` is row ``i`` of every segment, joined. Copying a batch segment by segment costs two kernels
per segment (64 for a 32-layer model) whatever the batch; this copies all segments of all pages
of a batch in one launch.

Contract:
    * ``SegmentTable(segments)`` describes a pool's segments once: per segment its address, row
      stride, width and offset in the page, in *units* (the widest of 8/4/2/1 bytes dividing
      every address, stride and width). It keeps the segment tensors alive: its addresses stay
      valid as long as the table exists, also after the pool is closed.
    * ``gather(idx, out)``: ``out[j] = page(idx[j])``; ``out`` is ``[len(idx), page_size]``
      ``uint8`` and contiguous, on the pool's device. ``scatter(idx, src)``: ``page(idx[j]) =
      src[j]``; pages not in ``idx`` are untouched; ``idx`` must be distinct. ``idx`` is an
      ``int64`` tensor on the pool's device whose values the caller has checked (< num_slots):
      the kernel trusts them.
    * Both run on the current stream and allocate nothing on CUDA. On CUDA with Triton: one
      kernel (``_segkernels.py``, imported on the first launch), grid (page, segment, chunk of a
      piece). Without Triton, or on CPU: the same bytes
      per segment, using the same table's offsets and widths (``kernel`` says which ran).
"""

from __future__ import annotations

import importlib.util
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

_UNITS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
_MAX_GRID_YZ = 65535  # CUDA's limit on the grid's second and third dimensions
_MAX_BLOCK = 1024  # units one program copies (8 KiB of int64: a 32 KiB piece is four programs)

# Triton ships with CUDA builds of torch; CPU builds run the per-segment path. The kernels'
# module is imported on the first CUDA launch, not here (importing Triton takes a while).
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _unit(segments: Sequence[torch.Tensor]) -> tuple[int, torch.dtype]:
    """The widest word dividing every segment's address, row stride and width."""
    for size, dtype in _UNITS:
        if all(
            s.data_ptr() % size == 0 and s.stride(0) % size == 0 and s.shape[1] % size == 0
            for s in segments
        ):
            return size, dtype
    raise AssertionError("unreachable: one byte divides everything")


class SegmentTable:
    """See the module docstring."""

    def __init__(self, segments: Sequence[torch.Tensor]) -> None:
        self.segments = list(segments)  # holds the memory the addresses point at
        self.unit, self.dtype = _unit(self.segments)
        u = self.unit
        self.widths = [s.shape[1] // u for s in self.segments]
        self.offsets = [sum(self.widths[:i]) for i in range(len(self.widths))]
        self.page_units = sum(self.widths)
        self.page_size = self.page_units * u
        device = self.segments[0].device
        rows = [
            (s.data_ptr(), s.stride(0) // u, w, o)
            for s, w, o in zip(self.segments, self.widths, self.offsets, strict=True)
        ]
        self._table = torch.tensor(rows, dtype=torch.int64).to(device)
        widest = max(self.widths)
        self._block = min(_MAX_BLOCK, 1 << (widest - 1).bit_length())  # a power of two
        chunks = -(-widest // _MAX_BLOCK)
        self.kernel = (
            HAVE_TRITON
            and device.type == "cuda"
            and len(self.segments) <= _MAX_GRID_YZ
            and chunks <= _MAX_GRID_YZ
        )
        self._chunks = chunks

    def _units(self, pages: torch.Tensor) -> torch.Tensor:
        assert pages.dim() == 2 and pages.shape[1] == self.page_size and pages.is_contiguous()
        return pages.view(self.dtype)

    def gather(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        words = self._units(out)
        if not len(idx):
            return
        if self.kernel and self._launch("gather", idx, words):
            return
        for seg, w, o in self._pieces():
            words[:, o : o + w] = seg.index_select(0, idx)

    def scatter(self, idx: torch.Tensor, src: torch.Tensor) -> None:
        words = self._units(src)
        if not len(idx):
            return
        if self.kernel and self._launch("scatter", idx, words):
            return
        for seg, w, o in self._pieces():
            seg.index_copy_(0, idx, words[:, o : o + w])

    def _pieces(self) -> list[tuple[torch.Tensor, int, int]]:
        """Each segment as unit rows, with its width and offset in the page (the fallback)."""
        u = self.unit
        views = [s.view(self.dtype) if u > 1 else s for s in self.segments]
        return list(zip(views, self.widths, self.offsets, strict=True))

    def _launch(self, name: str, idx: torch.Tensor, words: torch.Tensor) -> bool:
        """One launch for the batch; False (and the per-segment path from then on) if the
        kernel can't be built here."""
        try:
            from kvtier.transfer import _segkernels

            kernel = _segkernels.GATHER if name == "gather" else _segkernels.SCATTER
            grid = (len(idx), len(self.segments), self._chunks)
            kernel[grid](self._table, idx, words, self.page_units, BLOCK=self._block)
            return True
        except Exception:  # a toolchain problem must not fail transfers: same bytes, slower
            log.exception("segment-table kernel unavailable; copying segment by segment")
            self.kernel = False
            return False


_Group = tuple[SegmentTable, tuple[int, int]]  # a layer group's table and its bytes in a page
GroupTables = weakref.WeakKeyDictionary[Any, dict[tuple[int, int], _Group]]


def group_table(cache: GroupTables, pool: Any, lo: int, hi: int) -> _Group:
    """The table of ``pool``'s segments ``[lo, hi)`` (a layer group) and their byte range in a
    page, built once per pool and group (``pool.segments``: the pool's segment tensors)."""
    per_pool = cache.setdefault(pool, {})
    found = per_pool.get((lo, hi))
    if found is None:
        segs = list(pool.segments)
        a = sum(s.shape[1] for s in segs[:lo])
        z = a + sum(s.shape[1] for s in segs[lo:hi])
        found = per_pool[(lo, hi)] = (SegmentTable(segs[lo:hi]), (a, z))
    return found
