"""Shared fixtures of the integration tests: tiny local models and a real daemon subprocess.

The tests of ``kvtier/integrations/vllm`` and ``/transformers`` live in ``with_vllm/`` and
``with_transformers/``: a test folder named ``vllm`` on ``sys.path`` (this one is) would import
as a namespace package where vLLM is not installed, and ``importorskip("vllm")`` would not skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def wait_for_socket(path: Path, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Block until the daemon's unix socket exists (or fail with its output)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{out}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"daemon socket {path} did not appear")
        time.sleep(0.1)


def start_daemon(sock: Path, *, cpu_gb: float = 1.0, disk: Path | None = None,
                 gpu_gb: float = 0.5) -> subprocess.Popen[bytes]:
    """``python -m kvtier.cli serve`` on ``sock`` with the CPU device (and a disk tier if given)."""
    env = dict(os.environ, KVCACHED_OFFLOAD_DISK_ADMISSION="always",
               KVCACHED_OFFLOAD_PINNED_CHUNK_MB="1")
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--listen", f"unix://{sock}",
           "--device", "cpu", "--cpu-memory-gb", str(cpu_gb), "--gpu-memory-gb", str(gpu_gb),
           "--metrics-addr", ""]
    if disk is not None:
        cmd += ["--disk-path", str(disk), "--disk-gb", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for_socket(sock, proc)
    return proc


def stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
