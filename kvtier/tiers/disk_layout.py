"""The disk tier's files by name: which entries of its directory are its own, and whether it
could use them.

Contract:
    * ``page_file(directory, page_size)``: the slot file of a page size, ``pages-<size>.dat``;
      ``page_file_size(name)``: the page size a slot file's name says (None for any other name,
      or a size of 0).
    * ``unusable_file(directory) -> str | None``: why the store could not use an entry named as
      one of its files (a directory, link or special file, or a file it may not open as it
      must: slot files read-write, the journal and the snapshot read-only), else None. Entries
      it would ignore are not looked at; nothing is ever deleted.
    * ``SlotFile``: one page size's open slot file and its slots' state. Slot ``s`` lies at
      ``s * stride``: the page size rounded up to ``ALIGN`` (O_DIRECT's unit), so a page size
      that is not a multiple of it (a registered pool's: a layer count times an odd per-layer
      size) is padded on disk.
    * ``foreign_entry(directory) -> str | None``: why the directory is not the tier's (it holds
      none of the store's files and an entry other than ``LOCK_NAME``, a probe or
      ``lost+found``), else None.
    * ``check_page_size(page_size)``: ``InvalidArgument`` unless positive.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from kvtier.errors import InvalidArgument
from kvtier.tiers.base import DiskRecord
from kvtier.tiers.disk_index import INDEX_NAME, INDEX_TMP
from kvtier.tiers.disk_journal import journal_generation
from kvtier.tiers.diskio import ALIGN, entry_problem

_FILE_RE = re.compile(r"^pages-(\d+)\.dat$")
LOCK_NAME = "kvtier.lock"  # the daemon's instance lock in the directory (server/preflight.py)
# Not the store's, yet no sign the directory is someone else's: a file system's own folder at
# the root of a disk mounted for the tier, and the probes it writes and removes at once.
_TOLERATED = ("lost+found",)
_PROBES = (".kvtier-probe-", ".direct-probe-")


@dataclass(slots=True)
class SlotFile:
    """One page size's slot file and its slots' state (the store's lock guards it)."""

    page_size: int
    fd: int
    nslots: int = 0
    free: list[int] = field(default_factory=list)  # a heap of free slots below nslots
    used: set[int] = field(default_factory=set)
    sums: dict[int, int] = field(default_factory=dict)  # durable checksums
    records: dict[int, DiskRecord] = field(default_factory=dict)

    @property
    def stride(self) -> int:
        """Bytes between slots in the file: the page size rounded up to ``ALIGN``."""
        return -(-self.page_size // ALIGN) * ALIGN


def page_file(directory: str, page_size: int) -> str:
    return os.path.join(directory, f"pages-{page_size}.dat")


def unusable_file(directory: str) -> str | None:
    """Why the store could not use an entry of ``directory`` named as one of its files (see
    the contract), or None. Entries it would ignore (other names) are not looked at."""
    for name in sorted(os.listdir(directory)):
        problem = entry_problem(os.path.join(directory, name), _access(name)) if (
            _is_own(name)) else None
        if problem is not None:
            return problem
    return None


def foreign_entry(directory: str) -> str | None:
    """Why ``directory`` is not the tier's to take, or None: it holds an entry that is not the
    store's (its files, the daemon's lock, a probe) and none that is. Such a directory is
    someone else's (``/``, a home, ``/tmp``), which the tier, tightening its mode and writing
    its files there, must never take; one the store already uses keeps whatever else is in it."""
    names = sorted(os.listdir(directory))
    if any(_is_own(name) for name in names):
        return None
    other = next((name for name in names if not (
        name == LOCK_NAME or name in _TOLERATED or name.startswith(_PROBES))), None)
    return None if other is None else (
        f"{directory} holds {other!r}, not the disk tier's: give the tier a directory of its own")


def _is_own(name: str) -> bool:
    return name in (INDEX_NAME, INDEX_TMP) or journal_generation(name) is not None or (
        page_file_size(name) is not None)


def _access(name: str) -> int | None:
    """How the store opens its file ``name`` (None: never; the temporary index is replaced)."""
    if page_file_size(name) is not None:
        return os.O_RDWR
    return None if name == INDEX_TMP else os.O_RDONLY


def page_file_size(name: str) -> int | None:
    """The page size of a slot file's name; None for any other name or an odd size."""
    m = _FILE_RE.match(name)
    size = int(m.group(1)) if m else 0
    return size if size > 0 else None


def check_page_size(page_size: int) -> None:
    if page_size <= 0:
        raise InvalidArgument("page_size", f"must be > 0, got {page_size}")
