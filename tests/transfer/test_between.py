"""Medium -> medium copies (``transfer/between.py``): the bytes arrive exact, the source is left
as it was, and a page that fails its read is never written below."""

from __future__ import annotations

import torch

from kvtier.transfer.base import Moves
from kvtier.transfer.between import MediumCopy
from kvtier.types import Direction
from tests.tiers.dict_medium import DictMedium

PAGE = 4096


def test_pages_read_from_one_medium_are_written_to_the_next_exact() -> None:
    src, dst = DictMedium(8 * PAGE), DictMedium(8 * PAGE)
    slots = src.alloc(PAGE, 3)
    assert slots is not None
    pages = [torch.full((PAGE,), v, dtype=torch.uint8) for v in (1, 2, 3)]
    src.write(PAGE, slots, pages).result()
    src.pages.pop((PAGE, int(slots[1])))  # its read fails
    before = dict(src.pages)
    dsts = dst.alloc(PAGE, 3)
    assert dsts is not None
    batch = Moves(Direction((2, 3)), PAGE, slots, dsts)
    assert MediumCopy(src, dst).run(batch) == [True, False, True]
    assert src.pages == before  # the source is untouched
    assert set(dst.pages) == {(PAGE, int(dsts[0])), (PAGE, int(dsts[2]))}
    assert dst.pages[(PAGE, int(dsts[0]))] == pages[0].numpy().tobytes()
    assert dst.pages[(PAGE, int(dsts[2]))] == pages[2].numpy().tobytes()
