"""kvtier/prefix/store.py primitives: how stores and loads are cut into chunks."""

from __future__ import annotations

from kvtier.prefix.store import FIRST_CHUNK, chunk_sizes


def test_chunks_start_small_grow_and_cover_every_block() -> None:
    page, batch = 256 << 10, 64 << 20  # 256 blocks a batch
    sizes = chunk_sizes(1024, page, batch)
    second = FIRST_CHUNK + FIRST_CHUNK // 4
    assert sizes[:3] == [FIRST_CHUNK, second, min(2 * second, 256)] and sum(sizes) == 1024
    assert max(sizes) == 256  # up to a batch's worth
    small = chunk_sizes(16 * FIRST_CHUNK, page // 16, batch)  # 4,096 blocks a batch
    assert small[:4] == [FIRST_CHUNK, second, 2 * second, 4 * second]
    assert chunk_sizes(10, page, 2 * page) == [2, 2, 2, 2, 2]  # the first is a batch's worth
    assert chunk_sizes(0, page, batch) == []
    assert chunk_sizes(5, page, batch) == [5]
    assert chunk_sizes(3, 128 << 20, batch) == [1, 1, 1]  # a page larger than a batch
