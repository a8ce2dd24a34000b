"""``kvtier status`` against a real daemon subprocess."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvtier_daemon_fixture import Daemon

from kvtier.cli import main


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def kvtier(capsys: pytest.CaptureFixture[str]) -> Any:
    """Run the CLI in-process (a subprocess would pay the torch import each time)."""

    def run(*argv: str) -> Result:
        code = main(list(argv))
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


def test_status_table(daemon: Daemon, kvtier: Any) -> None:
    with daemon.client("t") as c:
        att = c.attach(4)
        c.allocate(att, 2)
        res = kvtier("status", "--address", daemon.address)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for word in ("tier", "gpu", "cpu", "disk", "capacity", "pools", "restores",
                 "evictions", "checksum failures", daemon.address):
        assert word in out, out


def test_status_json(daemon: Daemon, kvtier: Any) -> None:
    res = kvtier("status", "--address", daemon.address, "--json")
    assert res.returncode == 0, res.stderr
    data: dict[str, Any] = json.loads(res.stdout)
    assert data["address"] == daemon.address
    assert {t["tier"] for t in data["tiers"]} >= {"gpu", "cpu"}
    assert all(t["capacity_bytes"] > 0 for t in data["tiers"])
    assert data["pools"] >= 1 and isinstance(data["checksum_failures"], int)
    assert "restores" in data["queues"] and isinstance(data["moved"], dict)


def test_status_not_running_exits_1(tmp_path: Path, kvtier: Any) -> None:
    address = f"unix://{tmp_path}/nobody.sock"
    res = kvtier("status", "--address", address)
    assert res.returncode == 1
    assert f"no kvtier daemon at {address}" in res.stderr
    assert "kvtier serve" in res.stderr


def test_a_stopped_daemon_and_a_bad_address_are_told_apart(tmp_path: Path, kvtier: Any) -> None:
    """A stopped (SIGSTOP: hung) daemon and a malformed --address were both reported as "no
    kvtier daemon ... is `kvtier serve` running?"."""
    from kvtier_daemon_fixture import start

    d = start(tmp_path)
    try:
        d.proc.send_signal(signal.SIGSTOP)
        res = kvtier("status", "--address", d.address, "--timeout", "1")
        assert res.returncode == 1
        assert "did not answer within 1 s" in res.stderr and "no kvtier daemon" not in res.stderr
    finally:
        d.proc.send_signal(signal.SIGCONT)
        d.stop(signal.SIGKILL)
    with pytest.raises(SystemExit) as done:
        kvtier("status", "--address", "garbage")
    assert done.value.code == 2
