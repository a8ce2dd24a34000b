"""Shared fixtures of the integration tests: tiny local models and a real daemon subprocess.

The tests of ``kvtier/integrations/vllm`` and ``/transformers`` live in ``with_vllm/`` and
``with_transformers/``: a test folder named ``vllm`` on ``sys.path`` (this one is) would import
as a namespace package where vLLM is not installed, and ``importorskip("vllm")`` would not skip.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from integration_daemon import start_daemon, stop_daemon


@pytest.fixture(scope="session", autouse=True)
def _vllm_fork_servers() -> Iterator[None]:
    """Stop the vLLM fork servers once the session ends (only the vLLM tests start them)."""
    yield
    harness = sys.modules.get("vllm_harness")
    if harness is not None:
        harness.close_servers()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[object]:
    """``daemon_factory(**kw) -> address``; every daemon started is stopped at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def make(**kw: object) -> str:
        sock = tmp_path / f"kvtier-{len(procs)}.sock"
        procs.append(start_daemon(sock, **kw))  # type: ignore[arg-type]
        return f"unix://{sock}"

    yield make
    for proc in procs:
        stop_daemon(proc)
