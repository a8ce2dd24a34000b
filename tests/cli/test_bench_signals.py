"""``kvtier bench`` stopped by SIGTERM or SIGINT mid-run, as a real process: SIGTERM orphaned the
embedded daemon and left its temp dir; SIGINT ended in a KeyboardInterrupt traceback (exit -2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _pids_with(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_embedded_daemon_and_removes_its_files(tmp_path: Path,
                                                                 sig: signal.Signals) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_OFFLOAD_")}
    env["TMPDIR"] = str(tmp_path)  # where the bench makes its kvtier-bench-* dir
    err_path = tmp_path / "stderr"
    with open(err_path, "wb") as err:
        bench = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "bench", "--seconds", "300", "--engines", "1",
             "--pages-per-engine", "32"], env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while "ops=" not in err_path.read_text(errors="replace"):  # the workload is running
            assert bench.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.2)
        daemons = _pids_with(f"unix://{tmp_path}/kvtier-bench-")
        assert len(daemons) == 1 and list(tmp_path.glob("kvtier-bench-*"))
        bench.send_signal(sig)
        code = bench.wait(60)
    finally:
        if bench.poll() is None:
            bench.kill()
    text = err_path.read_text(errors="replace")
    lines = [line for line in text.split("\n") if line.strip() and "ops=" not in line]
    assert code == 128 + sig, text
    assert "Traceback" not in text and len(lines) == 1, text
    assert lines[0].startswith(f"kvtier bench: stopped by {sig.name}"), lines
    assert not _alive(daemons[0]), "the embedded daemon outlived the bench"
    assert not list(tmp_path.glob("kvtier-bench-*")), "its temp dir was left behind"
