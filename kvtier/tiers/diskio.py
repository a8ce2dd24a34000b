"""Aligned positioned I/O helpers for the disk tier (O_DIRECT needs 4 KiB-aligned buffers,
offsets and lengths: slots lie at multiples of 4 KiB, and a buffer or a page size that is not
aligned goes through a bounce buffer), and
the opening of its files: every one through ``open_regular``, which follows no symbolic link and
opens nothing but a regular file, so an entry planted in the directory can never make the tier
chmod or write anything outside it."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Sequence

import torch

ALIGN = 4096
LOG_EVERY_S = 10.0  # an error that repeats (a full disk) is logged at most this often
log = logging.getLogger(__name__)


def cbuf(ptr: int, nbytes: int) -> ctypes.Array[ctypes.c_char]:
    """A zero-copy buffer over ``[ptr, ptr + nbytes)``; its owner must outlive it."""
    return (ctypes.c_char * nbytes).from_address(ptr)


def view(t: torch.Tensor, nbytes: int) -> memoryview:
    return memoryview(cbuf(t.data_ptr(), nbytes)).cast("B")


def coalesce(
    page_size: int, slots: Sequence[int], bufs: Sequence[torch.Tensor], stride: int = 0
) -> list[tuple[int, int, int, list[int]]]:
    """``(file offset, buffer address, nbytes, positions)`` per run of slots adjacent both on
    disk and in memory, so a batch from one host run is one system call. Slot ``s`` lies at
    ``s * stride`` (default ``page_size``); padded slots (``stride > page_size``) are never
    adjacent: one run per page."""
    stride = stride or page_size
    out: list[tuple[int, int, int, list[int]]] = []
    for i, (s, t) in enumerate(zip(slots, bufs, strict=True)):
        ptr = t.data_ptr()
        if out:
            off, start, n, pos = out[-1]
            if off + n == s * stride and start + n == ptr:
                out[-1] = (off, start, n + page_size, [*pos, i])
                continue
        out.append((s * stride, ptr, page_size, [i]))
    return out


def transfer(fd: int, offset: int, ptr: int, nbytes: int, *, write: bool, direct: bool) -> bool:
    """One positioned transfer of ``nbytes`` at ``ptr``; False on an I/O error or a short file.
    Under O_DIRECT (``direct``) a buffer or a length that is not 4 KiB aligned goes through a
    bounce buffer of the length rounded up (a padded slot: zeros written after the page, the
    padding read and dropped)."""
    bounce: mmap.mmap | None = None
    user = memoryview(cbuf(ptr, nbytes)).cast("B")
    buf, total = user, nbytes
    try:
        if direct and (ptr % ALIGN or nbytes % ALIGN):
            total = -(-nbytes // ALIGN) * ALIGN
            bounce, buf = _bounce(total)
            if write:
                buf[:nbytes] = user
                buf[nbytes:] = bytes(total - nbytes)  # the padding: zeros, not older bytes
        done = 0
        while done < total:
            if write:
                k = os.pwrite(fd, buf[done:], offset + done)
            else:
                k = os.preadv(fd, [buf[done:]], offset + done)
            if k <= 0:
                raise OSError(errno.EIO, "short transfer past end of file")
            done += k
        if bounce is not None and not write:
            user[:] = buf[:nbytes]
        return True
    except OSError:
        return False
    finally:
        if bounce is not None:
            buf.release()
            if bounce is not getattr(_KEPT, "map", None):
                bounce.close()


KEEP_BOUNCE = 16 << 20  # a bounce buffer up to this size stays with its I/O thread
_KEPT = threading.local()


def _bounce(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """A page-aligned buffer of ``nbytes`` (``mmap``: aligned as O_DIRECT needs): the calling
    thread's own, grown as needed, up to ``KEEP_BOUNCE`` (mapping fresh memory for every page
    faults and zeroes it: a padded 1 MiB page read at a third of the disk's speed); a larger one
    is mapped for this transfer only."""
    kept: mmap.mmap | None = getattr(_KEPT, "map", None)
    if nbytes > KEEP_BOUNCE:
        fresh = mmap.mmap(-1, nbytes)
        return fresh, memoryview(fresh)
    if kept is None or len(kept) < nbytes:
        if kept is not None:
            kept.close()
        kept = _KEPT.map = mmap.mmap(-1, nbytes)
    return kept, memoryview(kept)[:nbytes]


def extend(fd: int, offset: int, nbytes: int) -> bool:
    """Reserve ``[offset, offset + nbytes)``; on failure the file keeps its old size."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            os.ftruncate(fd, offset)
            return False
    try:
        os.ftruncate(fd, offset + nbytes)  # no fallocate here: a sparse file still works
        return True
    except OSError:
        return False


def probe_direct(directory: str) -> bool:
    """Whether an aligned O_DIRECT write works in ``directory`` (tmpfs, some FUSE: no). The probe
    file is created afresh (``O_EXCL``: never an existing file or a link's target) and removed."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT,
                     PRIVATE_FILE)
    except OSError as exc:
        buf.close()
        if exc.errno != errno.EEXIST:  # not someone else's entry: an open that failed late
            with contextlib.suppress(OSError):  # (EINVAL after creating it) leaves ours
                os.unlink(probe)
        return False
    try:
        return os.pwrite(fd, buf, 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)


PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISLNK, "symbolic link"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def private_dir(path: str) -> None:
    """Create ``path`` as 0700 whatever the umask; an existing directory loses every "other" bit
    and group write (it lists tenants' keys), so it ends at most 0750. A directory this process
    may use but not chmod (another owner) is used as it is, with a warning."""
    os.makedirs(path, mode=PRIVATE_DIR, exist_ok=True)
    mode = os.stat(path).st_mode & 0o7777
    if mode & 0o027:
        try:
            os.chmod(path, mode & 0o750)
        except PermissionError:
            log.warning("disk tier directory %s is mode %o and not ours to tighten", path, mode)


def open_regular(path: str, flags: int) -> int:
    """``os.open`` of a tier file that is a regular file itself: a symbolic link is never
    followed (its target is never opened, let alone changed) and a directory, FIFO, socket or
    device is refused, with an ``OSError`` naming ``path`` and what it is."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, PRIVATE_FILE)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV):
            raise
        kind = file_kind(os.lstat(path).st_mode)
        raise OSError(exc.errno, f"is a {kind}, not a regular file", path) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"is a {file_kind(mode)}, not a regular file", path)
        os.set_blocking(fd, True)  # O_NONBLOCK only kept a FIFO's open from waiting
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def open_private(path: str, flags: int) -> int:
    """``open_regular(path, flags | O_CREAT)`` of a tier file, made private (``private_fd``)."""
    fd = open_regular(path, flags | os.O_CREAT)
    try:
        private_fd(fd, path)  # an existing file keeps its old mode through O_CREAT
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_fd(fd: int, path: str) -> None:
    """An open file of the tier: ours (``PermissionError`` naming ``path`` and its owner
    otherwise), with no "other" bits and no group write, whatever made it. A file another
    user made (in a directory it could write, before the daemon wrote there) was used as it
    was: its owner read every page written to it."""
    st = os.fstat(fd)
    problem = _not_ours(path, st.st_uid)
    if problem is not None:
        raise PermissionError(errno.EPERM, problem, path)
    mode = st.st_mode & 0o7777
    if mode & 0o027:
        os.fchmod(fd, mode & 0o640)


def _not_ours(path: str, uid: int) -> str | None:
    me = os.geteuid()
    if uid == me:
        return None
    return (f"{path} belongs to uid {uid}, not to this daemon's uid {me}: its owner could read "
            "every page written to it; remove it (or chown it to the daemon's user)")


def entry_problem(path: str, flags: int | None) -> str | None:
    """Why the tier could not use the entry at ``path`` (absent is fine): anything but a regular
    file, another user's file, or one that ``flags`` (``O_RDONLY``/``O_RDWR``; None: no open is
    tried) can't open."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is a {file_kind(st.st_mode)}, not a regular file: move it out of the way"
    if (problem := _not_ours(path, st.st_uid)) is not None:
        return problem
    if flags is None:
        return None
    try:
        os.close(open_regular(path, flags))
    except FileNotFoundError:
        return None
    except OSError as exc:
        how = "read" if flags & os.O_ACCMODE == os.O_RDONLY else "read and written"
        return f"{path} cannot be {how}: {exc.strerror}"
    return None


class Throttle:
    """An error repeated while a condition lasts (a full disk) is logged at most once per
    ``every_s`` seconds, with the count of the repeats not logged. Not thread-safe: callers
    hold their own lock."""

    __slots__ = ("_held", "_next", "every_s", "failures")

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self.failures = 0  # since the last success
        self._held = 0
        self._next = 0.0

    def fail(self) -> int | None:
        """Count a failure: None to keep quiet, else the repeats not logged since the last one."""
        self.failures += 1
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return None
        held, self._held, self._next = self._held, 0, now + self.every_s
        return held

    def succeed(self) -> int:
        """The failures before this success (0: none); the next failure is logged at once."""
        n, self.failures, self._held, self._next = self.failures, 0, 0, 0.0
        return n
