"""Engine-core mechanics on a real CPU-mode engine: waiting for restore moves to end."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.errors import Unavailable


def _waiter(core, target: int, deadline_s: float, out: dict) -> threading.Thread:
    def run() -> None:
        with core.cond:
            try:
                out["got"] = core.wait_restores(target, time.monotonic() + deadline_s)
            except Unavailable as exc:
                out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_wait_restores_returns_once_its_target_is_reached(make_engine):
    core = make_engine(disk=False)._core
    out: dict = {}
    thread = _waiter(core, core.restores_ended + 3, 30.0, out)
    for _ in range(2):
        with core.cond:
            core._restores_end(1)
    thread.join(0.2)
    assert thread.is_alive() and not out  # two of the three moves ended: still waiting
    with core.cond:
        core._restores_end(1)
    thread.join(10)
    assert out == {"got": True}


def test_wait_restores_is_false_past_its_deadline_and_raises_once_closed(make_engine):
    engine = make_engine(disk=False)
    core = engine._core
    out: dict = {}
    _waiter(core, core.restores_ended + 1, 0.05, out).join(10)
    assert out == {"got": False}
    out.clear()
    thread = _waiter(core, core.restores_ended + 1, 30.0, out)
    time.sleep(0.05)
    engine.close()
    thread.join(10)
    assert isinstance(out.get("error"), Unavailable)
    with pytest.raises(Unavailable), core.cond:
        core.wait_restores(core.restores_ended + 1, time.monotonic() + 1)
