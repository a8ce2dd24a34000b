"""kvtier/prefix/store.py primitives: the tenant salt (persisted in disk records: must never change)
and how stores and loads are cut into chunks."""

from __future__ import annotations

import hashlib
import os

from kvtier.prefix.store import FIRST_CHUNK, _tenant_key, chunk_sizes, salt_key


def test_salt_key_is_the_keyed_blake2b_of_the_block_key() -> None:
    for tenant in ("a", "tenant-b", ""):
        for key in (b"", b"x", os.urandom(32), os.urandom(200)):
            want = hashlib.blake2b(key, key=_tenant_key(tenant), digest_size=16).digest()
            assert salt_key(tenant, key) == want
    assert salt_key("a", b"k") != salt_key("b", b"k")


def test_chunks_start_small_double_and_cover_every_block() -> None:
    page, batch = 256 << 10, 64 << 20  # 256 blocks a batch
    sizes = chunk_sizes(1024, page, batch)
    assert sizes[0] == FIRST_CHUNK and sum(sizes) == 1024
    assert sizes[:4] == [FIRST_CHUNK, 2 * FIRST_CHUNK, 4 * FIRST_CHUNK, 256]
    assert max(sizes) == 256
    assert chunk_sizes(0, page, batch) == []
    assert chunk_sizes(5, page, batch) == [5]
    assert chunk_sizes(3, 128 << 20, batch) == [1, 1, 1]  # a page larger than a batch
