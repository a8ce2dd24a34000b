"""Register: the engine owns the KV memory (a /dev/shm file in CPU mode); the daemon adopts it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch
from kvtier_daemon_fixture import PAGE, Daemon

from kvtier.errors import InvalidArgument

SLOTS = 4


@pytest.fixture
def shm_file() -> Iterator[str]:
    path = f"/dev/shm/kvtier-test-{uuid.uuid4().hex}"
    with open(path, "wb") as fh:
        fh.truncate(2 * SLOTS * PAGE)
    yield path
    os.unlink(path)


def test_register_two_segments_round_trip(spawn: Callable[..., Daemon], shm_file: str) -> None:
    d = spawn()
    flat = torch.from_file(shm_file, shared=True, size=2 * SLOTS * PAGE, dtype=torch.uint8)
    half = PAGE // 2  # each page = half a row of segment 0 + half a row of segment 1
    seg0 = flat[: SLOTS * PAGE].view(SLOTS, PAGE)[:, :half]
    seg1 = flat[SLOTS * PAGE:].view(SLOTS, PAGE)[:, :half]
    with d.client("vllm") as c:
        att = c.register([seg0, seg1], shm_paths=[shm_file, shm_file])
        assert att.tensor is None and att.num_slots == SLOTS and att.page_size == PAGE
        # The engine owns its slots (it allocates them itself); the daemon stores and loads
        # keyed copies of them (prefix reuse).
        for slot in range(SLOTS):
            seg0[slot].fill_(slot + 1)
            seg1[slot].fill_(slot + 101)
        keys = [f"prefix-{i}".encode() for i in range(SLOTS)]
        assert c.store(att, keys, list(range(SLOTS))) == SLOTS
        flat.zero_()
        assert len(c.lookup(keys)) == SLOTS
        assert c.load(att, keys, list(reversed(range(SLOTS)))) == SLOTS
        for i, slot in enumerate(reversed(range(SLOTS))):
            assert bool((seg0[slot] == i + 1).all()) and bool((seg1[slot] == i + 101).all())
        c.detach(att)


def test_register_refuses_paths_outside_dev_shm(spawn: Callable[..., Daemon], tmp_path: object
                                                ) -> None:
    d = spawn()
    t = torch.zeros(SLOTS, PAGE, dtype=torch.uint8)
    with d.client("vllm") as c, pytest.raises(InvalidArgument) as err:
        c.register([t], shm_paths=["/etc/passwd"])
    assert err.value.field == "segments[0].shm_path"
