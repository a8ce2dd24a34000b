"""One daemon per socket and per disk directory: an exclusive ``flock`` held for the process's life.

``hold(path, setting, what)`` opens (creating) ``path``, takes ``LOCK_EX | LOCK_NB`` on it and
writes this process's pid into it. The kernel drops the lock when the process exits, however it
exits, so a crashed daemon never blocks the next start (its stale socket is then replaced). A
second start gets a :class:`ConfigError` naming the setting and the holder's pid, before it has
touched the socket, the fast-lane socket, the metrics port or the disk directory's files.
Lock files are left in place on exit: unlinking one would let two starts lock different inodes.
"""

from __future__ import annotations

import fcntl
import os

from kvtier.errors import ConfigError

LOCK_MODE = 0o640


class PidLock:
    """A held lock; ``release`` (or process exit) gives it up."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def hold(path: str, setting: str, what: str) -> PidLock:
    """Lock ``path`` for this process or raise ConfigError "<setting>: <what> is in use ..."."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, LOCK_MODE)
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot open lock file {path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _pid_in(fd)
        os.close(fd)
        raise ConfigError(
            f"{setting}: {what} is in use by another kvtier serve (pid {holder}; lock {path})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return PidLock(path, fd)


def _pid_in(fd: int) -> str:
    """The holder's pid as written, or "unknown" (it may not have written it yet)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"
