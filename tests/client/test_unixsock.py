"""Connecting to a unix socket whose listen backlog is full, with real sockets."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from kvtier.client.unixsock import connect_unix


def _full(path: Path) -> tuple[socket.socket, list[socket.socket]]:
    """A listener that accepts nothing, and connections until its backlog is full."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    queued = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(path))
        except BlockingIOError:
            s.close()
            return listener, queued
        queued.append(s)


def test_a_full_backlog_is_waited_out_within_the_timeout(tmp_path: Path) -> None:
    """A socket with a timeout connects non-blocking: a full backlog answered EAGAIN at once,
    and the session (Attach, Register) failed while the daemon was merely busy accepting."""
    listener, queued = _full(tmp_path / "s")
    with listener:
        with pytest.raises(BlockingIOError):  # what a plain connect with a timeout gets
            _connect_once(str(tmp_path / "s"))

        def drain() -> None:
            time.sleep(0.3)
            listener.accept()[0].close()

        t = threading.Thread(target=drain)
        t.start()
        t0 = time.monotonic()
        sock = connect_unix(str(tmp_path / "s"), timeout=5)
        took = time.monotonic() - t0
        t.join()
        sock.close()
        assert took >= 0.25  # it waited for the room, not for an error
    for s in queued:
        s.close()


def test_a_full_backlog_past_the_timeout_and_a_missing_socket_raise(tmp_path: Path) -> None:
    listener, queued = _full(tmp_path / "s")
    with listener:
        t0 = time.monotonic()
        with pytest.raises(BlockingIOError):
            connect_unix(str(tmp_path / "s"), timeout=0.3)
        assert 0.25 <= time.monotonic() - t0 < 3
    for s in queued:
        s.close()
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError):
        connect_unix(str(tmp_path / "absent"), timeout=5)
    assert time.monotonic() - t0 < 1  # no daemon there: said at once


def _connect_once(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(path)
    finally:
        s.close()
