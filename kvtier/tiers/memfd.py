"""Sealed memfds: shared memory that no process holding it can shrink, grow or unseal.

CPU-mode page pools (and engine memory registered with the daemon) are anonymous memory files
(``memfd_create``) sealed with ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``. A process that maps
one can't be killed by SIGBUS through a peer truncating the file, no name exists in any file
system (nothing to leak in ``/dev/shm``, nothing another tenant can open by path), and the memory
is freed when the last descriptor and mapping are gone, ``kill -9`` included.

Contract:
    * ``create(nbytes, name) -> fd``: a new sealed memfd of exactly ``nbytes`` (close-on-exec).
    * ``check(fd, need, field)``: ``FailedPrecondition`` naming ``field`` unless ``fd`` is a memfd
      carrying the three seals, not sealed against writes, backed by shmem (not hugetlbfs: a
      hole punched there releases the huge page reservation, and a later fault could SIGBUS),
      and holding at least ``need`` bytes.
    * ``map_shared(fd, nbytes) -> Tensor``: the first ``nbytes`` as a writable shared 1-D
      ``uint8`` tensor; the mapping outlives ``fd`` (the caller may close it at once).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import stat

import torch

from kvtier.errors import FailedPrecondition

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
TMPFS_MAGIC = 0x01021994  # memfds without MFD_HUGETLB live on the kernel's internal tmpfs
_NO_WRITE = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)


def create(nbytes: int, name: str = "kvtier") -> int:
    """A memfd of ``nbytes`` bytes, sealed so that its size can never change."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError:
        os.close(fd)
        raise
    return fd


def check(fd: int, need: int, field: str) -> None:
    """Refuse anything but a sealed, writable memfd of at least ``need`` bytes."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        st = os.fstat(fd)
    except OSError:
        raise FailedPrecondition(f"{field}: not a memfd (F_GET_SEALS failed)") from None
    if seals & SEALS != SEALS:
        raise FailedPrecondition(
            f"{field}: memfd must be sealed with F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL")
    if seals & _NO_WRITE:
        raise FailedPrecondition(f"{field}: memfd is sealed against writes")
    if _fs_magic(fd) != TMPFS_MAGIC:
        raise FailedPrecondition(f"{field}: memfd must be plain shmem (no MFD_HUGETLB)")
    if not stat.S_ISREG(st.st_mode) or st.st_size < need:
        raise FailedPrecondition(f"{field}: memfd holds {st.st_size} bytes, needs {need}")


def _fs_magic(fd: int) -> int:
    """``fstatfs(fd).f_type`` (the first field of ``struct statfs`` on Linux), -1 on failure."""
    buf = ctypes.create_string_buffer(256)  # larger than struct statfs on every Linux ABI
    if ctypes.CDLL(None, use_errno=True).fstatfs(fd, buf) != 0:
        return -1
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def map_shared(fd: int, nbytes: int) -> torch.Tensor:
    """Map the first ``nbytes`` of ``fd`` shared and writable (the tensor keeps the mapping).

    Maps through ``/proc/self/fd`` so that no descriptor stays open per mapping (``mmap.mmap``
    keeps a duplicate for each: thousands of registered segments would exhaust the limit)."""
    if nbytes <= 0:
        raise ValueError(f"cannot map {nbytes} bytes")
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
