"""The disk tier's directory for one ``OffloadedOptimizer``: opened for it alone.

``open_disk(path, budget_bytes) -> DiskHome``:
    * Takes an exclusive ``flock`` on the directory's lock file (``kvtier.lock``, the one a
      ``kvtier serve`` on that directory holds) before the store is opened: a second optimizer
      (in this process or another) or a daemon on the same directory is refused, before it
      touches any file, with :class:`~kvtier.errors.InvalidArgument` naming ``disk_path`` and
      the holder's pid. A directory holding someone else's files is refused before the lock
      file is created in it.
    * A path the store cannot use (empty, a file, unreachable, no permission) raises
      ``InvalidArgument("disk_path", ...)`` too, never a bare ``OSError``.
    * ``close()`` closes the store (its I/O threads and files) and then drops the lock; the
      lock file stays (unlinking it would let two openers lock different files).
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.tiers.disk_layout import LOCK_NAME, foreign_entry


class DiskHome:
    """A ``DiskStore`` and the lock that makes its directory this optimizer's alone."""

    def __init__(self, store: Any, lock_fd: int) -> None:
        self.store, self._fd = store, lock_fd

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self.store.close()
        finally:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = -1


def open_disk(path: str, budget_bytes: int) -> DiskHome:
    from kvtier.tiers.disk import DiskStore

    if not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise InvalidArgument("disk_path", f"{path!r}; accepted: a directory path")
    path = os.fspath(path)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        why = foreign_entry(path)
        if why is not None:
            raise InvalidArgument("disk_path", why)
        fd = os.open(os.path.join(path, LOCK_NAME),
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise InvalidArgument("disk_path", f"{path!r}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise InvalidArgument("disk_path", f"{path} is in use by another optimizer or kvtier "
                                           f"serve (pid {holder}): give each its own") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        store = DiskStore(path, budget_bytes, direct_io=True, io_threads=2)
    except OSError as exc:
        os.close(fd)
        raise InvalidArgument("disk_path", f"{path!r}: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    return DiskHome(store, fd)
