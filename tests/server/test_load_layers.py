"""LoadLayers on a real daemon: a registered pool (sealed memfds) loaded one group of segments at
a time, exact bytes per group, refusals that change nothing, and a client that walks away."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import torch
from kvtier.client import KVTierClient, connect_async
from kvtier.client.attachment import Attachment
from kvtier.client.ipc import SharedMemory
from kvtier_daemon_fixture import PAGE, Daemon

from kvtier.errors import InvalidArgument, NotFound
from kvtier.types import Tier

SLOTS = 16
SENTINEL = 0xEE


class Registered:
    """``n`` segments of ``PAGE // n`` bytes per slot in one sealed memfd, registered."""

    def __init__(self, c: KVTierClient, n: int) -> None:
        width = PAGE // n
        self.mem = SharedMemory(n * SLOTS * width)
        flat = self.mem.tensor
        self.segs = [flat[i * SLOTS * width : (i + 1) * SLOTS * width].view(SLOTS, width)
                     for i in range(n)]
        self.att: Attachment = c.register(self.segs, fds=[self.mem.fd] * n)
        self.fill(range(SLOTS))

    def fill(self, slots: range) -> None:
        for s in self.segs:
            s[slots.start : slots.stop].copy_(torch.randint(
                0, 256, (len(slots), s.shape[1]), dtype=torch.uint8))

    def blank(self, slots: range) -> None:
        for s in self.segs:
            s[slots.start : slots.stop].fill_(SENTINEL)

    def snapshot(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.segs]


@pytest.fixture
def daemon1(daemon: Daemon) -> Daemon:
    """The module's daemon: each test registers a pool of its own and keys of its own."""
    return daemon


@pytest.fixture
def pool(daemon1: Daemon) -> Iterator[tuple[KVTierClient, Registered]]:
    with daemon1.client("layers") as c:
        yield c, Registered(c, 8)


def keys_of(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def test_each_group_reply_follows_its_exact_bytes(
        pool: tuple[KVTierClient, Registered]) -> None:
    c, r = pool
    keys = keys_of("exact", 4)
    assert c.store(r.att, keys, [0, 1, 2, 3]) == 4
    want = r.snapshot()
    r.blank(range(4, SLOTS))
    bounds = [0, 1, 4, 5, 8]  # groups of 1, 3, 1 and 3 segments
    dst = [9, 7, 4, 12, 15]  # the fifth key was never stored: its slot stays untouched
    counts = []
    for g, n in enumerate(c.load_layers(r.att, [*keys, b"never-stored"], dst, bounds)):
        counts.append(n)
        for i, s in enumerate(r.segs[: bounds[g + 1]]):  # every group so far has landed
            for j, slot in enumerate(dst[:n]):
                assert torch.equal(s[slot], want[i][j]), (g, i, slot)
    assert counts == [4, 4, 4, 4]
    for i, s in enumerate(r.segs):
        for slot in set(range(4, SLOTS)) - set(dst[:4]):
            assert bool((s[slot] == SENTINEL).all()), (i, slot)


def test_a_miss_yields_zero_for_every_group(pool: tuple[KVTierClient, Registered]) -> None:
    c, r = pool
    r.blank(range(8, 10))
    assert list(c.load_layers(r.att, keys_of("absent", 2), [8, 9], [0, 3, 8])) == [0, 0]
    assert all(bool((s[8:10] == SENTINEL).all()) for s in r.segs)


@pytest.mark.parametrize("bounds", [
    [], [0], [1, 8], [0, 7], [0, 9], [0, 4, 4, 8], [0, 5, 3, 8], [0] * 5000,
], ids=["empty", "one", "not-0", "short", "past-end", "repeated", "decreasing", "too-many"])
def test_bad_segment_bounds_are_refused_and_change_nothing(
        pool: tuple[KVTierClient, Registered], bounds: list[int]) -> None:
    c, r = pool
    keys = keys_of("bounds", 2)
    assert c.store(r.att, keys, [0, 1]) == 2
    r.blank(range(4, 6))
    before, stats = r.snapshot(), c.stats()
    with pytest.raises(InvalidArgument) as err:
        list(c.load_layers(r.att, keys, [4, 5], bounds))
    assert err.value.field == "segment_bounds"
    assert all(torch.equal(a, b) for a, b in zip(before, r.segs, strict=True))
    after = c.stats()
    assert (after.keyed_pages, dict(after.hits), after.misses) == \
        (stats.keyed_pages, dict(stats.hits), stats.misses)


@pytest.mark.parametrize("keys,slots,field", [
    ([], [], "len(keys)"), ([b"k"], [1, 2], "slots"), ([b""], [1], "keys"),
    ([b"k"], [SLOTS], "slots"), ([b"k"], [-1], "slots"),
])
def test_bad_keys_and_slots_are_refused_as_load_refuses_them(
        pool: tuple[KVTierClient, Registered], keys: list[bytes], slots: list[int],
        field: str) -> None:
    c, r = pool
    with pytest.raises(InvalidArgument) as err:
        list(c.load_layers(r.att, keys, slots, [0, 8]))
    assert err.value.field == field


def test_another_tenants_pool_is_not_found(daemon1: Daemon,
                                           pool: tuple[KVTierClient, Registered]) -> None:
    c, r = pool
    keys = keys_of("mine", 2)
    assert c.store(r.att, keys, [0, 1]) == 2
    r.blank(range(2, 4))
    with daemon1.client("intruder") as other, pytest.raises(NotFound):
        list(other.load_layers(r.att, keys, [2, 3], [0, 8]))
    assert all(bool((s[2:4] == SENTINEL).all()) for s in r.segs)


def test_a_client_that_walks_away_leaves_nothing_protected(
        spawn: Callable[..., Daemon]) -> None:
    """64 groups, the stream closed after the first reply. The CPU tier (16 pages) of a daemon
    of its own is then filled with fresh blocks: the abandoned load's 8 blocks must have left it
    (demoted to disk), which a block still protected could not."""
    with spawn().client("walker") as c:
        r = Registered(c, 64)
        keys = keys_of("walk", 8)
        assert c.store(r.att, keys, list(range(8))) == 8
        want = r.snapshot()
        stream = c.load_layers(r.att, keys, list(range(8, 16)), list(range(65)))
        assert next(stream) == 8
        stream.close()  # cancels the call
        r.blank(range(8, 16))
        assert list(c.load_layers(r.att, keys, list(range(8, 16)), [0, 32, 64])) == [8, 8]
        assert all(torch.equal(s[8:16], w[:8]) for s, w in zip(r.segs, want, strict=True))
        r.fill(range(SLOTS))
        assert c.store(r.att, keys_of("fresh", SLOTS), list(range(SLOTS))) == SLOTS
        assert Tier.CPU not in c.lookup(keys)


def test_the_asyncio_client_streams_the_same(daemon1: Daemon,
                                             pool: tuple[KVTierClient, Registered]) -> None:
    c, r = pool
    keys = keys_of("aio", 3)
    assert c.store(r.att, keys, [0, 1, 2]) == 3
    r.blank(range(4, 7))

    async def load(bounds: list[int]) -> list[int]:
        async with connect_async(daemon1.address, tenant="layers") as ac:
            return [n async for n in ac.load_layers(r.att, keys, [4, 5, 6], bounds)]

    assert asyncio.run(load([0, 2, 8])) == [3, 3]
    assert all(torch.equal(s[4:7], s[0:3]) for s in r.segs)
    with pytest.raises(InvalidArgument) as err:
        asyncio.run(load([0, 2]))
    assert err.value.field == "segment_bounds"
