"""The start-up check of the disk directory's entries: one under a disk tier file's name that the
tier can't use is one line naming the setting and the path, exit 2, and a link in it is never
followed (its target is neither chmodded nor written)."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest
from kvtier_daemon_fixture import PAGE, daemon_env, free_port, serve_args

from kvtier.config import OffloadConfig
from kvtier.errors import ConfigError
from server.preflight import check_disk

SETTING = "--disk-path/KVCACHED_OFFLOAD_DISK_PATH: "


def config(disk: Path) -> OffloadConfig:
    return OffloadConfig(disk_path=str(disk), disk_gb=0.01)


@pytest.mark.parametrize("name", [f"pages-{PAGE}.dat", "journal-3.log", "index.json.tmp"])
def test_a_directory_under_a_tier_file_name_is_refused(tmp_path: Path, name: str) -> None:
    disk = tmp_path / "disk"
    (disk / name).mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"DISK_PATH: {disk / name} is a directory"):
        check_disk(config(disk))
    assert (disk / name).is_dir()


def test_serve_refuses_a_linked_page_file_without_touching_its_target(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o770)
    victim = tmp_path / "victim.conf"
    victim.write_text("important=1\n")
    victim.chmod(0o644)
    (disk / f"pages-{PAGE}.dat").symlink_to(victim)
    args = serve_args(tmp_path, disk=disk, metrics_port=free_port())
    proc = subprocess.run(args, env=daemon_env(), capture_output=True, text=True, timeout=60)
    lines = (proc.stderr + proc.stdout).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"kvtier serve: {SETTING}{disk}/pages-{PAGE}.dat is a symbolic link")
    assert victim.read_text() == "important=1\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert not (tmp_path / "k.sock").exists()
