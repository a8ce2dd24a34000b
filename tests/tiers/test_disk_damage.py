"""DiskStore in a directory holding entries under its file names that it must not use: a symbolic
link is never followed (its target is never chmodded or written), and a directory, link, FIFO or
a file it may not open is refused with a ``ConfigError`` naming the path; nothing is deleted."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.tiers.base import DiskRecord
from kvtier.tiers.disk import DiskStore, unusable_file

PS = 8192
VICTIM = b"important=1\n"


def victim(tmp_path: Path) -> Path:
    """A file outside the disk directory that the store must never change."""
    path = tmp_path / "victim.conf"
    path.write_bytes(VICTIM)
    path.chmod(0o644)
    return path


def untouched(path: Path) -> bool:
    return path.read_bytes() == VICTIM and stat.S_IMODE(path.stat().st_mode) == 0o644


def filled(disk: Path, n: int = 4) -> None:
    """A closed store in ``disk`` holding ``n`` recorded pages."""
    with DiskStore(disk, 1 << 20, direct_io=False) as store:
        slots = store.alloc(PS, n)
        assert slots is not None
        data = [torch.full((PS,), i, dtype=torch.uint8) for i in range(n)]
        assert store.write(PS, slots, data).result(timeout=10) == [True] * n
        for i, s in enumerate(slots):
            store.set_record(PS, s, DiskRecord(f"k{i}".encode(), "t1"))


@pytest.mark.parametrize("name", [f"pages-{PS}.dat", "journal-1.log", "index.json",
                                  "index.json.tmp"])
def test_a_link_to_a_file_outside_is_refused_and_its_target_untouched(
    tmp_path: Path, name: str
) -> None:
    disk = tmp_path / "disk"
    filled(disk)
    target = victim(tmp_path)
    (disk / name).unlink(missing_ok=True)
    (disk / name).symlink_to(target)
    with pytest.raises(ConfigError, match=f"{name} is a symbolic link"):
        DiskStore(disk, 1 << 20, direct_io=False)
    assert untouched(target) and (disk / name).is_symlink()


def test_a_link_planted_while_open_is_not_followed(tmp_path: Path) -> None:
    """A new page size's file and the next journal file, planted as links while the store runs:
    the page size gets no slots and the compaction fails; the targets stay as they were."""
    disk = tmp_path / "disk"
    target = victim(tmp_path)
    with DiskStore(disk, 1 << 20, direct_io=False) as store:
        (disk / f"pages-{2 * PS}.dat").symlink_to(target)
        assert store.alloc(2 * PS, 1) is None
        (disk / "journal-2.log").symlink_to(target)
        assert store.compact() is False
        (disk / "journal-2.log").unlink()
        (disk / "index.json.tmp").symlink_to(target)
        assert store.compact() is True  # the leftover link is replaced, not written through
    assert untouched(target)
    assert not (disk / "index.json.tmp").exists()


def _dir(path: Path) -> None:
    path.mkdir()


def _dangling(path: Path) -> None:
    path.symlink_to("/nonexistent/kvtier-target")


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize("make", [_dir, _dangling, _fifo], ids=["directory", "dangling", "fifo"])
@pytest.mark.parametrize("name", [f"pages-{PS}.dat", "journal-1.log", "journal-2.log",
                                  "index.json", "index.json.tmp"])
def test_an_unusable_entry_is_one_clear_error(
    tmp_path: Path, name: str, make: Callable[[Path], None]
) -> None:
    disk = tmp_path / "disk"
    filled(disk)
    (disk / name).unlink(missing_ok=True)
    make(disk / name)
    problem = unusable_file(str(disk))
    assert problem is not None and problem.startswith(f"{disk / name} is a ")
    with pytest.raises(ConfigError, match=f"disk tier: {disk / name} is a "):
        DiskStore(disk, 1 << 20, direct_io=False)
    assert os.path.lexists(disk / name)  # the operator's to move: never deleted


def test_entries_the_store_ignores_are_not_refused(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    filled(disk)
    (disk / "pages-0.dat").mkdir()  # not a page size: never opened
    (disk / "notes").symlink_to("/nonexistent")
    assert unusable_file(str(disk)) is None
    with DiskStore(disk, 1 << 20, direct_io=False) as store:
        assert len(store.records()) == 4


def _can_bypass_modes(tmp_path: Path) -> bool:
    probe = tmp_path / "mode-probe"
    probe.write_bytes(b"")
    probe.chmod(0)
    try:
        os.close(os.open(probe, os.O_RDONLY))
        return True
    except PermissionError:
        return False


@pytest.mark.parametrize(("name", "mode", "how"), [
    (f"pages-{PS}.dat", 0o400, "read and written"),
    (f"pages-{PS}.dat", 0, "read and written"),
    ("journal-1.log", 0, "read"),
    ("index.json", 0, "read"),
])
def test_a_file_the_store_may_not_open_is_one_clear_error(
    tmp_path: Path, name: str, mode: int, how: str
) -> None:
    if _can_bypass_modes(tmp_path):
        pytest.skip("this process opens files whatever their mode (root with CAP_DAC_OVERRIDE)")
    disk = tmp_path / "disk"
    filled(disk)
    if not (disk / name).exists():  # the journal of the generation the snapshot names
        (disk / name).write_bytes(b"")
    (disk / name).chmod(mode)
    try:
        with pytest.raises(ConfigError, match=f"{name} cannot be {how}: Permission denied"):
            DiskStore(disk, 1 << 20, direct_io=False)
    finally:
        (disk / name).chmod(0o600)


needs_chown = pytest.mark.skipif(os.geteuid() != 0, reason="planting another's file needs root")


@needs_chown
def test_a_file_another_user_planted_is_never_written(tmp_path: Path) -> None:
    """In a directory others may write (the daemon can't tighten one it doesn't own), another
    user made a page file the tier then used as it was: its owner read every page written to it.
    Now such a file is refused at start, and at run time the page size gets no slots (no byte
    written to it) while the other sizes work."""
    disk = tmp_path / "disk"
    filled(disk)
    planted = disk / f"pages-{PS}.dat"
    os.chown(planted, 65534, 65534)
    problem = unusable_file(str(disk))
    assert problem is not None and "belongs to uid 65534" in problem
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        DiskStore(disk, 1 << 20, direct_io=False)
    late = tmp_path / "late"
    late.mkdir(mode=0o777)
    with DiskStore(late, 1 << 20, direct_io=False) as store:
        (late / f"pages-{PS}.dat").write_bytes(b"")
        os.chown(late / f"pages-{PS}.dat", 65534, 65534)
        (late / f"pages-{PS}.dat").chmod(0o666)
        assert store.alloc(PS, 2) is None
        assert (late / f"pages-{PS}.dat").stat().st_size == 0
        assert store.alloc(2 * PS, 1) is not None
