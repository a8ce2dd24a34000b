"""kvtier/tiers/writebehind.py with the in-memory keyed medium: a flooding owner cannot keep a
light owner's items out of a full queue, and the writers take the owners' items in turn."""

from __future__ import annotations

import time

from kvtier.tiers.keyed import DictMedium
from kvtier.tiers.writebehind import WriteBehind

ITEM = 1000


def _items(prefix: str, n: int) -> list[tuple[bytes, bytes]]:
    return [(f"{prefix}{i}".encode(), bytes([i]) * ITEM) for i in range(n)]


def test_a_full_queue_makes_room_from_the_flooding_owner_and_writes_in_turn() -> None:
    medium, dropped = DictMedium(), []
    writer = WriteBehind(medium, lambda name, payload: (name, payload), max_bytes=4 * ITEM,
                         batch_bytes=ITEM, on_drop=dropped.extend)
    try:
        with medium._lock:  # the store hangs: the writer holds its first item, nothing leaves
            assert writer.offer(_items("n", 6), "noisy") == 4  # the rest: queue full
            deadline = time.monotonic() + 5
            while writer._busy == 0 and time.monotonic() < deadline:
                time.sleep(0.001)  # the writer took n0 and waits on the store
            assert writer.offer(_items("q", 1), "quiet") == 1  # room made from noisy's newest
            assert dropped == [b"n3"]
            assert writer.offer(_items("n", 1), "noisy") == 0  # noisy may not evict quiet
        assert writer.flush(5)
        assert list(medium.data) == [b"n0", b"n1", b"q0", b"n2"]  # quiet's in turn, not last
        assert writer.counters.dropped == {"queue_full": 4}  # n4, n5, n3 evicted, n0 again
        assert writer.counters.pages == 4 and writer.queued_bytes == 0
    finally:
        writer.close(5)


def test_items_the_store_did_not_take_are_reported_so_they_can_be_offered_again() -> None:
    """A batch the store refused (down, full) was dropped and counted, but its blocks stayed
    known as written to the remote tier, so a later Store of them never wrote them again."""
    medium, dropped = DictMedium(), []
    writer = WriteBehind(medium, lambda name, payload: (name, payload), max_bytes=8 * ITEM,
                         batch_bytes=2 * ITEM, on_drop=dropped.extend)
    try:
        medium.down = True
        assert writer.offer(_items("a", 2), "t") == 2
        assert writer.flush(5)
        assert sorted(dropped) == [b"a0", b"a1"] and writer.counters.dropped == {"store": 2}
        medium.down = False
        assert writer.offer(_items("a", 2), "t") == 2  # offered again: written this time
        assert writer.flush(5) and sorted(medium.data) == [b"a0", b"a1"]
        assert sorted(dropped) == [b"a0", b"a1"]  # nothing more reported
    finally:
        writer.close(5)
