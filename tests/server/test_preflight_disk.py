"""The start-up check of the disk directory's entries: one under a disk tier file's name that the
tier can't use is one line naming the setting and the path, exit 2, and a link in it is never
followed (its target is neither chmodded nor written)."""

from __future__ import annotations

import os
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


def test_serve_refuses_a_directory_of_someone_elses_files_and_leaves_its_mode(
        tmp_path: Path) -> None:
    """``--disk-path /`` started, took ``/`` to mode 0750 (others lost access to the whole
    machine) and wrote the tier's files there. A directory with other files and none of the
    tier's is someone else's: refused, its mode and entries untouched."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    (shared / "someone-elses-file").write_text("x")
    args = serve_args(tmp_path, disk=shared, metrics_port=free_port())
    proc = subprocess.run(args, env=daemon_env(), capture_output=True, text=True, timeout=60)
    lines = (proc.stderr + proc.stdout).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"kvtier serve: {SETTING}{shared} holds 'someone-elses-file'")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert sorted(p.name for p in shared.iterdir()) == ["someone-elses-file"]


def test_a_directory_the_tier_already_uses_keeps_what_else_is_in_it(tmp_path: Path) -> None:
    from kvtier.tiers.disk import DiskStore

    disk = tmp_path / "disk"
    with DiskStore(disk, 1 << 20, direct_io=False):
        pass  # its index and journal
    (disk / "README").write_text("the kvtier disk tier\n")
    (disk / "lost+found").mkdir()
    check_disk(config(disk))
    with DiskStore(disk, 1 << 20, direct_io=False):
        pass
    empty = tmp_path / "mount"
    (empty / "lost+found").mkdir(parents=True)  # a file system mounted for the tier
    check_disk(config(empty))
    (empty / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"holds 'notes\.txt'"):
        check_disk(config(empty))


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root")
def test_serve_refuses_a_page_file_another_user_planted(tmp_path: Path) -> None:
    """Its owner could read every page the daemon wrote to it (a probe read another tenant's
    bytes from one planted in a shared directory): one line naming the file and its owner."""
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o777)
    planted = disk / f"pages-{PAGE}.dat"
    planted.write_bytes(b"")
    os.chown(planted, 65534, 65534)
    planted.chmod(0o666)
    args = serve_args(tmp_path, disk=disk, metrics_port=free_port())
    proc = subprocess.run(args, env=daemon_env(), capture_output=True, text=True, timeout=60)
    lines = (proc.stderr + proc.stdout).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"kvtier serve: {SETTING}{planted} belongs to uid 65534")
    assert planted.stat().st_size == 0
