"""A borrowed prefix copied into a static KV buffer layer group by layer group.

A page holds one block across all layers (``KVLayout``: ``[layers, 2, kv_heads, block, dim]``),
so layer group ``g`` of every page is one contiguous byte range of it. :class:`GroupCopier`
copies a prefix lent in place by the engine (``engine.borrow``) group by group: for each group,
one 2-D DMA per block from the pinned page straight into ``kv`` (each (layer, k|v, head) piece
a row; ``kvtier.transfer.dma``), all on a copy stream, with an event after each group. Without
the CUDA runtime's copies (or with a non-contiguous ``kv``): one DMA per block into device
staging, then one permuting copy into ``kv[layers of g, :, :, :T]``. The
caller's stream waits on group ``g``'s event just before the layers of ``g`` run
(:meth:`LayeredRestore.wait`), so group ``g + 1`` moves while group ``g`` computes, and no
host thread waits for a copy. On CPU (or ``device`` without CUDA) the copies run at once.

- ``GroupCopier(layout, device).start(kv, views, bounds, release) -> LayeredRestore``: ``views``
  are the borrowed pages (``page_size`` bytes each, key order), ``bounds`` the layer groups
  (``0 = b0 < b1 < ... = layers``), ``release`` returns the pages to the engine.
- ``LayeredRestore``: ``tokens`` restored; ``wait(g)`` (the current stream waits for group
  ``g``), ``wait_all()``; ``release()`` (waits on the host for the last copy, then returns the
  pages; idempotent). ``LayeredRestore.done(tokens)``: one that copied through another path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext, suppress
from itertools import pairwise

import torch

from kvtier.errors import InvalidArgument
from kvtier.transfer import dma

from .layout import KVLayout


def check_bounds(bounds: Sequence[int], layers: int) -> list[int]:
    """``bounds`` as a list if they cut ``layers`` layers into groups, else InvalidArgument."""
    b = list(bounds)
    if len(b) < 2 or b[0] != 0 or b[-1] != layers or any(x >= y for x, y in pairwise(b)):
        raise InvalidArgument("bounds", f"need 0 = b0 < b1 < ... = {layers} layers, got {b}")
    return b


class LayeredRestore:
    """See the module docstring."""

    def __init__(self, tokens: int, events: list[torch.cuda.Event] | None = None,
                 release: Callable[[], None] | None = None) -> None:
        self.tokens = tokens
        self._events = events or []
        self._release = release

    @classmethod
    def done(cls, tokens: int) -> LayeredRestore:
        return cls(tokens)

    def wait(self, g: int) -> None:
        """The current stream runs what it is given next after group ``g`` has landed."""
        if g < len(self._events):
            torch.cuda.current_stream().wait_event(self._events[g])

    def wait_all(self) -> None:
        if self._events:
            torch.cuda.current_stream().wait_event(self._events[-1])

    def release(self) -> None:
        done, self._release = self._release, None
        if done is None:
            return
        try:
            if self._events:
                self._events[-1].synchronize()
        finally:
            done()

    def __del__(self) -> None:
        # A restore dropped without ``release`` must not keep the engine's pages protected.
        with suppress(Exception):
            self.release()


class GroupCopier:
    """See the module docstring."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout, self.device = layout, device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._staging: torch.Tensor | None = None  # [blocks, raw_bytes] on the device
        # Pinned pages straight into the buffer with 2-D DMAs where the CUDA runtime is found;
        # else DMA into staging, then one permuting copy per group.
        self._dma = dma.runtime() if self._cuda else None
        self.direct = self._dma is not None

    def _staged(self, n: int) -> torch.Tensor:
        raw = self.layout.raw_bytes
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = torch.empty(n, raw, dtype=torch.uint8, device=self.device)
        return self._staging

    def start(self, kv: torch.Tensor, views: Sequence[torch.Tensor], bounds: Sequence[int],
              release: Callable[[], None]) -> LayeredRestore:
        lay = self.layout
        b = check_bounds(bounds, lay.layers)
        n = len(views)
        if not n:
            release()
            return LayeredRestore(0)
        per_layer = lay.raw_bytes // lay.layers
        try:
            # Straight into kv where its rows are where the 2-D DMAs put them; else staged.
            staging = None if self.direct and kv.is_contiguous() else self._staged(n)
            events: list[torch.cuda.Event] = []
            if self._stream is not None:  # after what the caller queued on kv so far
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                for lo, hi in pairwise(b):
                    self._copy_group(kv, views, staging, lo, hi, per_layer)
                    if self._stream is not None:
                        events.append(torch.cuda.Event())
                        events[-1].record(self._stream)
        except BaseException:
            if self._stream is not None:
                self._stream.synchronize()
            release()
            raise
        return LayeredRestore(n * lay.block_size, events, release)

    def _copy_direct(self, kv: torch.Tensor, views: Sequence[torch.Tensor], lo: int,
                     hi: int) -> None:
        """Per block, one 2-D DMA of layers ``[lo, hi)`` straight into ``kv``: each (layer,
        k|v, head) piece of the page is a row, landing at its place in ``kv``'s own rows."""
        lay, rt, stream = self.layout, self._dma, self._stream
        assert rt is not None and stream is not None
        row = lay.block_size * lay.head_dim * kv.element_size()  # one piece of a page
        pitch = kv.shape[3] * lay.head_dim * kv.element_size()  # kv's (layer, k|v, head) rows
        rows = 2 * lay.kv_heads  # rows per layer
        dst = kv.data_ptr() + lo * rows * pitch
        for j, view in enumerate(views):
            rt.copy_2d(dst + j * row, pitch, view.data_ptr() + lo * rows * row, row, row,
                       (hi - lo) * rows, stream)

    def _copy_group(self, kv: torch.Tensor, views: Sequence[torch.Tensor],
                    staging: torch.Tensor | None, lo: int, hi: int, per_layer: int) -> None:
        if staging is None:
            self._copy_direct(kv, views, lo, hi)
            return
        lay, n = self.layout, len(views)
        a, z = lo * per_layer, hi * per_layer
        part = staging[:n, a:z]
        for j, view in enumerate(views):  # one DMA per block (pinned source: asynchronous)
            part[j].copy_(view[a:z], non_blocking=True)
        src = part.view(lay.dtype).reshape(
            n, hi - lo, 2, lay.kv_heads, lay.block_size, lay.head_dim)
        dst = kv[lo:hi, :, :, : n * lay.block_size].unflatten(3, (n, lay.block_size))
        dst.copy_(src.permute(1, 2, 3, 0, 4, 5), non_blocking=True)

