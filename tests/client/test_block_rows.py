"""BlockRows over vLLM-layout tensors: whole pages and single layers, exact bytes, checked ids."""

from __future__ import annotations

import pytest
import torch
from kvtier.client.block_rows import BlockRows, block_segments


def layers(seed: int, n: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)  # flash-attn layout: [2, blocks, 4, heads, dim]
    return [torch.randn(2, n, 4, 2, 8, generator=g).to(torch.bfloat16) for _ in range(3)]


def rows_of(ts: list[torch.Tensor]) -> BlockRows:
    return BlockRows([s for t in ts for s in block_segments(t, ts[0].shape[1])])


def test_gather_then_scatter_moves_exact_pages() -> None:
    src, dst = layers(0), layers(1)
    a, b = rows_of(src), rows_of(dst)
    wide = torch.full((3, a.page_bytes + 100), 7, dtype=torch.uint8)  # a padded staging row
    a.gather([4, 0, 9], wide)
    assert (wide[:, a.page_bytes :] == 7).all()  # padding untouched
    untouched = [t.clone() for t in dst]
    b.scatter([1, 2, 3], wide)
    for s, d, u in zip(src, dst, untouched, strict=True):
        assert torch.equal(d[:, 1:4], s[:, [4, 0, 9]])
        assert torch.equal(d[:, 4:], u[:, 4:]) and torch.equal(d[:, 0], u[:, 0])


def test_scatter_of_one_layer_leaves_the_others() -> None:
    src, dst = layers(2), layers(3)
    a, b = rows_of(src), rows_of(dst)
    page = torch.empty(2, a.page_bytes, dtype=torch.uint8)
    a.gather([5, 6], page)
    before = [t.clone() for t in dst]
    b.scatter([0, 1], page, range(2, 4))  # layer 1: its K and V segments
    assert torch.equal(dst[1][:, 0:2], src[1][:, 5:7])
    assert torch.equal(dst[0], before[0]) and torch.equal(dst[2], before[2])


def test_block_ids_outside_the_cache_are_refused() -> None:
    r = rows_of(layers(4))
    out = torch.empty(1, r.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block ids outside"):
        r.gather([10], out)
    with pytest.raises(ValueError, match="block ids outside"):
        r.scatter([-1], out)
