"""Landings on a real CPU-mode engine: waiting for a number of restore moves to end."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.errors import Unavailable


def _waiter(core, target: int, deadline_s: float, out: dict) -> threading.Thread:
    def run() -> None:
        with core.cond:
            try:
                deadline = time.monotonic() + deadline_s
                out["got"] = core.landings.wait(target, deadline, core.check_open)
            except Unavailable as exc:
                out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_wait_returns_once_its_target_is_reached(make_engine):
    core = make_engine(disk=False)._core
    out: dict = {}
    thread = _waiter(core, core.landings.ended + 3, 30.0, out)
    for _ in range(2):
        with core.cond:
            core.landings.end(1)
    thread.join(0.2)
    assert thread.is_alive() and not out  # two of the three moves ended: still waiting
    with core.cond:
        core.landings.end(1)
    thread.join(10)
    assert out == {"got": True}


def test_a_wait_is_false_past_its_deadline_and_raises_once_the_engine_closes(make_engine):
    engine = make_engine(disk=False)
    core = engine._core
    out: dict = {}
    _waiter(core, core.landings.ended + 1, 0.05, out).join(10)
    assert out == {"got": False}
    out.clear()
    thread = _waiter(core, core.landings.ended + 1, 30.0, out)
    time.sleep(0.05)
    engine.close()
    thread.join(10)
    assert isinstance(out.get("error"), Unavailable)
    with pytest.raises(Unavailable), core.cond:
        core.landings.wait(core.landings.ended + 1, time.monotonic() + 1, core.check_open)
