"""A FIFO per owner with byte counts, served in turn: the write-behind's queue, fair to tenants.

Contract (the caller holds its own lock around every call):
    * ``push(owner, item, size)`` queues at the tail of ``owner``'s FIFO; ``pop()`` takes the
      head of the next owner's FIFO in turn (one item per owner per turn), so one owner's
      backlog never delays another's items by more than one item each.
    * ``make_room(owner, need, size)`` evicts from the tail of the owner with the most bytes
      queued (never ``owner`` itself, and only while that owner holds more than ``owner`` would
      with ``size`` more) until ``need`` bytes are freed: a flooding owner loses its newest
      items before a light owner loses anything. Returns what it evicted.
    * ``bytes`` is the total queued; ``peek_size()`` the size of the item ``pop`` returns next.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._queues: dict[str, deque[tuple[T, int]]] = {}
        self._bytes: dict[str, int] = {}
        self._turn: deque[str] = deque()  # owners with items, the next one to serve first
        self.bytes = 0

    def __bool__(self) -> bool:
        return bool(self._turn)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def push(self, owner: str, item: T, size: int) -> None:
        queue = self._queues.get(owner)
        if queue is None:
            queue = self._queues[owner] = deque()
            self._bytes[owner] = 0
            self._turn.append(owner)
        queue.append((item, size))
        self._bytes[owner] += size
        self.bytes += size

    def peek_size(self) -> int:
        return self._queues[self._turn[0]][0][1]

    def pop(self) -> T:
        owner = self._turn.popleft()
        item, size = self._queues[owner].popleft()
        if self._take_off(owner, size):
            self._turn.append(owner)  # more of its items: its next turn comes after the others'
        return item

    def make_room(self, owner: str, need: int, size: int) -> list[T]:
        evicted: list[T] = []
        mine = self._bytes.get(owner, 0) + size
        while need > 0 and self._turn:
            heavy = max(self._bytes, key=self._bytes.__getitem__)
            if heavy == owner or self._bytes[heavy] <= mine:
                break
            item, n = self._queues[heavy].pop()
            if not self._take_off(heavy, n):
                self._turn.remove(heavy)
            evicted.append(item)
            need -= n
        return evicted

    def clear(self) -> list[T]:
        items = [item for q in self._queues.values() for item, _ in q]
        self._queues.clear()
        self._bytes.clear()
        self._turn.clear()
        self.bytes = 0
        return items

    def _take_off(self, owner: str, size: int) -> bool:
        """``size`` bytes of ``owner`` left the queue; whether it has items left (an owner with
        none is forgotten here, and taken out of the turn by the caller)."""
        self._bytes[owner] -= size
        self.bytes -= size
        if self._queues[owner]:
            return True
        del self._queues[owner], self._bytes[owner]
        return False
