"""StateStore on a real disk tier: each bucket's blob comes back exactly, in any order of use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.tiers.disk import DiskStore
from kvtier.training.states import StateStore

SIZES = [3 * 4096 + 100] * 7  # odd sizes, several pages each (page = 4 KiB below)


def store(tmp_path: Path, arena: Any) -> StateStore:
    disk = DiskStore(tmp_path / "states", 4 << 20, direct_io=True, io_threads=2)
    return StateStore(SIZES, arena, disk, page_bytes=4096)


def use(s: StateStore, order: list[int], rounds: int) -> None:
    """The optimizer's pattern: acquire, read ahead, check and rewrite the blob, release."""
    for r in range(rounds):
        for i in order:
            blob = s.acquire(i)
            s.prefetch_next(i)
            if r > 0:
                assert bool((blob == (i * 16 + r - 1) % 251).all()), f"bucket {i}, round {r}"
            blob.fill_((i * 16 + r) % 251)
            s.release(i, dirty=True)
    s.flush()


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 0],
                                   [1, 0, 3, 2, 6, 4, 5]], ids=["ascending", "backward", "mixed"])
def test_every_blob_comes_back_in_any_order(tmp_path: Path, arena: Any, order: list[int]) -> None:
    s = store(tmp_path, arena)
    try:
        use(s, order, rounds=4)
        assert s.bytes_read > 0
    finally:
        s.close()


def test_alternating_directions_like_backward_then_checkpoint(tmp_path: Path, arena: Any) -> None:
    s = store(tmp_path, arena)
    try:
        for r, order in enumerate([list(range(7)), list(range(6, -1, -1))] * 2):
            for i in order:
                blob = s.acquire(i)
                s.prefetch_next(i)
                if r > 0:
                    assert bool((blob == r - 1).all()), f"bucket {i}, pass {r}"
                blob.fill_(r)
                s.release(i, dirty=True)
        s.flush()
        assert bool((s.acquire(3) == 3).all())
        assert torch.equal(s.acquire(3)[:10], torch.full((10,), 3, dtype=torch.uint8))
    finally:
        s.close()
