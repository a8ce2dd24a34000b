"""The one row copy (``kvtier.transfer.gather``): mapped pages equal, the rest untouched."""

from __future__ import annotations

import pytest
import torch

from kvtier.transfer.gather import gather, page, put_page, scatter


def _segments(widths: list[int], rows: int = 6) -> list[torch.Tensor]:
    """Segments with a row stride wider than the row (as vLLM's K/V views have)."""
    segs = []
    for k, w in enumerate(widths):
        base = torch.randint(0, 256, (rows, w + 8), dtype=torch.uint8)
        base[:, w:] = k  # padding a copy must never read into a page
        segs.append(base[:, :w])
    return segs


def _page(segs: list[torch.Tensor], slot: int) -> torch.Tensor:
    return torch.cat([s[slot] for s in segs])


@pytest.mark.parametrize("widths", [[64], [24], [16, 40, 8], [3, 5]])
def test_gather_and_page_read_exactly_the_rows(widths: list[int]) -> None:
    segs = _segments(widths)
    before = [s.clone() for s in segs]
    idx = torch.tensor([4, 0, 2])
    out = torch.empty(3, sum(widths), dtype=torch.uint8)
    gather(segs, idx, out)
    for j, slot in enumerate(idx.tolist()):
        assert torch.equal(out[j], _page(segs, slot))
        assert torch.equal(page(segs, slot), _page(segs, slot))
    assert all(torch.equal(a, b) for a, b in zip(segs, before, strict=True))  # source unchanged


@pytest.mark.parametrize("widths", [[64], [24], [16, 40, 8], [3, 5]])
def test_scatter_and_put_page_write_only_their_rows(widths: list[int]) -> None:
    segs = _segments(widths)
    before = [s.clone() for s in segs]
    src = torch.randint(0, 256, (2, sum(widths)), dtype=torch.uint8)
    scatter(segs, torch.tensor([3, 1]), src)
    one = torch.randint(0, 256, (sum(widths),), dtype=torch.uint8)
    put_page(segs, 5, one)
    assert torch.equal(_page(segs, 3), src[0]) and torch.equal(_page(segs, 1), src[1])
    assert torch.equal(_page(segs, 5), one)
    for slot in (0, 2, 4):  # unmapped pages untouched
        assert torch.equal(_page(segs, slot), _page(before, slot))
