"""Descriptors a client handed over (SCM_RIGHTS): released without ever stalling the daemon.

The last close of a descriptor can block: a TCP socket with SO_LINGER behind a peer that does
not read waits out its linger time, a file on a FUSE mount waits for its flush. A client that
handed the daemon such a descriptor and closed its own copy stalled the thread that closed it:
the event loop, which serves every session, fast-lane and gRPC call (a 10 s linger: a
neighbour's attach took 10 s; an hour's: health checks timed out).

Contract:
    * ``close_handed(fds)``: a socket is set to reset on close (SO_LINGER on, 0 s) and closed
      at once; a memfd (what the daemon keeps) is closed at once; anything else is closed on a
      background thread of its own (one that blocks there holds up only the closes queued
      behind it, never the caller).
    * ``drain_handed(sock)``: the descriptors still queued on a connection about to be closed
      (closing it would release them in the kernel, on the closing thread), taken and
      ``close_handed``; at most ``DRAIN_READS`` reads.
    * ``refuse_rights(listener)``: connections accepted on ``listener`` take no descriptors
      (SO_PASSRIGHTS off, Linux 6.16+: the kernel refuses them to the sender); False where the
      kernel has no such option.
    * ``receive_space()``: an ancillary buffer for the most descriptors one message can carry
      (the kernel closes what does not fit, on the reading thread).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import socket
import stat
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

SO_PASSRIGHTS = getattr(socket, "SO_PASSRIGHTS", 83)
SCM_MAX_FD = 253  # the kernel's most descriptors per message
DRAIN_READS = 64
_RESET = struct.pack("ii", 1, 0)
_closer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-handed-close")


def receive_space() -> int:
    return socket.CMSG_SPACE(SCM_MAX_FD * 4)


def close_handed(fds: Iterable[int]) -> None:
    for fd in fds:
        if _closes_at_once(fd):
            os.close(fd)
        else:
            _closer.submit(_close_quietly, fd)


def _closes_at_once(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return True  # not open: nothing to wait for
    if stat.S_ISSOCK(mode):
        try:
            _reset_on_close(fd)
        except OSError:
            return False
        return True
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)  # a memfd: its close frees memory, never waits
    except OSError:
        return False
    return True


def _reset_on_close(fd: int) -> None:
    s = socket.socket(fileno=fd)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    finally:
        s.detach()  # the descriptor stays the caller's to close


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors in ``recvmsg``'s ancillary data."""
    out: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            out.extend(fds)
    return out


def drain_handed(sock: socket.socket) -> None:
    for _ in range(DRAIN_READS):
        try:
            data, anc, _, _ = sock.recvmsg(1 << 16, receive_space(),
                                           socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
        except OSError:
            return
        close_handed(fds_of(anc))
        if not data and not anc:
            return


def refuse_rights(listener: socket.socket) -> bool:
    try:
        listener.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
    except OSError:
        return False
    return True
