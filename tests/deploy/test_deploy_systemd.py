"""The systemd unit verifies cleanly and keeps the settings CUDA and the disk tier depend on."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_helpers import checks, run_check

UNIT = checks.UNIT


def _directives() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def test_systemd_analyze_verify_prints_nothing() -> None:
    assert run_check(checks.systemd_verify) == []


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    broken = tmp_path / "kvtier.service"
    broken.write_text(UNIT.read_text().replace("ProtectHome=yes", "ProtectHome=maybe\nBogus=1"))
    problems = run_check(checks.systemd_verify, broken)
    assert problems and "Bogus" in problems[0]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("Type", "notify"),
        ("NotifyAccess", "main"),
        ("ExecStart", "/usr/local/bin/kvtier serve"),
        ("Restart", "on-failure"),
        ("RuntimeDirectory", "kvtier"),
        ("RuntimeDirectoryMode", "0750"),
        ("StateDirectory", "kvtier"),
        ("EnvironmentFile", "-/etc/kvtier/kvtier.env"),
        ("User", "kvtier"),
        ("Group", "kvtier"),
        ("SupplementaryGroups", "video"),
        ("LimitMEMLOCK", "infinity"),
        ("ProtectSystem", "strict"),
        ("ReadWritePaths", "/var/lib/kvtier"),
        ("ProtectHome", "yes"),
        ("NoNewPrivileges", "yes"),
        ("Environment", "KVCACHED_OFFLOAD_DISK_PATH=/var/lib/kvtier"),
    ],
)
def test_unit_sets(key: str, value: str) -> None:
    assert value in _directives().get(key, []), f"{key}={value}"


def test_unit_avoids_settings_that_break_cuda() -> None:
    # Each hides /dev/nvidia* or changes the UID the engine must share for CUDA IPC.
    present = _directives()
    for key in ("DynamicUser", "PrivateDevices", "DeviceAllow", "DevicePolicy", "ProtectClock"):
        assert key not in present, key


def test_stop_timeout_exceeds_drain_grace() -> None:
    from kvtier.config import OffloadConfig

    assert float(_directives()["TimeoutStopSec"][0]) > OffloadConfig().grace_s + 5
