"""Client tests reuse the real-daemon helper of tests/server."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from kvtier_daemon_fixture import Daemon, start


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def make(**kw: Any) -> Daemon:
        d = start(tmp_path, **kw)
        started.append(d)
        return d

    yield make
    for d in started:
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)
