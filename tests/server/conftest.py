"""Fixtures: one real daemon per test module (``daemon``) and a fresh one per test (``fresh``)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtier_daemon_fixture import Daemon, start


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start(tmp_path_factory.mktemp("kvd"))
    yield d
    d.stop(signal.SIGKILL)


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
