"""kvtier/prefix/store.py primitives: how stores and loads are cut into chunks."""

from __future__ import annotations

from itertools import pairwise

from kvtier.prefix.store import FIRST_CHUNK, chunk_sizes


def test_chunks_start_small_grow_and_cover_every_block() -> None:
    page, batch = 256 << 10, 64 << 20  # 256 blocks a batch
    sizes = chunk_sizes(1024, page, batch)
    assert sizes == [96, 120, 150, 187, 233, 238] and sum(sizes) == 1024  # a quarter more each
    assert FIRST_CHUNK == 96
    big = chunk_sizes(4096, page, batch)
    assert max(big) == 256 and big.count(256) >= 10 and sum(big) == 4096  # up to a batch's worth
    small = chunk_sizes(64 * FIRST_CHUNK, page // 16, batch)  # 4,096 blocks a batch
    quarter = [b == a + a // 4 for a, b in pairwise(small)]
    doubled = [b == 2 * a for a, b in pairwise(small)]
    k = next(i for i, a in enumerate(small) if a >= 4 * FIRST_CHUNK)
    assert all(quarter[:k]) and all(doubled[k : len(small) - 2])  # the last chunk: the rest
    assert len(small) < 15 and sum(small) == 64 * FIRST_CHUNK
    assert chunk_sizes(10, page, 2 * page) == [2, 2, 2, 2, 2]  # the first is a batch's worth
    assert chunk_sizes(0, page, batch) == []
    assert chunk_sizes(5, page, batch) == [5]
    assert chunk_sizes(3, 128 << 20, batch) == [1, 1, 1]  # a page larger than a batch
