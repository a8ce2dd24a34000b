"""Aligned positioned I/O helpers for the disk tier (O_DIRECT needs 4 KiB-aligned buffers,
offsets and lengths; page sizes are multiples of 4 KiB, so only buffers can be misaligned)."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence

import torch

ALIGN = 4096
log = logging.getLogger(__name__)


def cbuf(ptr: int, nbytes: int) -> ctypes.Array[ctypes.c_char]:
    """A zero-copy buffer over ``[ptr, ptr + nbytes)``; its owner must outlive it."""
    return (ctypes.c_char * nbytes).from_address(ptr)


def view(t: torch.Tensor, nbytes: int) -> memoryview:
    return memoryview(cbuf(t.data_ptr(), nbytes)).cast("B")


def coalesce(
    page_size: int, slots: Sequence[int], bufs: Sequence[torch.Tensor]
) -> list[tuple[int, int, int, list[int]]]:
    """``(file offset, buffer address, nbytes, positions)`` per run of slots adjacent both on
    disk and in memory, so a batch from one host run is one system call."""
    out: list[tuple[int, int, int, list[int]]] = []
    for i, (s, t) in enumerate(zip(slots, bufs, strict=True)):
        ptr = t.data_ptr()
        if out:
            off, start, n, pos = out[-1]
            if off + n == s * page_size and start + n == ptr:
                out[-1] = (off, start, n + page_size, [*pos, i])
                continue
        out.append((s * page_size, ptr, page_size, [i]))
    return out


def transfer(fd: int, offset: int, ptr: int, nbytes: int, *, write: bool, direct: bool) -> bool:
    """One positioned transfer of ``nbytes`` at ``ptr``; False on an I/O error or a short file.
    Under O_DIRECT (``direct``) a buffer that is not 4 KiB aligned goes through a bounce buffer."""
    bounce: mmap.mmap | None = None
    user = memoryview(cbuf(ptr, nbytes)).cast("B")
    buf = user
    try:
        if direct and ptr % ALIGN:
            bounce = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT needs
            buf = memoryview(bounce)
            if write:
                buf[:] = user
        done = 0
        while done < nbytes:
            if write:
                k = os.pwrite(fd, buf[done:], offset + done)
            else:
                k = os.preadv(fd, [buf[done:]], offset + done)
            if k <= 0:
                raise OSError(errno.EIO, "short transfer past end of file")
            done += k
        if bounce is not None and not write:
            user[:] = buf
        return True
    except OSError:
        return False
    finally:
        if bounce is not None:
            buf.release()
            bounce.close()


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
    """Whether an aligned O_DIRECT write works in ``directory`` (tmpfs, some FUSE: no)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            return os.pwrite(fd, buf, 0) == ALIGN
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        buf.close()
        if os.path.exists(probe):
            os.unlink(probe)


PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


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


def open_private(path: str, flags: int) -> int:
    """``os.open(path, flags | O_CREAT)`` of a tier file, made private (``private_fd``)."""
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE)
    private_fd(fd)  # an existing file keeps its old mode through O_CREAT
    return fd


def private_fd(fd: int) -> None:
    """An open file of the tier: no "other" bits and no group write, whatever made it."""
    mode = os.fstat(fd).st_mode & 0o7777
    if mode & 0o027:
        os.fchmod(fd, mode & 0o640)
