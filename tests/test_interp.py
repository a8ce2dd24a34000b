"""kvtier/interp.py: the switch interval is shortened while anyone is inside, then restored."""

from __future__ import annotations

import sys
import threading

from kvtier.interp import SwitchInterval


def test_short_nests_across_threads_and_restores() -> None:
    before = sys.getswitchinterval()
    switches = SwitchInterval()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with switches.short(1e-5):
            inside.set()
            leave.wait(10)

    try:
        sys.setswitchinterval(0.002)
        th = threading.Thread(target=other)
        th.start()
        assert inside.wait(10)
        assert sys.getswitchinterval() < 1e-4
        with switches.short(1e-5):
            leave.set()
            th.join(10)
            assert sys.getswitchinterval() < 1e-4  # the other left; this one is still inside
        assert abs(sys.getswitchinterval() - 0.002) < 1e-9
        with switches.short(0.01):  # never lengthened
            assert abs(sys.getswitchinterval() - 0.002) < 1e-9
    finally:
        sys.setswitchinterval(before)
