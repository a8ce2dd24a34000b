"""Row gather/scatter across a pool's segments (page ``i`` = row ``i`` of every segment, joined).

One ``index_select`` (gather) or ``index_copy_`` (scatter) per segment, whatever the number
of pages: the CPU-mode copies of one-segment pools, and ``DevicePool.gather_rows`` /
``scatter_rows``. Pools of several segments go through ``segtable.py`` in the transfer handlers
(one launch for all segments on CUDA). ``page``/``put_page`` copy one page (no index tensor:
the engine's ``read``/``write``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def wide(t: torch.Tensor) -> torch.Tensor:
    """View uint8 rows as int64 when layout allows: 8x fewer elements for the copy kernels."""
    aligned = t.shape[-1] % 8 == 0 and t.stride(-1) == 1 and t.storage_offset() % 8 == 0
    if aligned and all(s % 8 == 0 for s in t.stride()[:-1]):
        return t.view(torch.int64)
    return t


def gather(segments: Sequence[torch.Tensor], idx: torch.Tensor, out: torch.Tensor) -> None:
    """``out[j] = page(idx[j])``; ``out`` is ``[len(idx), page_size]`` and contiguous."""
    if len(segments) == 1:
        seg, dst = wide(segments[0]), wide(out)
        if seg.dtype == dst.dtype:
            torch.index_select(seg, 0, idx, out=dst)
            return
    off = 0
    for seg in segments:
        width = seg.shape[1]
        part = out[:, off : off + width]
        wp = wide(part)
        ws = wide(seg)
        if ws.dtype == wp.dtype:
            wp.copy_(ws.index_select(0, idx))
        else:
            part.copy_(seg.index_select(0, idx))
        off += width


def scatter(segments: Sequence[torch.Tensor], idx: torch.Tensor, src: torch.Tensor) -> None:
    """``page(idx[j]) = src[j]``; rows of ``segments`` not in ``idx`` are untouched."""
    off = 0
    for seg in segments:
        width = seg.shape[1]
        part = src if len(segments) == 1 else src[:, off : off + width]
        ws, wp = wide(seg), wide(part)
        if ws.dtype == wp.dtype:
            ws.index_copy_(0, idx, wp)
        else:
            seg.index_copy_(0, idx, part)
        off += width


def page(segments: Sequence[torch.Tensor], slot: int) -> torch.Tensor:
    """A new ``[page_size]`` tensor holding page ``slot``, on the segments' device."""
    return torch.cat([seg[slot] for seg in segments])


def put_page(segments: Sequence[torch.Tensor], slot: int, flat: torch.Tensor) -> None:
    """Page ``slot`` = ``flat`` (``page_size`` bytes, any device); other pages untouched."""
    off = 0
    for seg in segments:
        width = seg.shape[1]
        seg[slot].copy_(flat[off : off + width])
        off += width
