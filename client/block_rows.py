"""Engine-owned KV tensors seen as kvtier pages: one vLLM block across all layers = one page.

Primitives (no vLLM import; unit-testable on plain tensors):

- :func:`block_segments` — split one layer's KV tensor into ``[num_blocks, row_bytes]`` uint8
  views (one per leading K/V index when the block dim is not first). Requires each block's bytes
  within a layer to be contiguous, which holds for every paged layout vLLM uses.
- :class:`BlockRows` — the segments of all layers with ``gather(block_ids) -> [n, page_bytes]``
  and ``scatter(block_ids, rows, segments=None)``: the copy path used when the daemon can't map
  vLLM's memory; ``segments`` (a range of segment indices, e.g. one layer's) scatters only those
  segments' columns of ``rows`` (segment ``i`` is columns ``offsets[i] : offsets[i] + widths[i]``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvtier.transfer.gather import scatter
from kvtier.transfer.segtable import SegmentTable


def block_segments(t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """``[num_blocks, row_bytes]`` uint8 views of ``t`` whose row ``i`` is block ``i``'s bytes.

    The block dim is the first dim of size ``num_blocks`` at index 0 or 1; dims before it become
    separate segments. Raises ``ValueError`` for layouts where a block is not contiguous.
    """
    dims = [d for d in (0, 1) if d < t.dim() and t.shape[d] == num_blocks]
    if not dims:
        raise ValueError(
            f"no block dim of size {num_blocks} in KV tensor of shape {tuple(t.shape)}")
    d = dims[0]
    out = []
    for idx in itertools.product(*(range(n) for n in t.shape[:d])):
        sub = t[idx] if idx else t
        block = sub[0]
        if not block.is_contiguous():
            raise ValueError(f"KV blocks of shape {tuple(t.shape)} are not contiguous per block")
        elem = t.element_size()
        row_bytes = block.numel() * elem
        flat = sub.view(-1).view(torch.uint8) if sub.is_contiguous() else _bytes_of(sub)
        out.append(flat.as_strided((num_blocks, row_bytes), (sub.stride(0) * elem, 1),
                                   flat.storage_offset()))
    return out


def _bytes_of(sub: torch.Tensor) -> torch.Tensor:
    """A uint8 view starting at ``sub``'s first byte (for block-strided, non-contiguous views)."""
    storage = sub.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device=sub.device).set_(storage)
    return base[sub.storage_offset() * sub.element_size():]


class BlockRows:
    """All layers' segments of one engine, addressed by block id.

    The copies are the engine's (``kvtier.transfer``): whole pages through one
    ``SegmentTable`` (one launch for all segments on CUDA), some segments (a layer) through
    ``gather.scatter`` on views of the source rows (no copy of them first).
    """

    def __init__(self, segments: Sequence[torch.Tensor]) -> None:
        if not segments:
            raise ValueError("no KV segments")
        self.segments = list(segments)
        self.num_blocks = self.segments[0].shape[0]
        self.widths = [s.shape[1] for s in self.segments]
        self.offsets = [sum(self.widths[:i]) for i in range(len(self.widths))]
        self.page_bytes = sum(self.widths)
        self.device = self.segments[0].device
        self._table = SegmentTable(self.segments)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = list(block_ids)
        if ids and not 0 <= min(ids) <= max(ids) < self.num_blocks:
            raise ValueError(f"block ids outside [0, {self.num_blocks}): {min(ids)}..{max(ids)}")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the blocks' bytes into ``out[:len(block_ids), :page_bytes]``."""
        n = len(block_ids)
        idx = self._index(block_ids)
        dst = out[:n]
        exact = dst.shape[1] == self.page_bytes and dst.is_contiguous()
        if exact and dst.device == self.device and dst.dtype == torch.uint8:
            self._table.gather(idx, dst)
            return
        tmp = torch.empty(n, self.page_bytes, dtype=torch.uint8, device=self.device)
        self._table.gather(idx, tmp)
        dst[:, : self.page_bytes].copy_(tmp)

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor,
                segments: range | None = None) -> None:
        """Copy ``rows[i, :page_bytes]`` into block ``block_ids[i]`` of every layer (of the
        ``segments`` given, else of all)."""
        idx = self._index(block_ids)
        src = rows.to(self.device)
        if segments is None or len(segments) == len(self.segments):
            src = src[:, : self.page_bytes]
            if src.is_contiguous():
                self._table.scatter(idx, src)
                return
            segments = range(len(self.segments))
        first, last = segments[0], segments[-1]
        span = src[:, self.offsets[first] : self.offsets[last] + self.widths[last]]
        scatter(self.segments[first : last + 1], idx, span)
