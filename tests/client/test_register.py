"""Register: the engine owns the KV memory (a sealed memfd in CPU mode); the daemon adopts it."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.client.ipc import SharedMemory
from kvtier_daemon_fixture import PAGE, Daemon

SLOTS = 4


def test_register_two_segments_round_trip(spawn: Callable[..., Daemon]) -> None:
    d = spawn()
    mem = SharedMemory(2 * SLOTS * PAGE)
    flat = mem.tensor
    half = PAGE // 2  # each page = half a row of segment 0 + half a row of segment 1
    seg0 = flat[: SLOTS * PAGE].view(SLOTS, PAGE)[:, :half]
    seg1 = flat[SLOTS * PAGE:].view(SLOTS, PAGE)[:, :half]
    with d.client("vllm") as c:
        att = c.register([seg0, seg1], fds=[mem.fd, mem.fd])
        mem.close()  # the daemon holds its own mapping now
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
