"""The segment-table gather and scatter kernels (Triton), for ``segtable.py``.

Per program: page ``j`` (grid dim 0), segment ``s`` (dim 1), a ``BLOCK`` of units of its piece
(dim 2). ``table`` is int64 ``[segments, 4]``: address (bytes), row stride, width and offset in
the page (units); ``idx`` int64 page rows; ``out``/``src`` the staging rows, typed in units.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gather_kernel(table, idx, out, page_units, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    s = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(idx + j)
    addr = tl.load(table + s * 4)
    stride = tl.load(table + s * 4 + 1)
    width = tl.load(table + s * 4 + 2)
    offset = tl.load(table + s * 4 + 3)
    src = addr.to(out.dtype) + row * stride
    mask = cols < width
    data = tl.load(src + cols, mask=mask)
    tl.store(out + j.to(tl.int64) * page_units + offset + cols, data, mask=mask)


@triton.jit
def _scatter_kernel(table, idx, src, page_units, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    s = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(idx + j)
    addr = tl.load(table + s * 4)
    stride = tl.load(table + s * 4 + 1)
    width = tl.load(table + s * 4 + 2)
    offset = tl.load(table + s * 4 + 3)
    dst = addr.to(src.dtype) + row * stride
    mask = cols < width
    data = tl.load(src + j.to(tl.int64) * page_units + offset + cols, mask=mask)
    tl.store(dst + cols, data, mask=mask)


GATHER = _gather_kernel
SCATTER = _scatter_kernel
