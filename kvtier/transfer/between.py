"""Medium -> medium: a demotion between two slot media below the CPU with no route of their own.

Contract: ``MediumCopy`` reads a batch from the source medium into host bounce buffers (plain
CPU tensors, not the host arena: the CPU tier is full when pages walk further down) and writes
the pages read good to the destination; a page is True only when both its read and its write
succeeded (a bad read never reaches the destination). The source slots are never touched.
Runs on the shared lane below the CPU (``lane_of``) unless a registered route replaces it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvtier.transfer.base import Moves, TransferHandler

if TYPE_CHECKING:
    from kvtier.tiers.medium import SlotMedium


class MediumCopy(TransferHandler):
    """See the module docstring."""

    def __init__(self, src: SlotMedium, dst: SlotMedium) -> None:
        self._src, self._dst = src, dst

    def launch(self, batch: Moves) -> Callable[[], list[bool]]:
        size = batch.page_size
        bounce = torch.empty((len(batch), size), dtype=torch.uint8)
        pages = list(bounce.unbind(0))
        read = self._src.read(size, batch.srcs.tolist(), pages)

        def wait() -> list[bool]:
            ok = list(read.result())
            good = [i for i, g in enumerate(ok) if g]
            if not good:
                return ok
            dsts = batch.dsts.tolist()
            wrote = self._dst.write(size, [dsts[i] for i in good], [pages[i] for i in good])
            for i, w in zip(good, wrote.result(), strict=True):
                ok[i] = bool(w)
            return ok

        return wait

    def run(self, batch: Moves) -> list[bool]:
        return self.launch(batch)()
