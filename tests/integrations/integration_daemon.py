"""A real daemon subprocess for the integration tests (``python -m kvtier.cli serve``, CPU mode).

Its own module, not ``conftest``: test modules import these by name, and a module named
``conftest`` is whichever folder's conftest pytest loaded last when ``tests/server`` and
``tests/integrations`` run in one call.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


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
