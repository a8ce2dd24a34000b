"""The interpreter's switch interval, shortened while a caller's bookkeeping overlaps copies.

A keyed store or load hashes and indexes the blocks of one chunk while a lane launches the
copies of the chunks before it. Every torch call of a launch gives up the interpreter lock and
must take it back from the busy caller: with the daemon's 500 us switch interval that is up to
500 us per call, and a launch waits milliseconds. While any caller is inside ``short_switches``
the interval is at most ``interval``; it is put back when the last one leaves.

Contract: ``SWITCHES.short()`` nests and is thread-safe; the interval is process-wide, so this
module is its one owner while shortened (a ``sys.setswitchinterval`` made by someone else in
between is overwritten on the way out).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SHORT_S = 20e-6


class SwitchInterval:
    """Reference-counted shortening of ``sys.getswitchinterval()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._saved = 0.0

    @contextmanager
    def short(self, interval: float = SHORT_S) -> Iterator[None]:
        with self._lock:
            if not self._inside:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, interval))
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if not self._inside:
                    sys.setswitchinterval(self._saved)


SWITCHES = SwitchInterval()  # the process has one interpreter lock, hence one owner
