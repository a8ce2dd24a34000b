"""Segment-table gather/scatter: every engine layout's pages, exact bytes, nothing else touched.

CPU runs the per-segment path over the same table (offsets, widths, units); ``cuda`` tests run
the one-launch kernel against the same expectations.
"""

from __future__ import annotations

import pytest
import torch
from kvtier.client.block_rows import block_segments

from kvtier.transfer.segtable import SegmentTable

BLOCKS = 12


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * dtype.itemsize,),
                        dtype=torch.uint8)
    return raw.view(dtype).view(shape).to(device)


def layouts(device: str) -> dict[str, list[torch.Tensor]]:
    """Per-layer KV tensors of engine layouts, as kvtier segments (as the connector makes them)."""
    flash = [_random((2, BLOCKS, 4, 2, 8), torch.bfloat16, device) for _ in range(3)]
    flashinfer = [_random((BLOCKS, 2, 4, 2, 8), torch.float16, device) for _ in range(2)]
    mla = [_random((BLOCKS, 4, 18), torch.bfloat16, device) for _ in range(3)]
    cpu_attn = [_random((2, BLOCKS, 2, 4, 8), torch.float32, device) for _ in range(2)]
    odd = _random((BLOCKS, 40), torch.uint8, device)  # rows strided, widths of odd bytes
    return {
        "flash": [s for t in flash for s in block_segments(t, BLOCKS)],
        "flashinfer": [s for t in flashinfer for s in block_segments(t, BLOCKS)],
        "mla": [s for t in mla for s in block_segments(t, BLOCKS)],
        "cpu_attn": [s for t in cpu_attn for s in block_segments(t, BLOCKS)],
        "odd": [odd[:, 0:7], odd[:, 11:24], odd[:, 30:33]],
    }


def page(segments: list[torch.Tensor], i: int) -> torch.Tensor:
    return torch.cat([s[i] for s in segments])


def check_gather_scatter(segments: list[torch.Tensor], device: str) -> SegmentTable:
    table = SegmentTable(segments)
    idx = torch.tensor([9, 0, 4, 11, 5], dtype=torch.long, device=device)
    before = [page(segments, i).clone() for i in range(BLOCKS)]
    out = torch.zeros(len(idx), table.page_size, dtype=torch.uint8, device=device)
    table.gather(idx, out)
    for j, i in enumerate(idx.tolist()):
        assert torch.equal(out[j], before[i]), f"gathered page {i} differs"
    assert all(torch.equal(page(segments, i), before[i]) for i in range(BLOCKS)), "source moved"
    # scatter new bytes into other pages; the rest keep theirs
    src = _random((3, table.page_size), torch.uint8, device)
    into = torch.tensor([2, 7, 10], dtype=torch.long, device=device)
    table.scatter(into, src)
    for i in range(BLOCKS):
        want = src[into.tolist().index(i)] if i in into.tolist() else before[i]
        assert torch.equal(page(segments, i), want), f"page {i} wrong after scatter"
    return table


@pytest.mark.parametrize("name", ["flash", "flashinfer", "mla", "cpu_attn", "odd"])
def test_gather_scatter_every_layout_cpu(name: str) -> None:
    table = check_gather_scatter(layouts("cpu")[name], "cpu")
    assert not table.kernel  # CPU: the per-segment path over the same table


def test_units_follow_alignment() -> None:
    segs = layouts("cpu")
    assert SegmentTable(segs["flash"]).unit == 8
    assert SegmentTable(segs["odd"]).unit == 1
    table = SegmentTable(segs["mla"])  # 4 x 18 bf16 = 144-byte pieces
    assert table.page_size == 3 * 144 and table.offsets == [0, 18, 36]


def test_table_keeps_memory_alive() -> None:
    segs = layouts("cpu")["flash"]
    expected = page(segs, 3).clone()
    table = SegmentTable(segs)
    del segs
    out = torch.empty(1, table.page_size, dtype=torch.uint8)
    table.gather(torch.tensor([3]), out)
    assert torch.equal(out[0], expected)


def test_empty_batch_touches_nothing() -> None:
    segs = layouts("cpu")["flash"]
    before = [s.clone() for s in segs]
    table = SegmentTable(segs)
    none = torch.empty(0, dtype=torch.long)
    table.gather(none, torch.empty(0, table.page_size, dtype=torch.uint8))
    table.scatter(none, torch.empty(0, table.page_size, dtype=torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(segs, before, strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["flash", "flashinfer", "mla", "cpu_attn", "odd"])
def test_gather_scatter_every_layout_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    table = check_gather_scatter(layouts("cuda")[name], "cuda")
    torch.cuda.synchronize()
    assert table.kernel, "the one-launch kernel fell back to the per-segment path"
