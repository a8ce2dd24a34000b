"""Shared helpers for the tier tests: run a real second Python process against the repo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_python(code: str, *args: str, timeout: float = 60,
               pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; fail the test with its stderr if it fails."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        pass_fds=pass_fds,
        cwd=REPO,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(f"child exited {proc.returncode}:\n{proc.stderr}")
    return proc
