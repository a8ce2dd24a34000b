"""Descriptors a client hands the daemon (``server/handed.py``) and fast-lane clients that never
read: neither can stall or exhaust the daemon for other clients. Real daemon, real sockets."""

from __future__ import annotations

import array
import contextlib
import socket
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kvtier.server import fastlane, fdpass
from kvtier_daemon_fixture import Daemon, free_port, serve_args, with_fd_limit

LINGER_S = 10


@contextmanager
def lingering_socket() -> Iterator[socket.socket]:
    """A TCP socket whose last close waits ``LINGER_S``: SO_LINGER on, its peer never reads and
    its send buffer is full. The caller closes it once handed over (the daemon then holds the
    last reference); the peer stays until the block ends."""
    peer = socket.socket()
    peer.bind(("127.0.0.1", 0))
    peer.listen(1)  # never accepted, never read
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    s.connect(peer.getsockname())
    s.setblocking(False)
    try:
        while True:
            s.send(b"x" * 65536)
    except BlockingIOError:
        pass
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, LINGER_S))
    try:
        yield s
    finally:
        s.close()
        peer.close()


def hand_over(path: str, frame: bytes, fds: list[int]) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    conn.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    return conn


def served_within(d: Daemon, seconds: float) -> float:
    """A neighbour's attach, store and load: how long they took (at most ``seconds``)."""
    start = time.monotonic()
    with d.client("neighbour", timeout=seconds) as c:
        att = c.attach(2)
        got = c.allocate(att, 1)
        assert got is not None and att.tensor is not None
        att.tensor[got[0][1]].fill_(7)
        assert c.store(att, [b"n"], [got[0][1]]) == 1
        assert c.load(att, [b"n"], [got[0][1]]) == 1
    return time.monotonic() - start


@pytest.mark.parametrize("how", ["redeem", "deposit"])
def test_a_lingering_socket_handed_to_the_session_socket_stalls_nobody(
        daemon: Daemon, how: str) -> None:
    """The daemon's last close of a handed-over TCP socket with SO_LINGER behind a peer that
    never reads blocked its event loop for the linger time: a neighbour's attach took ~10 s
    (an hour's linger: health checks timed out)."""
    path = daemon.address[len("unix://"):] + ".fd"
    tenant = b"h"
    with lingering_socket() as s:
        if how == "redeem":  # a frame that keeps no descriptor
            conn = hand_over(path, fdpass.REQUEST.pack(fdpass.REDEEM, 1, bytes(32)) + tenant,
                             [s.fileno()])
        else:  # two descriptors where one is allowed: both refused
            conn = hand_over(path, fdpass.REQUEST.pack(fdpass.DEPOSIT, 1, bytes(32)) + tenant,
                             [s.fileno(), s.fileno()])
        s.close()  # the daemon holds the last reference
        time.sleep(0.3)
        assert served_within(daemon, LINGER_S / 2) < LINGER_S / 2
    conn.close()


def test_the_fast_lane_takes_no_descriptors(daemon: Daemon) -> None:
    """One passed with a frame was released by the kernel in the event loop's own read."""
    path = daemon.address[len("unix://"):] + ".fast"
    frame = fastlane.REQUEST.pack(fastlane.ACQUIRE, 1, 1, bytes(16)) + struct.pack("<q", 0)
    with lingering_socket() as s:
        try:
            conn = hand_over(path, frame, [s.fileno()])
        except PermissionError:
            conn = None  # the kernel refused it to us (SO_PASSRIGHTS: Linux 6.16+) ...
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # ... and our close is the last: not one to wait for here
        time.sleep(0.3)
        assert served_within(daemon, LINGER_S / 2) < LINGER_S / 2
    if conn is not None:
        conn.close()
    if not fdpass_rights_refusable():
        pytest.skip("this kernel has no SO_PASSRIGHTS: the sender was not refused")
    assert conn is None


def fdpass_rights_refusable() -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, 83, 0)
        except OSError:
            return False
    return True


def test_fast_lane_clients_that_never_read_stay_within_the_cap(
        spawn: Callable[..., Daemon], tmp_path: Path) -> None:
    """Connections whose replies were never read sat in drain(); the cap's eviction closed them
    with close(), which waits to send their buffered replies: each kept its descriptor and
    buffers while no longer counted. 5,000 such connections held 5,010 descriptors and 1.27 GB;
    under a limit of 2,048, another tenant's Attach failed (EMFILE). Now an evicted connection
    is aborted at once, and one that leaves its replies unread is dropped after DRAIN_S."""
    limit = 512  # lane connections: 64
    d = spawn(args=with_fd_limit(serve_args(tmp_path, disk=tmp_path / "disk",
                                            metrics_port=free_port()), limit))
    fds = Path(f"/proc/{d.proc.pid}/fd")
    path = d.address[len("unix://"):] + ".fast"
    with d.client("hog") as c:
        att = c.attach(4)
        got = c.allocate(att, 1)
        assert got is not None and att.fast_lane is not None
        frame = (fastlane.REQUEST.pack(fastlane.ACQUIRE, 4096, att.pool_id,
                                       att.fast_lane._capability)
                 + struct.pack("<q", got[0][0]) * 4096)  # a 16 KiB reply each
        base = len(list(fds.iterdir()))
        held = []
        for _ in range(4 * (limit // 8)):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2)
            s.connect(path)
            with contextlib.suppress(TimeoutError):
                s.sendall(frame * 20)  # replies never read
            held.append(s)
        time.sleep(1.0)
        assert len(list(fds.iterdir())) - base <= limit // 8 + 8
        assert served_within(d, 10) < 10
        for s in held:
            s.close()
    assert "Traceback" not in d.output()
