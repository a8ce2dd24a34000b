"""Landings: the count of CPU -> GPU moves ended, and acquires waiting for it to reach theirs.

Contract (every method runs with the engine lock held, the lock this object was built on):
    * ``end(n)``: ``n`` more restore moves completed or were cancelled; wakes the waiters whose
      target that reaches (and only them: an acquire of a thousand batches wakes once, not per
      batch, so it never takes the lock and the interpreter from the lane completing the next).
    * ``wait(target, deadline, check_open)``: sleep, the lock released, until ``ended`` reaches
      ``target`` (True) or ``deadline`` passes (False); ``check_open()`` runs after every
      wake-up (it raises once the engine is closed) and wake-ups come at least every 50 ms.
    * ``wake()``: wake every waiter (the engine is closing).
    * ``restore_waiters``: how many acquires wait on a restore now (they count themselves in
      and out); while any does, offload completions yield to restores.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

POLL_S = 0.05


class Landings:
    """See the module docstring."""

    def __init__(self, lock: threading.RLock) -> None:
        self.ended = 0
        self.restore_waiters = 0
        self._cond = threading.Condition(lock)
        self._targets: list[int] = []

    def end(self, n: int) -> None:
        self.ended += n
        if self._targets and self.ended >= min(self._targets):
            self._cond.notify_all()

    def wake(self) -> None:
        self._cond.notify_all()

    def wait(self, target: int, deadline: float, check_open: Callable[[], None]) -> bool:
        self._targets.append(target)
        try:
            while self.ended < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, POLL_S))
                check_open()
            return True
        finally:
            self._targets.remove(target)
