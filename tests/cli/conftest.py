"""Fixtures for CLI tests: one real CPU-mode daemon subprocess per module."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from kvtier_daemon_fixture import Daemon, start


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start(tmp_path_factory.mktemp("kvd"))
    yield d
    d.stop(signal.SIGKILL)
